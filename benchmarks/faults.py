"""Faults across ranks (issue 18), 2 gloo processes on the CPU.

1. What the watchdog costs when nothing hangs: the default fine-tune (MiniLM, the built-in text set) with
   ``watchdog=auto`` against ``watchdog=off``, alternating launches, steps/s from the run summaries. Goal >= 0.99.
2. What a stall costs: tests/training/hang_probe.py (rank 1 asleep in its collate function, then inside a collective
   rank 0 never enters, a 4 s limit): seconds from the stall to the end of every process, and whether the summary
   names rank 1. Without the watchdog both would wait out the collective timeout (1800 s).

    python benchmarks/faults.py [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gloo_launch import ROOT, cpu_config, launch

ARMS = {"off": "watchdog=off", "watchdog": "watchdog=auto"}


def cost(config: str, tmp: str, rounds: int, steps: int) -> None:
    results: dict[str, list[float]] = {"off": [], "watchdog": []}
    for r in range(rounds):
        for mode in (("off", "watchdog") if r % 2 == 0 else ("watchdog", "off")):
            round_dir = Path(tmp) / f"round{r}"
            run = launch(config, str(ROOT / "benchmarks" / "default_finetune_probe.py"), str(round_dir), mode, str(steps),
                         ARMS[mode])
            assert run.returncode == 0, run.stderr[-2000:]
            results[mode].append(json.loads((round_dir / f"{mode}.json").read_text())["steps_per_second"])
    off, on = statistics.median(results["off"]), statistics.median(results["watchdog"])
    print(f"1. no fault, MiniLM-L6, 2 gloo processes, {steps} steps, {rounds} round(s)")
    print(f"   steps/s watchdog off: {[round(x, 3) for x in results['off']]} (median {off:.3f})")
    print(f"   steps/s watchdog on:  {[round(x, 3) for x in results['watchdog']]} (median {on:.3f})")
    print(f"   ratio (on / off): {on / off:.3f}; per round "
          f"{[round(a / b, 3) for a, b in zip(results['watchdog'], results['off'])]} (goal >= 0.99)")


def stalls(config: str, tmp: str) -> None:
    print("2. a stall on rank 1 (limit 4 s): seconds from the stall to the end of every process")
    for mode in ("collate", "collective"):
        out = Path(tmp) / f"stall-{mode}"
        start = time.monotonic()
        run = launch(config, str(ROOT / "tests" / "training" / "hang_probe.py"), str(out), mode)
        ended = time.monotonic() - start
        folders = list(out.glob("hang-*"))
        report = json.loads((folders[0] / "summary.json").read_text()) if folders else {}
        stalled_for = max((s or {}).get("stalled_s", 0) for s in report.get("ranks", {}).values()) if report else None
        print(f"   {mode:10s}: exit {run.returncode}, launch to end {ended:.1f} s, stall to dump {stalled_for} s, "
              f"culprit named: {report.get('behind') == [1]}, stacks: {sorted(p.name for p in folders[0].iterdir()) if folders else None}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = cpu_config(tmp)
        stalls(config, tmp)
        cost(config, tmp, args.rounds, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
