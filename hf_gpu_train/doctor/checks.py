"""The doctor's checks that need no torch (they work on a snapshot as well as on the box): the host, the GPUs,
MIG, the topology and the software stack, each returning ``Check`` outcomes.

One preflight check's outcome: what was checked, how it went, and the exact fix.

Host checks: shared memory for dataloader workers, free disk where the run will write.

Checks that read only the hardware profile: they work on a snapshot as well as on the box.

MIG: a pending mode change, instances (one process each), MIG on with no instance at all.

A pending change is the trap: `nvidia-smi -i N -mig 1` only takes effect at the next GPU reset, so the
GPU still trains whole today and silently becomes MIG instances after a reboot (or the other way round).

Checks of how the GPUs fit together: one model or several, NVLinks that P2P cannot use.

Checks of the software stack: torch, its CUDA build against the driver, cuDNN, NCCL.
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from ..hardware.profile import GpuInfo, HardwareProfile, SoftwareInfo
from ..textfmt import gib

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def skipped(name: str, why: str) -> Check:
    return Check(name, SKIP, why)


MIN_SHM_BYTES = 2**30


MIN_FREE_DISK_BYTES = 10 * 2**30


def check_shm(profile: HardwareProfile) -> Check:
    size = profile.host.shm_total_bytes
    if size is None:
        return Check("/dev/shm", WARN, "no /dev/shm found", "Dataloader workers pass batches through /dev/shm: "
                     "mount it (docker: --shm-size=8g or --ipc=host), or set dataloader_num_workers=0.")
    if size < MIN_SHM_BYTES:
        return Check("/dev/shm", WARN, f"/dev/shm is {gib(size, 2)}; dataloader workers need at least 1 GiB "
                     "(bus error / 'DataLoader worker killed' otherwise)",
                     "docker run --shm-size=8g (or --ipc=host); Kubernetes: an emptyDir with medium: Memory on /dev/shm.")
    return Check("/dev/shm", PASS, f"{gib(size)}")


def check_disk(output_dir: str | Path, min_free_bytes: int = MIN_FREE_DISK_BYTES) -> Check:
    path = Path(output_dir).resolve()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError as error:
        return Check("disk", FAIL, f"cannot read free space of {path}: {error}", "Choose a writable --output-dir.")
    if free < min_free_bytes:
        return Check("disk", WARN, f"{gib(free)} free in {probe}: checkpoints of a large model may not fit",
                     f"Free space, or point output_dir at a larger disk (want >= {gib(min_free_bytes, 0)}).")
    return Check("disk", PASS, f"{gib(free)} free in {probe}")


# Clock-event reasons that are normal on an idle GPU; anything else at idle is a hardware or
# cooling problem (HwSlowdown, thermal, power brake) that will slow the training too.
BENIGN_IDLE_REASONS = frozenset({"GpuIdle", "ApplicationsClocksSetting", "SyncBoost", "DisplayClockSetting"})


OTHER_PROCESS_WARN_BYTES = 512 * 2**20


def check_driver(profile: HardwareProfile) -> Check:
    if profile.nvml_error is None:
        return Check("driver", PASS, f"NVIDIA driver {profile.driver_version}, CUDA driver API {profile.cuda_driver_version}")
    on_bus = profile.host.nvidia_pci_devices
    if on_bus:
        return Check(
            "driver",
            FAIL,
            f"{on_bus} NVIDIA GPU(s) on the PCI bus but NVML fails: {profile.nvml_error}",
            "Fix the driver before installing frameworks: install or reinstall the NVIDIA driver "
            "(e.g. `sudo apt install nvidia-driver-550` or your distribution's package), reboot, "
            "and check that `nvidia-smi` lists the GPUs.",
        )
    return Check(
        "driver",
        WARN,
        "no NVIDIA GPU on this machine: training will run on the CPU",
        "Nothing to fix for CPU training; for GPU training use a machine with an NVIDIA GPU.",
    )


def check_gpus(profile: HardwareProfile) -> Check:
    if not profile.gpus:
        return Check("gpus", FAIL if profile.nvml_error is None else SKIP,
                     "NVML works but reports no GPUs" if profile.nvml_error is None else "no GPU visible",
                     "Check `nvidia-smi`; GPUs may be hidden by the container runtime (--gpus all)." if profile.nvml_error is None else None)
    names = ", ".join(f"GPU{g.index} {g.name} ({gib(g.memory_total_bytes)}, cc {g.capability_str})" for g in profile.gpus)
    on_bus = profile.host.nvidia_pci_devices
    if on_bus and on_bus > len(profile.gpus):
        return Check("gpus", WARN, f"{names}; {on_bus} NVIDIA devices on the PCI bus but NVML lists {len(profile.gpus)}",
                     "A GPU is missing from NVML: check `dmesg | grep -i xid` (fallen off the bus) and reseat or reset it.")
    return Check("gpus", PASS, names)


def check_other_processes(profile: HardwareProfile, threshold_bytes: int = OTHER_PROCESS_WARN_BYTES) -> Check:
    busy = []
    for g in profile.gpus:
        held = g.memory_used_bytes or 0
        procs = ", ".join(f"pid {p.pid} {p.name or '?'} {gib(p.used_memory_bytes)}" for p in g.processes)
        if held >= threshold_bytes or g.processes:
            busy.append(f"GPU{g.index}: {gib(held)} in use" + (f" by {procs}" if procs else ""))
    if not busy:
        return Check("other processes", PASS, "no other process holds GPU memory")
    return Check("other processes", WARN, "; ".join(busy),
                 "Stop those processes or leave those GPUs out (`hf-gpu-train config` skips busy GPUs; "
                 "or set CUDA_VISIBLE_DEVICES).")


def check_idle_throttling(profile: HardwareProfile) -> Check:
    findings = []
    for g in profile.gpus:
        bad = [r for r in g.clock_event_reasons if r not in BENIGN_IDLE_REASONS]
        idle = g.utilization_pct is not None and g.utilization_pct < 5
        if bad and idle:
            findings.append(f"GPU{g.index} {', '.join(bad)} at {g.utilization_pct}% utilization, "
                            f"SM {g.sm_clock_mhz}/{g.sm_clock_max_mhz} MHz, {g.temperature_c} C")
    if not findings:
        return Check("idle clocks", PASS, "no GPU held back at idle")
    return Check("idle clocks", WARN, "; ".join(findings),
                 "Thermal: check fans, airflow and `nvidia-smi -q -d TEMPERATURE`; HwSlowdown/power brake: check the "
                 "power supply cables; SwPowerCap at idle: `nvidia-smi -q -d POWER` for a lowered power limit.")


def gpu_checks(profile: HardwareProfile) -> list[Check]:
    checks = [check_gpus(profile)]
    if len(profile.gpus) > 1:
        checks.append(check_gpu_models(profile))
    checks += [check_other_processes(profile), check_mig(profile)]
    if len(profile.gpus) > 1:
        checks.append(check_nvlink_p2p(profile))
    return checks + [check_idle_throttling(profile)]


def _pending(gpu: GpuInfo) -> str:
    now, then = ("on", "off") if gpu.mig_enabled else ("off", "on")
    becomes = "becomes MIG instances" if not gpu.mig_enabled else "becomes one whole GPU"
    works = "works whole" if not gpu.mig_enabled else "is split into MIG instances"
    return (f"GPU{gpu.index}: MIG mode change pending ({now} now, {then} after the next GPU reset): `nvidia-smi -mig` was run "
            f"but the GPU not reset, so the GPU {works} now and {becomes} at the next reset or reboot")


def _instances(gpu: GpuInfo) -> str:
    if gpu.mig_instances is None:
        return f"GPU{gpu.index}: MIG mode on (instances not recorded in this snapshot)"
    if not gpu.mig_instances:
        return f"GPU{gpu.index}: MIG mode on but no MIG instance exists: CUDA sees no device on this GPU"
    listed = ", ".join(f"{m.profile} {gib(m.memory_free_bytes)} ({m.uuid})" for m in gpu.mig_instances)
    return f"GPU{gpu.index}: MIG mode on with {len(gpu.mig_instances)} instance(s): {listed}"


def check_mig(profile: HardwareProfile) -> Check:
    pending = [g for g in profile.gpus if g.mig_change_pending]
    on = [g for g in profile.gpus if g.mig_enabled and not g.mig_change_pending]
    if not pending and not on:
        return Check("MIG", PASS, "MIG mode off on every GPU")
    details, fixes = [], []
    if pending:
        ids = ",".join(str(g.index) for g in pending)
        details += [_pending(g) for g in pending]
        undo = " ".join(f"`sudo nvidia-smi -i {g.index} -mig {1 if g.mig_enabled else 0}`" for g in pending)
        fixes.append(f"Apply it: stop every process on the GPU, then `sudo nvidia-smi -i {ids} -r` (or reboot; some VMs need "
                     f"the host to reset it); or undo it: {undo}. Then run `hf-gpu-train detect --save` again.")
    if on:
        ids = ",".join(str(g.index) for g in on)
        details += [_instances(g) for g in on]
        details.append("one process per instance (CUDA_VISIBLE_DEVICES=<MIG UUID>), NCCL cannot join instances")
        if any(g.mig_instances == () for g in on):
            fixes.append(f"Create an instance (`sudo nvidia-smi mig -cgi 9 -C -i {on[0].index}` makes a 3g one; "
                         "`nvidia-smi mig -lgip` lists the profiles).")
        fixes.append(f"One process on one instance: `hf-gpu-train config` plans it against the instance's memory. For "
                     f"whole-GPU or multi-GPU training: `sudo nvidia-smi -i {ids} -mig 0`, then reset the GPU.")
    return Check("MIG", WARN, "; ".join(details), " ".join(fixes))


NVLINK_WITHOUT_P2P_CAUSES = (
    "likely causes: on NVSwitch systems (HGX/DGX) the NVIDIA fabric manager is not running or its version differs "
    "from the driver's; in a virtual machine the hypervisor does not pass GPU peer-to-peer through (or the GPUs "
    "are not in one P2P group); a driver problem (a driver update without a reboot, Xid errors in dmesg)"
)


NVLINK_WITHOUT_P2P_FIX = (
    "HGX/DGX: `systemctl status nvidia-fabricmanager` (start it; its version must equal the driver's, "
    "`nvidia-smi -q | grep -i fabric`). VM: ask the provider for a P2P-enabled (NVLink) instance type or enable P2P "
    "in the hypervisor's passthrough settings. Then check `nvidia-smi topo -p2p r` shows OK and `nvidia-smi nvlink -s` "
    "shows the links up; rerun `hf-gpu-train detect --save`. Until then `hf-gpu-train config` sets NCCL_P2P_DISABLE=1."
)


def check_gpu_models(profile: HardwareProfile) -> Check:
    """Mixed models: DDP runs every step at the slowest GPU's pace and the smallest GPU's memory."""
    counts = Counter(g.name for g in profile.gpus)
    if len(counts) <= 1:
        return Check("GPU models", PASS, ", ".join(f"{n}x {name}" for name, n in counts.items()) or "no GPU")
    listed = ", ".join(f"{name} (GPU {','.join(str(g.index) for g in profile.gpus if g.name == name)})" for name in counts)
    return Check("GPU models", WARN, f"mixed GPU models: {listed}; one DDP job runs at the pace and memory of its slowest GPU",
                 "`hf-gpu-train config` uses the largest group of one model; to choose, name GPUs with --gpu-ids (one model "
                 "per job), or run one job per model.")


def check_nvlink_p2p(profile: HardwareProfile) -> Check:
    """NVLinks up but P2P reported unsupported: the links carry nothing, NCCL goes through host memory."""
    linked = [p for p in profile.pairs if p.nvlinks]
    if not linked:
        return Check("NVLink P2P", PASS, "no NVLink between these GPUs")
    broken = [p for p in linked if not p.p2p_ok]
    if not broken:
        return Check("NVLink P2P", PASS, f"P2P works on all {len(linked)} NVLinked pair(s)")
    by_reason: dict[str, list[str]] = {}
    for p in broken:
        by_reason.setdefault(p.p2p_problem or "unknown", []).append(f"{p.a}-{p.b}")
    pairs = "; ".join(f"{', '.join(names)} ({reason})" for reason, names in by_reason.items())
    return Check("NVLink P2P", WARN, f"NVLinks active but P2P reported unsupported on {pairs}: NCCL then moves data through "
                 f"host memory at PCIe speed and the NVLinks carry nothing; {NVLINK_WITHOUT_P2P_CAUSES}", NVLINK_WITHOUT_P2P_FIX)


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
