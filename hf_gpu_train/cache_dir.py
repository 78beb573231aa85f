"""Where the toolkit keeps what it makes once and reuses across runs: ``$HF_GPU_TRAIN_CACHE``, else
``$XDG_CACHE_HOME/hf_gpu_train`` (``~/.cache/hf_gpu_train``): a shipped model converted on first use
(``builtin:smollm2``), the data a run prepared (``finetune/prepare_once.py``). No torch."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("HF_GPU_TRAIN_CACHE"):
        return Path(os.environ["HF_GPU_TRAIN_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "hf_gpu_train"
