"""Checks of the software stack: torch, its CUDA build against the driver, cuDNN, NCCL."""

from __future__ import annotations

from ..hardware.profile import HardwareProfile, SoftwareInfo
from .check import FAIL, PASS, SKIP, WARN, Check

# PyTorch wheel indexes by the CUDA version they are built for (download.pytorch.org/whl/cuXYZ).
TORCH_WHEEL_CUDA = ((13, 0), (12, 8), (12, 6), (12, 4), (12, 1), (11, 8))


def _version_tuple(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        major, minor = text.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def torch_install_command(driver_cuda: str | None) -> str:
    """The pip command that installs a torch whose CUDA runtime this driver can run."""
    supported = _version_tuple(driver_cuda)
    for cuda in TORCH_WHEEL_CUDA:
        if supported is None or cuda <= supported:
            tag = f"cu{cuda[0]}{cuda[1]}"
            return f"pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/{tag}"
    return ("your driver is too old for current PyTorch wheels: upgrade the NVIDIA driver to 525 or newer, then "
            "pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu118")


def check_torch(profile: HardwareProfile, sw: SoftwareInfo) -> Check:
    has_gpu = bool(profile.gpus)
    if sw.torch_version is None:
        return Check("torch", FAIL, "torch is not installed", torch_install_command(profile.cuda_driver_version)
                     if has_gpu else "pip install torch")
    if sw.torch_cuda_build is None:
        if has_gpu:
            return Check("torch", FAIL, f"torch {sw.torch_version} is a CPU-only build on a machine with NVIDIA GPUs",
                         torch_install_command(profile.cuda_driver_version))
        return Check("torch", PASS, f"torch {sw.torch_version} (CPU build, no GPU here)")
    return Check("torch", PASS, f"torch {sw.torch_version} built with CUDA {sw.torch_cuda_build}")


def check_cuda_compat(profile: HardwareProfile, sw: SoftwareInfo) -> Check:
    name = "CUDA runtime vs driver"
    runtime = _version_tuple(sw.torch_cuda_build)
    driver = _version_tuple(profile.cuda_driver_version)
    if runtime is None or driver is None or not profile.gpus:
        return Check(name, SKIP, "needs a CUDA build of torch and a GPU driver")
    detail = f"torch CUDA {sw.torch_cuda_build}, driver supports up to CUDA {profile.cuda_driver_version} (driver {profile.driver_version})"
    if runtime[0] > driver[0]:
        return Check(name, FAIL, detail + ": torch's CUDA runtime needs a newer driver",
                     f"Upgrade the NVIDIA driver to one supporting CUDA {sw.torch_cuda_build}, or: "
                     + torch_install_command(profile.cuda_driver_version))
    if runtime > driver:
        return Check(name, WARN, detail + ": runs through CUDA minor-version compatibility, but PTX JIT and newer "
                     "features may fail", "Upgrade the driver, or: " + torch_install_command(profile.cuda_driver_version))
    return Check(name, PASS, detail)


def check_cudnn_nccl(profile: HardwareProfile, sw: SoftwareInfo) -> Check:
    if not profile.gpus or sw.torch_cuda_build is None:
        return Check("cuDNN / NCCL", SKIP, "needs a CUDA build of torch and a GPU")
    missing = [n for n, v in (("cuDNN", sw.cudnn_version), ("NCCL", sw.nccl_version)) if v is None]
    detail = f"cuDNN {sw.cudnn_version or 'missing'}, NCCL {sw.nccl_version or 'missing'}"
    if missing:
        return Check("cuDNN / NCCL", FAIL if "cuDNN" in missing else WARN, detail,
                     "Reinstall torch from the CUDA wheel index (it bundles both): "
                     + torch_install_command(profile.cuda_driver_version))
    return Check("cuDNN / NCCL", PASS, detail)


def check_cuda_available(profile: HardwareProfile, sw: SoftwareInfo) -> Check:
    if not profile.gpus:
        return Check("torch.cuda.is_available()", SKIP, "no GPU here")
    if sw.cuda_available:
        return Check("torch.cuda.is_available()", PASS, f"True, {sw.cuda_device_count} device(s) visible to CUDA")
    return Check("torch.cuda.is_available()", FAIL, "False although NVML sees GPUs",
                 "Check CUDA_VISIBLE_DEVICES (empty or wrong?), the container's --gpus flag, and the checks above.")


def stack_checks(profile: HardwareProfile, sw: SoftwareInfo) -> list[Check]:
    return [check_torch(profile, sw), check_cuda_compat(profile, sw), check_cudnn_nccl(profile, sw),
            check_cuda_available(profile, sw)]
