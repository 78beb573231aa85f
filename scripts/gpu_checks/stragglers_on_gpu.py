"""Issue 39 on the GPU: straggler attribution where CUDA events decide (scripts/gpu_check.py's ``stragglers``).

1. One GPU: ``PhaseClock`` on a CUDA model, with a kernel that keeps the GPU busy for ``SPIN_MS`` inside the backward
   (``torch.cuda._sleep``, launched from a gradient hook: the host returns at once). The backward phase must hold the
   spin (CUDA events); a host clock would see only the launch. Printed: the backward per step, with and without the spin.
2. Two GPUs or more: ``tests/callbacks/straggler_probe.py`` on 2 NCCL processes (``STRAGGLER_ON_GPU=1``: the tiny BERT
   on the GPU, rank 1's delay a GPU spin in its backward, or the host sleep in its data loading): the rank and phase
   named, and the step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SPIN_MS = 30.0


def spin(milliseconds: float) -> None:
    """Keep the current stream's GPU busy for about ``milliseconds`` (``torch.cuda._sleep`` counts clock cycles)."""
    import torch

    rate = torch.cuda.get_device_properties(torch.cuda.current_device()).clock_rate  # kHz
    torch.cuda._sleep(int(milliseconds * rate))


def backward_seconds(spin_ms: float, steps: int = 12) -> dict[str, float]:
    """Per-step seconds by phase of a small CUDA model, ``spin_ms`` spun inside each backward."""
    import torch

    from hf_gpu_train.callbacks.arrivals import PhaseClock

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if spin_ms:
        model[2].weight.register_hook(lambda grad: (spin(spin_ms), grad)[1])  # early in the backward: the last layer
    clock = PhaseClock(torch.device("cuda")).install(None, model)
    data = torch.randn(64, 1024, device="cuda")
    for _ in range(steps + 1):  # the first step is left out by the clock
        clock.step_begin()
        model(data).square().mean().backward()
        clock.optimizer_begins()
        optimizer.step()
        clock.optimizer_ends()
        optimizer.zero_grad()
        clock.step_end()
    sums = clock.take()
    clock.remove()
    return {key: value / max(1.0, sums["steps"]) for key, value in sums.items() if key != "steps"}


def check_stragglers(root: Path) -> bool:
    import torch

    plain, spun = backward_seconds(0.0), backward_seconds(SPIN_MS)
    added_ms = 1000 * (spun["backward"] - plain["backward"])
    print(f"one GPU: backward per step {1000 * plain['backward']:.2f} ms; with a {SPIN_MS:.0f} ms GPU spin inside it "
          f"{1000 * spun['backward']:.2f} ms (+{added_ms:.1f} ms; CUDA events: a host clock sees the launch only)")
    ok = added_ms >= 0.8 * SPIN_MS
    if torch.cuda.device_count() < 2:
        print("two NCCL processes: skipped (one GPU here)")
        return ok
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "nccl"
        made = subprocess.run([sys.executable, "-m", "hf_gpu_train", "config", "--num-processes", "2", "--output", str(config)],
                              capture_output=True, text=True, cwd=root)
        if made.returncode != 0:
            print(made.stderr[-2000:])
            return False
        run = subprocess.run([sys.executable, "-m", "hf_gpu_train", "launch", "--config-file", f"{config}.yaml",
                              str(root / "tests" / "callbacks" / "straggler_probe.py"), str(Path(tmp) / "out"), "none", "data",
                              "backward"], capture_output=True, text=True, cwd=root,
                             env={**os.environ, "PYTHONPATH": str(root), "STRAGGLER_ON_GPU": "1"}, timeout=900)
        if run.returncode != 0:
            print(run.stderr[-3000:])
            return False
        for case in ("none", "data", "backward"):
            named = json.loads((Path(tmp) / "out" / case / "rank-0.json").read_text())["named"]
            found = sorted({(n["rank"], n["phase"], n["since_step"]) for n in named})
            print(f"two NCCL processes, delay in {case}: named {found or 'nothing'}")
            expected = set() if case == "none" else {(1, case)}
            ok = ok and {(r, p) for r, p, _ in found} == expected
    return ok
