"""Helpers for tests that start real gloo processes through a generated CPU launch config."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_process_group(rank: int, port: int, world_size: int = 2):
    """Inside a process ``torch.multiprocessing.spawn`` started: this rank joined a gloo group on ``port``, left after."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def hf_gpu_train(*args: str, timeout: int = 240, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_gpu_train", *args], capture_output=True, text=True, timeout=timeout, **kw)


def cpu_config(tmp_path: Path, processes: int = 2, name: str = "cpu", *extra: str) -> Path:
    """``hf-gpu-train config --machine cpu-only`` on a free port; returns the YAML path."""
    out = tmp_path / name
    made = hf_gpu_train("config", "--machine", "cpu-only", "--num-processes", str(processes), "--main-process-port",
                        str(free_port()), "--output", str(out), *extra)
    assert made.returncode == 0, made.stderr
    return Path(f"{out}.yaml")


def launch(config: Path, script: str | Path, *args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``hf-gpu-train launch`` from the repository root, with the repository importable."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return hf_gpu_train("launch", "--config-file", str(config), str(script), *args, timeout=timeout, cwd=ROOT, env=full_env)


def teardown_race_only(stderr: str, results: list) -> bool:
    """torchelastic's exit barrier can lose its TCPStore when the agent hosting it leaves first (pytorch
    #69520, open). It happens after the workers finished; accept it only when every rank wrote its result."""
    return "Error waiting on exit barrier" in stderr and all(results)


def executable(path: Path, text: str) -> Path:
    """A script at ``path`` that may be run (a stand-in for srun, scontrol, hf-gpu-train)."""
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def fake_slurm(tmp_path: Path, env: dict) -> dict:
    """srun with --ntasks-per-node=1 on 2 nodes: the task twice, SLURM_NODEID 0 and 1."""
    bindir = tmp_path / "slurm-bin"
    bindir.mkdir()
    executable(bindir / "srun", "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"
               "SLURM_NODEID=0 \"$@\" & a=$!\nSLURM_NODEID=1 \"$@\" & b=$!\nwait $a && wait $b\n")
    return {**env, "PATH": f"{bindir}:{env['PATH']}", "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_NODELIST": "localhost",
            "HF_GPU_TRAIN_MAIN_NODE": "127.0.0.1", "HF_GPU_TRAIN_MAIN_PORT": str(free_port()), "HF_GPU_TRAIN": HF_GPU_TRAIN}


HF_GPU_TRAIN = f"{sys.executable} -m hf_gpu_train"  # the sbatch's launcher, from this environment (not root's PATH)
