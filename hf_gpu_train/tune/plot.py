"""NAME.tune.png: throughput and peak memory against the micro-batch, one line per setting of the other axes.

Left: the comparison metric of every trial that ran; a trial that ran out of memory is a red cross (its figure is
what the OOM recovery made of it, never a candidate), the winner a star. Right: the measured peak against the
device's memory and the headroom line, with the planner's estimate dashed; on the CPU there is no device memory.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .candidates import CandidateSpace
from .results import HEADROOM_FRACTION, TrialResult

GIB = 2**30


def _series_name(result: TrialResult) -> str:
    c = result.candidate
    parts = [f"ckpt {'on' if c.gradient_checkpointing else 'off'}", f"{c.dataloader_num_workers} workers", c.precision]
    if c.torch_compile:
        parts.append("compile")
    if c.packing is not None:
        parts.append("packing" if c.packing else "padding")
    return ", ".join(parts)


def write_plot(path: Path, results: list[TrialResult], space: CandidateSpace, winner: TrialResult | None) -> Path | None:
    """Draw the PNG; None when no trial ran (nothing to draw)."""
    ran = [r for r in results if r.ran and r.throughput(space.metric)]
    if not ran:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed_ax, memory_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    groups: dict[str, list[TrialResult]] = defaultdict(list)
    for r in ran:
        groups[_series_name(r)].append(r)
    for name, members in groups.items():
        members.sort(key=lambda r: r.candidate.micro_batch)
        fitting = [r for r in members if r.fits]
        line, = speed_ax.plot([r.candidate.micro_batch for r in fitting], [r.throughput(space.metric) for r in fitting],
                              marker="o", label=name)
        failed = [r for r in members if not r.fits]
        speed_ax.scatter([r.candidate.micro_batch for r in failed], [r.throughput(space.metric) for r in failed], marker="x",
                         color="red", zorder=3)
        with_memory = [r for r in members if r.peak_memory_bytes is not None]
        if with_memory:
            memory_ax.plot([r.candidate.micro_batch for r in with_memory], [r.peak_memory_bytes / GIB for r in with_memory],
                           marker="o", color=line.get_color(), label=name)
    if any(not r.fits for r in ran):
        speed_ax.scatter([], [], marker="x", color="red", label="out of memory / over headroom")
    if winner is not None and winner.throughput(space.metric):
        speed_ax.scatter([winner.candidate.micro_batch], [winner.throughput(space.metric)], marker="*", s=260, color="gold",
                         edgecolor="black", zorder=4, label="winner")
    speed_ax.set(xscale="log", xlabel="micro-batch (per process)", ylabel=space.metric,
                 title=f"{space.metric} (effective batch {space.effective_batch} for every trial)")
    speed_ax.set_xscale("log", base=2)
    speed_ax.legend(fontsize=8)
    _memory_panel(memory_ax, ran, space)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _memory_panel(ax, ran: list[TrialResult], space: CandidateSpace) -> None:
    device = next((r.device_memory_bytes for r in ran if r.device_memory_bytes), None)
    ax.set(xlabel="micro-batch (per process)", ylabel="GiB per process", title="peak memory (largest of any process)")
    if device is None:
        ax.text(0.5, 0.5, "no device memory on the CPU", ha="center", va="center", transform=ax.transAxes)
        return
    ax.axhline(device / GIB, color="black", linewidth=1, label="device memory")
    ax.axhline(HEADROOM_FRACTION * device / GIB, color="black", linestyle=":", label=f"{HEADROOM_FRACTION:.0%} headroom line")
    estimates = sorted({(v.micro_batch, v.estimate_bytes) for v in space.verdicts
                        if (v.gradient_checkpointing, v.precision) == (space.base.gradient_checkpointing, space.base.precision)})
    if estimates:
        ax.plot([m for m, _ in estimates], [e / GIB for _, e in estimates], linestyle="--", color="gray", label="planner estimate")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
