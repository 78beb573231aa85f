"""Wall time of ``hf-gpu-train detect`` against ``accelerate env`` on the same machine.

Alternating runs in one invocation (timings here are noisy: only the ratio means anything).
Goal: median ratio <= 0.10.

    python benchmarks/detect_startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    bindir = Path(sys.executable).parent
    ours = [str(bindir / "hf-gpu-train"), "detect"] if (bindir / "hf-gpu-train").exists() else [sys.executable, "-m", "hf_gpu_train", "detect"]
    theirs = [str(bindir / "accelerate"), "env"] if (bindir / "accelerate").exists() else [shutil.which("accelerate") or "accelerate", "env"]
    timed(ours), timed(theirs)  # warm the file cache for both
    ours_s, theirs_s = [], []
    for _ in range(args.runs):
        ours_s.append(timed(ours))
        theirs_s.append(timed(theirs))
    print(f"{'run':>4} {'hf-gpu-train detect':>20} {'accelerate env':>15} {'ratio':>7}")
    for i, (a, b) in enumerate(zip(ours_s, theirs_s)):
        print(f"{i:>4} {a:>19.3f}s {b:>14.3f}s {a / b:>7.3f}")
    ratio = statistics.median(ours_s) / statistics.median(theirs_s)
    print(f"median: detect {statistics.median(ours_s):.3f}s, accelerate env {statistics.median(theirs_s):.3f}s, "
          f"ratio {ratio:.3f} (goal <= 0.10: {'met' if ratio <= 0.10 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
