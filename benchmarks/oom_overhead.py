"""What OOM recovery costs when nothing runs out of memory: 2 gloo DDP processes, with and without it.

With recovery, every step adds one small all-reduce (the OOM flag) and the gradients are all-reduced
by us after backward instead of by DDP during it. Alternating launches; prints the steps/s ratio.

    python benchmarks/oom_overhead.py [--rounds 2] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"plain": [], "recovery": []}
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = Path(tmp) / "cpu2"
        subprocess.run([sys.executable, "-m", "hf_gpu_train", "config", "--machine", "cpu-only", "--num-processes", "2",
                        "--main-process-port", str(port), "--output", str(cfg)], check=True, capture_output=True)
        for r in range(args.rounds):
            for mode in (("plain", "recovery") if r % 2 == 0 else ("recovery", "plain")):
                subprocess.run([sys.executable, "-m", "hf_gpu_train", "launch", "--config-file", f"{cfg}.yaml",
                                str(ROOT / "benchmarks" / "oom_overhead_probe.py"), tmp, mode, str(args.steps)],
                               check=True, capture_output=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")})
                results[mode].append(json.loads((Path(tmp) / f"{mode}.json").read_text())["steps_per_second"])
    plain, recovery = statistics.median(results["plain"]), statistics.median(results["recovery"])
    print(f"MiniLM-L6, 2 gloo DDP processes on the CPU, {args.steps} steps, {args.rounds} round(s), no OOM")
    print(f"steps/s without recovery: {results['plain']} (median {plain:.3f})")
    print(f"steps/s with recovery:    {results['recovery']} (median {recovery:.3f})")
    print(f"ratio (with / without): {recovery / plain:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
