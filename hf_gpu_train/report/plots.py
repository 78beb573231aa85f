"""SVG charts of a run: one line per GPU, throttled readings marked red, readings at the power limit orange
(the power cap under load is normal, so it is not drawn as throttling)."""

from __future__ import annotations

import math
from pathlib import Path

from ..hardware.clock_events import POWER_CAP_REASON, THROTTLE_REASONS
from ..svg import FONT, Chart, escape

PANELS = [
    ("utilization", "GPU utilization (%)", "util_pct"),
    ("memory", "GPU memory used (GiB)", "mem_used_gib"),
    ("power", "power (W)", "power_w"),
    ("temperature", "temperature (C)", "temp_c"),
    ("clocks", "SM clock (MHz)", "sm_clock_mhz"),
]


def draw_all(out: Path, samples: list[dict], windows: list[dict]) -> list[Path]:
    """One SVG per panel that has data (``svg.py``: no plotting library on the path of a finishing run)."""
    paths = []
    t0 = samples[0]["t"] if samples else (windows[0]["time"] if windows else 0.0)
    gpus = sorted({g for s in samples for g in s.get("gpus", {})}, key=int)
    for name, title, key in PANELS:
        if not any(key in s["gpus"].get(g, {}) for s in samples for g in gpus):
            continue
        chart = Chart(title, xlabel="seconds")
        for g in gpus:
            readings = [(s["t"] - t0, s["gpus"][g][key], set(s["gpus"][g].get("throttle_reasons", [])))
                        for s in samples if key in s["gpus"].get(g, {})]
            chart.line([t for t, _, _ in readings], [v for _, v, _ in readings], f"GPU{g}")
            capped = [(t, v) for t, v, reasons in readings if POWER_CAP_REASON in reasons and not reasons & THROTTLE_REASONS]
            hot = [(t, v) for t, v, reasons in readings if reasons & THROTTLE_REASONS]
            if capped:
                chart.points([t for t, _ in capped], [v for _, v in capped], f"GPU{g} at power limit", color="orange")
            if hot:
                chart.points([t for t, _ in hot], [v for _, v in hot], f"GPU{g} throttled", color="red")
        if key == "sm_clock_mhz":
            maxima = [float(s["gpus"][g]["sm_clock_max_mhz"]) for s in samples for g in gpus if "sm_clock_max_mhz" in s["gpus"].get(g, {})]
            maxima = [m for m in maxima if math.isfinite(m)]  # a failed reading must not set the axis
            if maxima:
                chart.hline(max(maxima), "max SM clock")
                chart.ymax = max(maxima) * 1.05
        paths.append(chart.save(out / f"telemetry_{name}.svg"))
    torch_pts = [(w["time"] - t0, w["metrics"]) for w in windows if "torch/mem_allocated_gib" in w["metrics"]]
    if torch_pts:
        chart = Chart("torch memory (GiB)", xlabel="seconds")
        for key, label in (("torch/mem_allocated_gib", "allocated"), ("torch/mem_reserved_gib", "reserved")):
            chart.line([t for t, _ in torch_pts], [m.get(key, 0) for _, m in torch_pts], label)
        paths.append(chart.save(out / "telemetry_torch_memory.svg"))
    through = [(w["time"] - t0, w["metrics"]) for w in windows if "loop/samples_per_s" in w["metrics"]]
    if through:
        chart = Chart("throughput and data wait", xlabel="seconds", ylabel="samples/s", right_label="data wait (%)")
        chart.line([t for t, _ in through], [m["loop/samples_per_s"] for _, m in through], "samples/s", color="#1f77b4")
        chart.line([t for t, _ in through], [m.get("loop/data_wait_pct", 0) for _, m in through], "data wait %", color="#ff7f0e",
                   right=True)
        paths.append(chart.save(out / "telemetry_throughput.svg"))
    return paths


TIMELINE_PHASES = (("data", "#8c564b"), ("forward", "#1f77b4"), ("backward", "#2ca02c"), ("optimizer", "#9467bd"),
                   ("host", "#7f7f7f"), ("wait", "#d3d3d3"))


def draw_rank_timeline(out: Path, arrivals: list[dict]) -> Path | None:
    """Each rank's mean step, one bar per rank, its phases in the order the step runs them and its waiting at the
    collectives last (``callbacks/arrivals.py``): the rank the others wait for has a long phase and a short wait. Drawn
    for the last exchange that named a rank (else the last exchange); None with one process."""
    if not arrivals:
        return None
    shown = next((a for a in reversed(arrivals) if a.get("finding")), arrivals[-1])
    ranks = [r for r in shown.get("ranks", []) if isinstance(r, dict)]
    if len(ranks) < 2:
        return None
    finding = shown.get("finding") or {}
    longest = max(sum(float(r.get(p, 0.0)) for p, _ in TIMELINE_PHASES) for r in ranks) or 1.0
    left, width, row, top = 70, 560, 26, 46
    height = top + row * len(ranks) + 50
    title = (f"each rank's mean step over the {len(ranks)} ranks' exchange at step {shown.get('step')}"
             + (f": rank {finding['rank']} slow in {finding['phase']}" if finding else ": no straggler"))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 30}" height="{height}">',
             f'<text x="{left}" y="20" font-size="13" {FONT}>{escape(title)}</text>']
    for i, r in enumerate(ranks):
        y = top + i * row
        mark = " *" if finding and finding.get("rank") == i else ""
        parts.append(f'<text x="4" y="{y + 15}" font-size="11" {FONT}>rank {i}{mark}</text>')
        x = float(left)
        for phase, color in TIMELINE_PHASES:
            w = width * float(r.get(phase, 0.0)) / longest
            if w > 0:
                parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 8}" fill="{color}">'
                             f'<title>{phase}: {1000 * float(r.get(phase, 0.0)):.1f} ms</title></rect>')
            x += w
        parts.append(f'<text x="{x + 4:.1f}" y="{y + 14}" font-size="10" {FONT}>{1000 * float(r.get("period", 0.0)):.0f} ms</text>')
    legend_y = top + row * len(ranks) + 20
    for j, (phase, color) in enumerate(TIMELINE_PHASES):
        parts.append(f'<rect x="{left + j * 90}" y="{legend_y}" width="12" height="12" fill="{color}"/>'
                     f'<text x="{left + j * 90 + 16}" y="{legend_y + 10}" font-size="11" {FONT}>{phase}</text>')
    parts.append("</svg>")
    path = out / "telemetry_rank_timeline.svg"
    path.write_text("\n".join(parts))
    return path
