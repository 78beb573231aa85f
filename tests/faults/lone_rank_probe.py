"""A user's own Trainer under a DeepSpeed launch on CPU processes: ``TrainingArguments`` as ``sys.argv[2]`` says
(``plain``: neither use_cpu nor ddp_backend; ``use_cpu``; ``gloo``), then ``attach_telemetry``. Each rank writes what
its accelerator saw, or the error, to ``sys.argv[1]/rankN.json``."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from hf_gpu_train.callbacks import attach_telemetry  # noqa: E402
from hf_gpu_train.collectives.lone_rank import LoneRank  # noqa: E402
from hf_gpu_train.process_group import leave_process_group  # noqa: E402

out, mode = Path(sys.argv[1]), sys.argv[2]
options = {"plain": {}, "use_cpu": {"use_cpu": True}, "gloo": {"ddp_backend": "gloo"}}[mode]
args = TrainingArguments(output_dir=str(out / "run"), per_device_train_batch_size=2, report_to=[], **options)
trainer = Trainer(model=torch.nn.Linear(2, 2), args=args)
seen = {"num_processes": trainer.accelerator.num_processes, "deepspeed": trainer.is_deepspeed_enabled}
try:
    attach_telemetry(trainer)
except LoneRank as error:
    seen["refused"] = str(error)
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(seen))
leave_process_group()
