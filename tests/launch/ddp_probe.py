"""Training script for the launch tests: a few DDP steps, then each rank writes what it saw."""

import json
import os
import sys

import torch
from accelerate import Accelerator

acc = Accelerator()
torch.manual_seed(acc.process_index)  # different init on each rank: DDP must broadcast rank 0's
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = acc.prepare(model, optimizer)
data = torch.Generator().manual_seed(100 + acc.process_index)  # different data on each rank
for _ in range(3):
    x, y = torch.randn(4, 8, generator=data), torch.randn(4, 1, generator=data)
    loss = ((model(x) - y) ** 2).mean()
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
out = os.environ["PROBE_OUT"]
with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
    json.dump({
        "rank": acc.process_index,
        "world_size": acc.num_processes,
        "distributed_type": str(acc.distributed_type),
        "env": {k: os.environ.get(k) for k in ("ACCELERATE_USE_CPU", "OMP_NUM_THREADS", "PROBE_MARKER", "NCCL_SOCKET_IFNAME")},
        "params": [p.detach().flatten().tolist() for p in acc.unwrap_model(model).parameters()],
        "argv": sys.argv[1:],
    }, f)

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.process_group import leave_process_group  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)

leave_process_group()  # Gloo's threads could otherwise abort the exit (see hf_gpu_train/process_group.py)
