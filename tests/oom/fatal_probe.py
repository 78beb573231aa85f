"""Launched with 2 gloo processes: rank 1 cannot fit even one sample, in a micro-step without gradient sync
(accumulation 2). Every rank must raise OutOfMemoryAtMicroBatchOne at the same point, and the process group must
still work afterwards (no rank left inside a collective)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from transformers import Trainer  # noqa: E402

from hf_gpu_train.oom import OOMFaultInjector, OutOfMemoryAtMicroBatchOne, enable_oom_recovery  # noqa: E402
from tests.callbacks.tiny import TokenDataset  # noqa: E402
from tests.oom.test_oom import exact_bert, oom_args  # noqa: E402

out = sys.argv[1]
model = exact_bert()
OOMFaultInjector(max_batch=0, rank=1, phase="forward").install(model)
trainer = Trainer(model=model, args=oom_args(out, per_device_train_batch_size=4, gradient_accumulation_steps=2),
                  train_dataset=TokenDataset(n=64))
enable_oom_recovery(trainer)
raised = False
try:
    trainer.train()
except OutOfMemoryAtMicroBatchOne:
    raised = True
rank = trainer.accelerator.process_index
after = torch.ones(1)
torch.distributed.all_reduce(after)  # both ranks reach this: nobody is stuck in the step's collectives
Path(out, f"rank{rank}.json").write_text(json.dumps({"raised": raised, "all_reduce_after": float(after.item())}))

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.process_group import leave_process_group  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)

leave_process_group()  # Gloo's threads could otherwise abort the exit (see hf_gpu_train/process_group.py)
