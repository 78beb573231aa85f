"""NAME.tune.svg: throughput and peak memory against the micro-batch, one line per setting of the other axes.

Left: the comparison metric of every trial that ran; a trial that ran out of memory is a red cross (its figure is
what the OOM recovery made of it, never a candidate), the winner a star. Right: the measured peak against the
device's memory and the headroom line, with the planner's estimate dashed; on the CPU there is no device memory.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..svg import PALETTE, Chart, side_by_side
from .candidates import CandidateSpace
from .results import HEADROOM_FRACTION, TrialResult
from .tune_report import checkpointing_text

GIB = 2**30


def _series_name(result: TrialResult) -> str:
    c = result.candidate

    parts = [f"ckpt {checkpointing_text(c)}", f"{c.dataloader_num_workers} workers", c.precision]
    if c.torch_compile:
        parts.append("compile")
    if c.packing is not None:
        parts.append("packing" if c.packing else "padding")
    if c.strategy:  # the strategy round: a trial of another strategy at the search's winner
        parts.append(c.strategy)
    return ", ".join(parts)


def write_plot(path: Path, results: list[TrialResult], space: CandidateSpace, winner: TrialResult | None) -> Path | None:
    """Write the SVG; None when no trial ran (nothing to draw)."""
    ran = [r for r in results if r.ran and r.throughput(space.metric)]
    if not ran:
        return None
    speed = Chart(f"{space.metric} (effective batch {space.effective_batch} for every trial)", xlabel="micro-batch (per process)",
                  ylabel=space.metric, width=640, height=380, xlog2=True)
    memory = Chart("peak memory (largest of any process)", xlabel="micro-batch (per process)", ylabel="GiB per process",
                   width=640, height=380, xlog2=True)
    groups: dict[str, list[TrialResult]] = defaultdict(list)
    for r in ran:
        groups[_series_name(r)].append(r)
    for index, (name, members) in enumerate(groups.items()):
        color = PALETTE[index % len(PALETTE)]
        members.sort(key=lambda r: r.candidate.micro_batch)
        fitting = [r for r in members if r.fits]
        speed.line([r.candidate.micro_batch for r in fitting], [r.throughput(space.metric) for r in fitting], name, color=color,
                   marker="circle")
        failed = [r for r in members if not r.fits]
        if failed:
            speed.points([r.candidate.micro_batch for r in failed], [r.throughput(space.metric) for r in failed], "", color="red",
                         marker="cross")
        with_memory = [r for r in members if r.peak_memory_bytes is not None]
        if with_memory:
            memory.line([r.candidate.micro_batch for r in with_memory], [r.peak_memory_bytes / GIB for r in with_memory], name,
                        color=color, marker="circle")
    if any(not r.fits for r in ran):
        speed.points([], [], "out of memory / over headroom", color="red", marker="cross")
    if winner is not None and winner.throughput(space.metric):
        speed.points([winner.candidate.micro_batch], [winner.throughput(space.metric)], "winner", color="gold", marker="star",
                     size=9.0)
    _memory_panel(memory, ran, space)
    path.write_text(side_by_side([speed, memory]), encoding="utf-8")
    return path


def _memory_panel(chart: Chart, ran: list[TrialResult], space: CandidateSpace) -> None:
    device = next((r.device_memory_bytes for r in ran if r.device_memory_bytes), None)
    if device is None:
        chart.note = "no device memory on the CPU"
        return
    chart.hline(device / GIB, "device memory", color="black", dash="solid")
    chart.hline(HEADROOM_FRACTION * device / GIB, f"{HEADROOM_FRACTION:.0%} headroom line", color="black", dash="dotted")
    estimates = sorted({(v.micro_batch, v.estimate_bytes) for v in space.verdicts
                        if (v.gradient_checkpointing, v.precision) == (space.base.gradient_checkpointing, space.base.precision)})
    if estimates:
        chart.line([m for m, _ in estimates], [e / GIB for _, e in estimates], "planner estimate", color="gray", dash="dashed")
