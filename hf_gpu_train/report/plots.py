"""SVG charts of a run: one line per GPU, throttled readings marked red, readings at the power limit orange
(the power cap under load is normal, so it is not drawn as throttling)."""

from __future__ import annotations

import math
from pathlib import Path

from ..hardware.clock_events import POWER_CAP_REASON, THROTTLE_REASONS
from ..svg import Chart

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
