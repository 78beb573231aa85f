"""What OOM recovery costs when nothing runs out of memory: 2 gloo DDP processes, with and without it.

Both arms are ``scripts/finetune.py``'s ``finetune()`` with its defaults (MiniLM on builtin:text, pinned as when its figures were measured, the
loss-scaling fix, length grouping, fused AdamW); the only difference is ``oom_recovery``. Without it DDP's reducer
all-reduces the gradient buckets during backward; with it our ``GradientReducer`` does the same from
post-accumulate-grad hooks, plus one small vote per optimizer step and DDP's buffer broadcast done by us.
Alternating launches; prints the steps/s (training time of the run summary) and the ratio. Goal: >= 0.98.

    python benchmarks/oom_overhead.py [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from gloo_launch import ROOT, cpu_config, launch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--config-file", help="a launch config to run both arms with (default: 2 gloo processes on the CPU)")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"plain": [], "recovery": []}
    with tempfile.TemporaryDirectory() as tmp:
        config = args.config_file or cpu_config(tmp)
        for r in range(args.rounds):
            for mode in (("plain", "recovery") if r % 2 == 0 else ("recovery", "plain")):
                round_dir = Path(tmp) / f"round{r}"  # a fresh output_dir per run: a finished one would not train again
                run = launch(config, str(ROOT / "benchmarks" / "default_finetune_probe.py"), str(round_dir), mode,
                             str(args.steps), f"oom_recovery={'true' if mode == 'recovery' else 'false'}")
                assert run.returncode == 0, run.stderr[-2000:]
                results[mode].append(json.loads((round_dir / f"{mode}.json").read_text())["steps_per_second"])
    plain, recovery = statistics.median(results["plain"]), statistics.median(results["recovery"])
    per_round = [r / p for r, p in zip(results["recovery"], results["plain"])]
    print(f"MiniLM-L6, {'2 gloo DDP processes on the CPU' if args.config_file is None else args.config_file}, {args.steps} steps, "
          f"{args.rounds} round(s), no OOM")
    print(f"steps/s without recovery: {[round(x, 3) for x in results['plain']]} (median {plain:.3f})")
    print(f"steps/s with recovery:    {[round(x, 3) for x in results['recovery']]} (median {recovery:.3f})")
    print(f"ratio (with / without): {recovery / plain:.3f}; per round {[round(x, 3) for x in per_round]} (goal >= 0.98)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
