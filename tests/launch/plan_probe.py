"""Training script for the plan tests: find and apply the plan first, then a DDP all-reduce; each rank writes
what it saw. Exit 2 with the one line when the plan cannot reach the run (as scripts/finetune.py does)."""

import json
import os
import sys

from hf_gpu_train.plan.run_plan import RunPlanError, apply_run_environment, load_run_plan

try:
    plan = load_run_plan()
except RunPlanError as error:
    print(f"probe: error: {error}", file=sys.stderr)
    sys.exit(2)
report = apply_run_environment(plan) if plan is not None else None

import torch  # noqa: E402 - after the environment, as a training script must
from accelerate import Accelerator  # noqa: E402

acc = Accelerator()
total = torch.tensor([float(acc.process_index + 1)])
if acc.num_processes > 1:
    torch.distributed.all_reduce(total)
with open(os.path.join(os.environ["PROBE_OUT"], f"rank{acc.process_index}.json"), "w") as f:
    json.dump({
        "rank": acc.process_index,
        "world_size": acc.num_processes,
        "distributed_type": str(acc.distributed_type),
        "all_reduce": total.item(),
        "torch_threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k) for k in ("ACCELERATE_USE_CPU", "OMP_NUM_THREADS", "PROBE_MARKER", "MASTER_PORT")},
        "plan": None if plan is None else {
            "source": plan.source, "machine": plan.machine, "precision": plan.value("precision"),
            "launch_overrides": [list(o) for o in plan.launch_overrides],
            "applied": [list(a) for a in report.applied], "replaced": [list(r) for r in report.replaced],
            "kept": [list(k) for k in report.kept]},
    }, f)

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.process_group import leave_process_group  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)

leave_process_group()  # Gloo's threads could otherwise abort the exit (see hf_gpu_train/process_group.py)
