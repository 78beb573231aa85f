"""The package as a pip user has it: a wheel built once a session, installed into a fresh venv (the ``installed``
fixture), and the commands run from an empty directory with that venv's ``bin`` first on the PATH.

The wheel is built from a copy of the package (the repository gets no build/), installed without dependencies into a
fresh venv that sees the dev venv's third-party packages through a plain path line in a .pth file (a directory added
that way has its own .pth files left unread: the editable install's finder stays out, so ``hf_gpu_train`` is the
wheel's). The dependencies' own console scripts that the printed lines name (``accelerate``, ``torchrun``) are written
into the venv's ``bin`` as a pip install of them would have them: this venv's python running their entry modules, so a
process they start imports the wheel's package, not the repository's. The dev venv's ``bin`` is left off the PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the dependencies' console scripts the printed commands name: (name, the module `python -m` runs)
CONSOLE_SCRIPTS = {"accelerate": "accelerate.commands.accelerate_cli", "torchrun": "torch.distributed.run"}
# a run of the shipped MiniLM recipe in a few seconds on 2 cores
TINY = ["max_steps=2", "max_train_samples=16", "max_eval_samples=8", "per_device_train_batch_size=4",
        "per_device_eval_batch_size=8", "max_length=32", "evaluate_before=false", "save_strategy=no"]


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the fresh venv's bin directory)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "hf_gpu_train", src / "hf_gpu_train", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"),
                    str(src)], check=True, cwd=root)
    wheel = next((root / "dist").glob("hf_gpu_train-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, cwd=root)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                               capture_output=True, text=True).stdout.strip())
    (site / "dev_venv_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for name, module in CONSOLE_SCRIPTS.items():
        script = venv / "bin" / name
        script.write_text(f'#!/bin/sh\nexec "{python}" -m {module} "$@"\n')
        script.chmod(0o755)
    return wheel, venv / "bin"


def user_env(bin_dir: Path, **extra: str) -> dict[str, str]:
    """This process's environment as a pip user's shell has it: the venv's bin first, the dev venv's bin gone, nothing
    that points into the repository."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    dev_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([str(bin_dir), *(p for p in env.get("PATH", "").split(os.pathsep) if p and p != dev_bin)])
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def run_in(cwd: Path, argv: list[str], bin_dir: Path | None = None, timeout: int = 600, **extra: str) -> subprocess.CompletedProcess:
    """``argv`` in ``cwd``; with ``bin_dir``, under ``user_env`` (else this environment less PYTHONPATH)."""
    if bin_dir is not None:
        env = user_env(bin_dir, **extra)
    else:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
