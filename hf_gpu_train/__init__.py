"""hf_gpu_train: fine-tuning with Hugging Face Trainer and Accelerate on NVIDIA GPUs that works the first time.

Hardware detection and the doctor (``hf_gpu_train.hardware``, ``hf_gpu_train.doctor``) never import
torch at import time.
"""

__version__ = "0.1.0"

from .hardware.detect import detect  # noqa: E402
from .hardware.profile import GpuInfo, GpuPair, HardwareProfile, HostInfo  # noqa: E402
from .hardware.snapshot import load_machine  # noqa: E402

__all__ = ["__version__", "detect", "load_machine", "HardwareProfile", "GpuInfo", "GpuPair", "HostInfo"]
