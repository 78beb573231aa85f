"""``hf-gpu-train detect``: what this machine (or a snapshot) has, without importing torch."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from ..errors import UsageError
from ..hardware.profile import HardwareProfile
from ..hardware.snapshot import save, to_json
from ..hardware.software import detect_software
from ..hardware.topology import LEGEND, p2p_summary, topology_matrix
from ..textfmt import gib, table
from .common import add_machine_argument, resolve_profile


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("detect", help="show GPUs, memory, precision support and topology",
                              description="Show GPUs, memory, compute capability, precision support and the GPU "
                              "topology. Never imports torch unless --software is given.")
    add_machine_argument(p)
    p.add_argument("--json", action="store_true", help="print the machine snapshot as JSON")
    p.add_argument("--save", metavar="FILE", help="write the machine snapshot to FILE (for --machine elsewhere)")
    p.add_argument("--software", action="store_true", help="also collect torch, CUDA build, cuDNN and NCCL versions (imports torch)")
    p.add_argument("--topology-svg", metavar="PATH",
                   help="draw how the GPUs reach each other (NVLink, PCIe switch, host bridge, CPU sockets; P2P) as an SVG "
                   "picture at PATH; on a machine without a GPU the picture says why")
    return p


def run(args: argparse.Namespace) -> int:
    picture = _picture_target(args.topology_svg) if args.topology_svg else None  # before detecting: fail fast
    profile, live = resolve_profile(args)
    if args.software and live:

        profile = replace(profile, software=detect_software())
    if args.save:

        path = save(profile, args.save)
        if not args.json:
            print(f"saved snapshot to {path}")
    if picture is not None:
        _write_picture(profile, picture, args.topology_svg)
    if args.json:

        print(to_json(profile), end="")
    else:
        print(render(profile, live))
    if picture is not None:  # last, where the eye lands; on stderr with --json, whose stdout is the snapshot
        why = "" if profile.gpus and not profile.nvml_error else " (no GPU to draw: the picture says why)"
        print(f"wrote the topology picture to {picture}{why}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _picture_target(value: str) -> Path:
    """The --topology-svg path, checked before anything is detected: its folder must exist, and it is no folder."""
    path = Path(value).expanduser()
    if path.is_dir():
        raise UsageError(f"--topology-svg {value}: that is a directory; name a file in it, e.g. {path / 'topology.svg'}")
    if not path.parent.is_dir():
        raise UsageError(f"--topology-svg {value}: the directory {path.parent} does not exist; "
                         f"create it (mkdir -p {path.parent}) or choose another path")
    return path


def _write_picture(profile: HardwareProfile, path: Path, value: str) -> None:
    from ..report.topology_picture import save_topology_svg  # lazy: looked up when called, so a replacement (a test's) is seen

    try:
        save_topology_svg(profile, path)
    except OSError as error:
        raise UsageError(f"--topology-svg {value}: cannot write it: {error.strerror or error}") from error


def render(profile: HardwareProfile, live: bool = True) -> str:

    h = profile.host
    source = "this machine" if live else f"snapshot {profile.display_name}"
    lines = [f"Machine: {h.hostname} ({source})"]
    if profile.description:
        lines.append(f"  {profile.description}")
    lines.append(
        f"Host: {h.cpu_model or '?'}, {h.physical_cores or '?'} cores / {h.logical_cores or '?'} threads, "
        f"{h.numa_nodes or '?'} NUMA node(s), RAM {gib(h.ram_total_bytes, 0)}, /dev/shm {gib(h.shm_total_bytes)}"
        + (f", InfiniBand {', '.join(h.infiniband_devices)}" if h.infiniband_devices else "")
    )
    if profile.nvml_error:
        lines.append(f"GPUs: none usable. {profile.nvml_error}")
        if h.nvidia_pci_devices:
            lines.append(f"  {h.nvidia_pci_devices} NVIDIA device(s) on the PCI bus: run `hf-gpu-train doctor` for the fix.")
        return "\n".join(lines)
    lines.append(f"Driver {profile.driver_version}, CUDA driver API {profile.cuda_driver_version}, {len(profile.gpus)} GPU(s)")
    if not profile.gpus:
        return "\n".join(lines)
    rows = [["GPU", "Name", "Memory", "Used", "CC", "bf16", "fp8", "Power", "MIG", "Display", "NUMA", "Bus id"]]
    for g in profile.gpus:
        rows.append([
            g.index, g.name, gib(g.memory_total_bytes), gib(g.memory_used_bytes), g.capability_str,
            "yes" if g.bf16_supported else "no", "yes" if g.fp8_supported else "no",
            "?" if g.power_limit_w is None else f"{g.power_limit_w:.0f} W",
            _mig_cell(g), {True: "yes", False: "no", None: "?"}[g.display_active],
            "?" if g.numa_node is None else g.numa_node, g.pci_bus_id,
        ])
    lines += ["", table(rows)]
    pending = [g for g in profile.gpus if g.mig_change_pending]
    if pending:
        lines.append("MIG mode changes pending (applied at the next GPU reset): " + "; ".join(
            f"GPU{g.index} {_on(g.mig_enabled)} now, {_on(g.mig_pending_enabled)} after the reset" for g in pending))
    instances = [(g, m) for g in profile.gpus for m in (g.mig_instances or ())]
    if instances:
        lines += ["", "MIG instances (CUDA_VISIBLE_DEVICES takes the UUID):"]
        lines += ["  " + line for line in table(
            [[f"GPU{g.index}", m.profile, gib(m.memory_total_bytes), gib(m.memory_used_bytes),
              f"GI {'?' if m.gpu_instance_id is None else m.gpu_instance_id} CI "
              f"{'?' if m.compute_instance_id is None else m.compute_instance_id}", m.uuid] for g, m in instances],
            header=False).splitlines()]
    procs = [f"GPU{g.index}: pid {p.pid} {p.name or '?'} {gib(p.used_memory_bytes)}" for g in profile.gpus for p in g.processes]
    if procs:
        lines += ["", "Processes holding GPU memory:"] + [f"  {p}" for p in procs]
    if len(profile.gpus) > 1:
        lines += ["", "Topology (nvidia-smi topo -m notation):", table(topology_matrix(profile), header=False),
                  p2p_summary(profile), LEGEND]
    if profile.software:
        s = profile.software
        lines += ["", f"Software: Python {s.python_version}, torch {s.torch_version or 'not installed'} "
                  f"(CUDA build {s.torch_cuda_build or 'none'}), cuDNN {s.cudnn_version or '-'}, NCCL {s.nccl_version or '-'}, "
                  f"transformers {s.transformers_version or '-'}, accelerate {s.accelerate_version or '-'}"]
    if profile.notes:
        lines += ["", "Detection notes:"] + [f"  {n}" for n in profile.notes]
    return "\n".join(lines)


def _on(flag: bool | None) -> str:
    return {True: "on", False: "off", None: "?"}[flag]


def _mig_cell(gpu) -> str:
    """ "on", "off", or "off->on" when a MIG mode change waits for the next GPU reset."""
    return f"{_on(gpu.mig_enabled)}->{_on(gpu.mig_pending_enabled)}" if gpu.mig_change_pending else _on(gpu.mig_enabled)
