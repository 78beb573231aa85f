"""What the benchmarks that launch 2 gloo processes on the CPU share: the launch config, and one launch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_config(folder: str | Path, processes: int = 2, strategy: str | None = None) -> str:
    """``hf-gpu-train config --machine cpu-only`` for ``processes`` gloo processes on a free port (``--strategy
    STRATEGY`` where given); the YAML's path."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = Path(folder) / (strategy or f"cpu{processes}")
    chosen = ["--strategy", strategy] if strategy else []
    made = subprocess.run([sys.executable, "-m", "hf_gpu_train", "config", "--machine", "cpu-only", "--num-processes",
                           str(processes), *chosen, "--main-process-port", str(port), "--output", str(cfg)],
                          capture_output=True, text=True, cwd=ROOT)
    if made.returncode != 0:
        raise SystemExit(made.stderr)
    return f"{cfg}.yaml"


def launch(config: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``hf-gpu-train launch --config-file CONFIG ARGS`` from the repository root, the repository importable."""
    return subprocess.run([sys.executable, "-m", "hf_gpu_train", "launch", "--config-file", config, *args],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
