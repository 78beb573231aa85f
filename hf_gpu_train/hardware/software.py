"""Software facts that need torch: collected only on request, never by plain detection.

Importing torch costs seconds and may initialise CUDA-related state; ``hf-gpu-train detect``
stays fast by not coming here unless ``--software`` is given.
"""

from __future__ import annotations

import importlib.metadata
import platform

from .profile import SoftwareInfo


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_software() -> SoftwareInfo:
    info = dict(
        python_version=platform.python_version(),
        transformers_version=_version("transformers"),
        accelerate_version=_version("accelerate"),
    )
    try:
        import torch
    except ImportError:
        return SoftwareInfo(**info)
    cudnn = None
    nccl = None
    try:
        if torch.backends.cudnn.is_available():
            cudnn = torch.backends.cudnn.version()
    except RuntimeError:  # cuDNN library present but unloadable
        cudnn = None
    try:
        raw = torch.cuda.nccl.version()
        nccl = ".".join(str(p) for p in raw) if isinstance(raw, tuple) else str(raw)
    except (AttributeError, RuntimeError, ImportError):
        nccl = None
    available = torch.cuda.is_available()
    return SoftwareInfo(
        torch_version=torch.__version__,
        torch_cuda_build=torch.version.cuda,
        cudnn_version=cudnn,
        nccl_version=nccl,
        cuda_available=available,
        cuda_device_count=torch.cuda.device_count() if available else 0,
        **info,
    )
