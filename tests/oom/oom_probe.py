"""Launched with 2 gloo processes: OOM injected on rank 1 only; each rank writes its final weights."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from transformers import Trainer  # noqa: E402

from hf_gpu_train.oom import OOMFaultInjector, enable_oom_recovery  # noqa: E402
from tests.callbacks.tiny import TokenDataset  # noqa: E402
from tests.oom.test_oom import exact_bert, oom_args  # noqa: E402

out, phase = sys.argv[1], sys.argv[2]
model = exact_bert()
OOMFaultInjector(max_batch=2, rank=1, phase=phase).install(model)
trainer = Trainer(model=model, args=oom_args(out, per_device_train_batch_size=4), train_dataset=TokenDataset(n=64))
recovery = enable_oom_recovery(trainer)
trainer.train()
rank = trainer.accelerator.process_index
torch.save({"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "micro_batch": recovery.micro_batch, "global_step": trainer.state.global_step}, f"{out}/rank{rank}.pt")

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.process_group import leave_process_group  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)

leave_process_group()  # Gloo's threads could otherwise abort the exit (see hf_gpu_train/process_group.py)
