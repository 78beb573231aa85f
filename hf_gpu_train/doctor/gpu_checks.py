"""Checks that read only the hardware profile: they work on a snapshot as well as on the box."""

from __future__ import annotations

from ..hardware.profile import HardwareProfile
from ..textfmt import gib
from .check import FAIL, PASS, SKIP, WARN, Check
from .mig_checks import check_mig
from .topology_checks import check_gpu_models, check_nvlink_p2p

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
