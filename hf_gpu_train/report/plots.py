"""PNG plots of a run: one line per GPU, throttled readings marked red, readings at the power limit orange
(the power cap under load is normal, so it is not drawn as throttling)."""

from __future__ import annotations

from pathlib import Path

from ..callbacks.sampler import POWER_CAP_REASON, THROTTLE_REASONS

PANELS = [
    ("utilization", "GPU utilization (%)", "util_pct"),
    ("memory", "GPU memory used (GiB)", "mem_used_gib"),
    ("power", "power (W)", "power_w"),
    ("temperature", "temperature (C)", "temp_c"),
    ("clocks", "SM clock (MHz)", "sm_clock_mhz"),
]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path, paths: list[Path]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    paths.append(path)


def draw_all(out: Path, samples: list[dict], windows: list[dict]) -> list[Path]:
    plt = _plt()
    paths = []
    t0 = samples[0]["t"] if samples else (windows[0]["time"] if windows else 0.0)
    gpus = sorted({g for s in samples for g in s.get("gpus", {})}, key=int)
    for name, title, key in PANELS:
        if not any(key in s["gpus"].get(g, {}) for s in samples for g in gpus):
            continue
        fig, ax = plt.subplots(figsize=(8, 3))
        for g in gpus:
            pts = [(s["t"] - t0, s["gpus"][g][key]) for s in samples if key in s["gpus"].get(g, {})]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"GPU{g}")
            readings = [(s["t"] - t0, s["gpus"][g][key], set(s["gpus"][g].get("throttle_reasons", [])))
                        for s in samples if key in s["gpus"].get(g, {})]
            hot = [(t, v) for t, v, reasons in readings if reasons & THROTTLE_REASONS]
            capped = [(t, v) for t, v, reasons in readings if POWER_CAP_REASON in reasons and not reasons & THROTTLE_REASONS]
            if capped:
                ax.scatter([p[0] for p in capped], [p[1] for p in capped], color="orange", s=10, label=f"GPU{g} at power limit",
                           zorder=3)
            if hot:
                ax.scatter([p[0] for p in hot], [p[1] for p in hot], color="red", s=12, label=f"GPU{g} throttled", zorder=3)
        if key == "sm_clock_mhz":
            maxima = [s["gpus"][g]["sm_clock_max_mhz"] for s in samples for g in gpus if "sm_clock_max_mhz" in s["gpus"].get(g, {})]
            if maxima:
                ax.axhline(max(maxima), color="gray", linestyle="--", label="max SM clock")
                ax.set_ylim(top=max(maxima) * 1.05)
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.legend(loc="best", fontsize=7)
        _save(plt, fig, out / f"telemetry_{name}.png", paths)
    torch_pts = [(w["time"] - t0, w["metrics"]) for w in windows if "torch/mem_allocated_gib" in w["metrics"]]
    if torch_pts:
        fig, ax = plt.subplots(figsize=(8, 3))
        for key, label in (("torch/mem_allocated_gib", "allocated"), ("torch/mem_reserved_gib", "reserved")):
            ax.plot([p[0] for p in torch_pts], [p[1].get(key, 0) for p in torch_pts], label=label)
        ax.set_title("torch memory (GiB)")
        ax.set_xlabel("seconds")
        ax.legend(fontsize=7)
        _save(plt, fig, out / "telemetry_torch_memory.png", paths)
    through = [(w["time"] - t0, w["metrics"]) for w in windows if "train/samples_per_s" in w["metrics"]]
    if through:
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.plot([p[0] for p in through], [p[1]["train/samples_per_s"] for p in through], label="samples/s", color="tab:blue")
        ax.set_ylabel("samples/s")
        ax2 = ax.twinx()
        ax2.plot([p[0] for p in through], [p[1].get("train/data_wait_pct", 0) for p in through], label="data wait %", color="tab:orange")
        ax2.set_ylabel("data wait (%)")
        ax.set_title("throughput and data wait")
        ax.set_xlabel("seconds")
        _save(plt, fig, out / "telemetry_throughput.png", paths)
    return paths
