"""Straggler attribution by arrival (``callbacks/arrivals.py``) on 2 gloo processes: which rank and phase it names, how
many steps after the slowdown, and what it costs.

1. Attribution: ``tests/callbacks/straggler_probe.py`` runs the tiny BERT of the tests with telemetry as shipped, 29
   steps, once per case: 60 ms per step on rank 1 from step 10 on, in its data loading, its forward, its backward (the
   phase DDP's all-reduce hides), its optimizer step or its host work (a callback), and once without a delay. For each:
   the (rank, phase) named, the step it was named at, and the steps from the slowdown to the verdict.
2. Overhead: the same tiny Trainer with telemetry, the attribution on (``straggler_check_steps=5``, the default) and off
   (``0``), alternating in one process group, ``--rounds`` rounds of ``--steps`` steps: steps/s off against on. Goal
   (issue 39): >= 0.99. Two models: the probe's tiny BERT (a step of ~20-40 ms here, two processes on two cores) and
   ``step_overhead.py``'s smaller one (a step of ~10 ms, where one gloo all-reduce, ~1.4 ms on this machine, is a large
   part of a step).

    python benchmarks/stragglers.py [--rounds 5] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CASES = ("none", "data", "forward", "backward", "optimizer", "host")
ONSET = 10  # straggler_probe.py's first delayed step


def step_ends(trainer, callback_class) -> list[float]:
    """The times each step ends, filled while ``trainer`` trains (a callback that sets no control flag, and says so)."""
    ends: list[float] = []

    class StepClock(callback_class):
        hf_gpu_train_sets_flags_alike = True

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer.add_callback(StepClock())
    return ends


def overhead_worker(out: Path, rounds: int, steps: int) -> None:
    import logging

    from transformers import Trainer, TrainerCallback

    from benchmarks.step_overhead import tiny_trainer
    from hf_gpu_train.callbacks import attach_telemetry
    from hf_gpu_train.process_group import leave_process_group
    from tests.callbacks.tiny import TokenDataset, tiny_args, tiny_bert

    logging.disable(logging.WARNING)
    models = {"probe tiny BERT": lambda folder: Trainer(model=tiny_bert(), args=tiny_args(folder, max_steps=steps + 10,
                                                                                        logging_steps=10),
                                                    train_dataset=TokenDataset(n=8 * 2 * (steps + 10))),
              "step_overhead.py's": lambda folder: tiny_trainer(folder, steps + 10, 10)}
    seconds: dict[str, dict[str, list[float]]] = {name: {"on": [], "off": []} for name in models}
    for r in range(rounds):
        for name, make in models.items():
            for arm in (("on", "off") if r % 2 == 0 else ("off", "on")):
                trainer = make(out / f"{r}-{arm}")
                ends = step_ends(trainer, TrainerCallback)
                attach_telemetry(trainer, straggler_check_steps=5 if arm == "on" else 0)
                trainer.train()
                seconds[name][arm].append(ends[-1] - ends[9])
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "overhead.json").write_text(json.dumps(seconds))
    leave_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        overhead_worker(Path(args.worker), args.rounds, args.steps)
        return 0
    from gloo_launch import cpu_config, launch

    with tempfile.TemporaryDirectory() as tmp:
        config = cpu_config(tmp)
        began = time.monotonic()
        run = launch(config, str(ROOT / "tests" / "callbacks" / "straggler_probe.py"), str(Path(tmp) / "cases"), *CASES)
        if run.returncode != 0:
            print(run.stderr[-4000:], file=sys.stderr)
            return 1
        print(f"attribution: 6 runs of 29 steps in {time.monotonic() - began:.0f} s (2 gloo processes)\n")
        print("| delay (60 ms per step on rank 1 from step 10) | named | at step | steps from the slowdown | ranks never named |")
        print("|---|---|---|---|---|")
        for case in CASES:
            seen = json.loads((Path(tmp) / "cases" / case / "rank-0.json").read_text())
            named = [(n["rank"], n["phase"], n["since_step"]) for n in seen["named"]]
            first = named[0] if named else None
            others = sorted({0, 1} - {r for r, _, _ in named})
            print(f"| {case} | {f'rank {first[0]}, {first[1]}' if first else 'nothing'} | {first[2] if first else '-'} | "
                  f"{first[2] - ONSET + 1 if first else '-'} | {others} |")
        out = Path(tmp) / "overhead"
        out.mkdir()
        run = launch(config, __file__, "--worker", str(out), "--rounds", str(args.rounds), "--steps", str(args.steps))
        if run.returncode != 0:
            print(run.stderr[-4000:], file=sys.stderr)
            return 1
        seconds = json.loads((out / "overhead.json").read_text())
    print(f"\noverhead: telemetry with the attribution on and off, {args.rounds} alternating rounds of {args.steps} steps")
    print("| model | ms per step, off | ms per step, on | steps/s on / off (median of rounds) |")
    print("|---|---|---|---|")
    for name, arms in seconds.items():
        ratios = [off / on for on, off in zip(arms["on"], arms["off"])]
        print(f"| {name} | {1000 * statistics.median(arms['off']) / args.steps:.2f} | "
              f"{1000 * statistics.median(arms['on']) / args.steps:.2f} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}..{max(ratios):.3f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
