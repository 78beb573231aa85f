"""Write and re-read the run report. Files in ``output_dir``:

- ``telemetry.jsonl``: one line per sampler reading ({"kind": "sample", ...}), per log window
  ({"kind": "window", "step", "metrics", "verdict", "ranks"}) and, with several processes, per exchange of the ranks'
  phase times ({"kind": "arrivals", "step", "ranks", "finding"}: ``callbacks/arrivals.py``);
- ``telemetry_summary.json``: means and maxima over the run, the final verdict, stragglers;
- ``report.md`` with the SVG charts from ``plots.py``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .generations import generations_section
from .plots import draw_all, draw_rank_timeline
from .story import LOG_HISTORY, read_json_object, story

JSONL = "telemetry.jsonl"
SUMMARY = "telemetry_summary.json"
REPORT = "report.md"


def _summary(samples: list[dict], windows: list[dict], verdict: dict | None, gpu_names: dict) -> dict:
    named: list[dict] = []  # each straggler the run named, once (rank, phase, the step it was named at)
    for w in windows:
        s = w.get("straggler")
        if isinstance(s, dict) and not any((n["rank"], n["phase"], n["since_step"]) == (s.get("rank"), s.get("phase"),
                                                                                       s.get("since_step")) for n in named):
            named.append({k: s.get(k) for k in ("rank", "phase", "since_step", "excess_ms", "step_ms", "line")})
    series: dict[str, list[float]] = defaultdict(list)
    for w in windows:
        for key, value in w.get("metrics", {}).items():
            if isinstance(value, (int, float)):
                series[key].append(float(value))
    stats = {key: {"mean": sum(v) / len(v), "max": max(v)} for key, v in series.items() if v}
    throttle = sorted({r for w in windows for names in w.get("throttle_reasons", {}).values() for r in names})
    stragglers = sorted({r["rank"] for w in windows for r in w.get("ranks", []) if r.get("straggler")})
    verdict_counts: dict[str, int] = defaultdict(int)
    for w in windows:
        verdict_counts[w["verdict"]["kind"]] += 1
    return {"gpus": {str(k): v for k, v in gpu_names.items()}, "samples": len(samples), "windows": len(windows),
            "metrics": stats, "throttle_reasons_seen": throttle, "straggler_ranks": stragglers, "stragglers_named": named,
            "verdict_counts": dict(verdict_counts), "final_verdict": verdict,
            "gpu_health": [event for w in windows for event in w.get("gpu_health", [])]}


def write_run_report(output_dir, samples, records, verdict, gpu_names: dict, log_history: list | None = None,
                     arrivals: list | None = None) -> Path:
    """``verdict``: the run's last (anything with ``to_dict()``: callbacks/verdicts.Verdict), or None. ``log_history``:
    the Trainer's, written beside (``story.LOG_HISTORY``) for the loss curves of a Trainer that never saves its state.
    ``arrivals``: the exchanges of the ranks' phase times (``callbacks/arrivals.StragglerWatch.windows``)."""

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if log_history is not None:
        (out / LOG_HISTORY).write_text(json.dumps({"log_history": log_history}, default=str))
    sample_dicts = [s.to_dict() for s in samples]
    with open(out / JSONL, "w") as f:
        for s in sample_dicts:
            f.write(json.dumps({"kind": "sample", **s}) + "\n")
        for r in records:
            f.write(json.dumps({"kind": "window", **r}) + "\n")
        for a in arrivals or []:
            f.write(json.dumps({"kind": "arrivals", **a}) + "\n")
    summary = _summary(sample_dicts, records, verdict.to_dict() if verdict else None, gpu_names)
    (out / SUMMARY).write_text(json.dumps(summary, indent=2))
    render_report(out)
    return out


def load_run(output_dir) -> tuple[list[dict], list[dict], dict]:
    """The telemetry's samples, windows and summary; a line that is not a JSON object (the last line of a killed
    process's file is often cut short) is skipped."""
    samples, windows, _ = read_telemetry_lines(output_dir)
    return samples, windows, read_summary(output_dir)


def read_telemetry_lines(output_dir) -> tuple[list[dict], list[dict], list[dict]]:
    """telemetry.jsonl read once: (sampler readings, log windows, the exchanges of the ranks' phase times: none with
    one process). A line that is not a JSON object is skipped, and an exchange without its ranks."""
    samples, windows, arrivals = [], [], []
    for line in (Path(output_dir) / JSONL).read_text().splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if not isinstance(item, dict):
            continue
        kind = item.get("kind")
        if kind == "arrivals":
            if isinstance(item.get("ranks"), list):
                arrivals.append(item)
            continue
        if kind != "sample" and isinstance(item.get("metrics"), dict):
            item["metrics"] = renamed_loop_keys(item["metrics"])
        (samples if kind == "sample" else windows).append(item)
    return samples, windows, arrivals


def read_summary(output_dir) -> dict:
    try:
        summary = json.loads((Path(output_dir) / SUMMARY).read_text())
    except ValueError:
        summary = {}
    return summary if isinstance(summary, dict) else {}


def renamed_loop_keys(metrics: dict) -> dict:
    """Runs recorded before the loop metrics were renamed ``train/X`` -> ``loop/X`` (TensorBoard and W&B add their own
    ``train/`` prefix: ``train/train/X``) read as runs recorded now."""
    return {("loop/" + k[len("train/"):] if k.startswith("train/") else k): v for k, v in metrics.items()}


def telemetry_recorded(output_dir) -> bool:
    """Whether telemetry recorded the run in ``output_dir`` (its samples and its summary are there)."""
    out = Path(output_dir)
    return (out / JSONL).is_file() and (out / SUMMARY).is_file()


def render_report(output_dir) -> list[Path]:
    """(Re)draw report.md and its charts from the files already in output_dir: the run's story (final metrics, loss,
    learning rate and gradient norm against steps, the resolved config: story.py), the launch plan applied and not
    applied, the telemetry summary and panels when telemetry recorded the run, the generations of a causal LM."""

    out = Path(output_dir)
    told, story_plots = story(out)
    recorded = telemetry_recorded(out)
    samples, windows, arrivals = read_telemetry_lines(out) if recorded else ([], [], [])
    summary = read_summary(out) if recorded else {}
    plots = draw_all(out, samples, windows) if recorded else []
    timeline = draw_rank_timeline(out, arrivals) if recorded else None
    plots += [timeline] if timeline else []
    lines = ["# Run report", "", *told]
    run_summary = read_json_object(out / "run_summary.json")
    plan = run_summary.get("plan") if run_summary is not None else None
    if isinstance(plan, dict):
        lines += render_plan_section(plan)
    elif run_summary is not None:  # a run of scripts/finetune.py without a plan
        lines += ["## Launch plan", "", "none: the recipe's values and the defaults (`hf-gpu-train config` writes one: "
                  "docs/config-and-launch.md)", ""]
    else:  # anyone's Trainer: the plan and its values are scripts/finetune.py's record
        lines += ["## Launch plan", "", "not recorded (scripts/finetune.py records the launch plan it applied)", ""]
    lines += ["## Telemetry", ""]
    if recorded:
        lines += [render_terminal_summary(summary), "", *[f"![{p.stem}]({p.name})" for p in plots], ""]
    else:
        lines += ["not recorded (telemetry=false, or a Trainer without attach_telemetry)", ""]
    lines += generations_section(out)
    (out / REPORT).write_text("\n".join(lines) + "\n")
    return story_plots + plots


def render_plan_section(plan: dict) -> list[str]:
    """The launch plan the run ran with: each value planned and used, the overrides, the planner's memory
    estimate against the measured peak (entries not of the recorded shape are left out)."""
    lines = ["## Launch plan", "", f"{plan.get('file')} ({plan.get('machine')}, {plan.get('strategy')}), found by {plan.get('found_by')}", "",
             "| value | plan | used | reason |", "|---|---|---|---|"]
    values = plan.get("values")
    for key, v in (values.items() if isinstance(values, dict) else ()):
        if isinstance(v, dict):
            lines.append(f"| {key} | {v.get('plan')} | {v.get('used')} | {v.get('reason')} |")
    overridden = plan.get("overridden")
    for o in overridden if isinstance(overridden, list) else ():
        if isinstance(o, dict):
            lines.append(f"\noverridden by {o.get('source')}: {o.get('key')}={o.get('user_value')} over the plan's {o.get('plan_value')}")
    memory = plan.get("memory")
    if isinstance(memory, dict) and {"estimate_bytes", "usable_bytes"} <= memory.keys():
        gib = 2**30
        measured = memory.get("measured_peak_bytes")
        lines.append(f"\nmemory: planner {memory['estimate_bytes'] / gib:.2f} GiB per process for the values used "
                     f"(of {memory['usable_bytes'] / gib:.2f} GiB usable)"
                     + (f"; measured peak {measured / gib:.2f} GiB ({memory.get('measured')}), error {memory['error_pct']:+.1f}%"
                        if measured is not None else "; no measured peak (CPU run)"))
    elif plan.get("memory_note"):
        lines.append(f"\nmemory: {plan['memory_note']}")
    return lines + [""]


def render_terminal_summary(summary: dict) -> str:
    m = summary.get("metrics", {})

    def mean(key, unit="", digits=1):
        return f"{m[key]['mean']:.{digits}f}{unit}" if key in m else "-"

    lines = [f"GPUs: {', '.join(f'GPU{k} {v}' for k, v in summary.get('gpus', {}).items()) or 'none (CPU run)'}",
             f"windows: {summary.get('windows', 0)}, sampler readings: {summary.get('samples', 0)}",
             f"samples/s {mean('loop/samples_per_s')}, tokens/s {mean('loop/tokens_per_s', digits=0)}, "
             f"step {mean('loop/step_time_s', ' s', 3)}, data wait {mean('loop/data_wait_pct', '%')}, MFU {mean('loop/mfu_pct', '%')}"]
    for key in sorted(k for k in m if k.startswith("gpu") and k.endswith(("util_pct", "power_w", "temp_c", "mem_used_gib"))):
        lines.append(f"{key}: mean {m[key]['mean']:.1f}, max {m[key]['max']:.1f}")
    if summary.get("throttle_reasons_seen"):
        lines.append(f"throttling seen: {', '.join(summary['throttle_reasons_seen'])}")
    for key in sorted(k for k in m if k.endswith("/power_capped_pct") and m[k]["max"] > 0):
        lines.append(f"{key.split('/')[0]} at power limit (SwPowerCap, not throttling) in {m[key]['mean']:.0f}% of readings on average")
    for event in summary.get("gpu_health") or []:
        lines.append(f"GPU health, rank {event.get('rank')}: {event.get('message')} (fix: {event.get('fix')})")
    for named in summary.get("stragglers_named") or []:
        lines.append(f"named at step {named.get('since_step')}: {named.get('line')}")
    counts = summary.get("verdict_counts", {})
    if counts:
        lines.append("verdicts over the run: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
    v = summary.get("final_verdict")
    if v:
        label = ", ".join([v["kind"], *v.get("qualifiers", [])])
        lines.append(f"verdict: {label}: {v['evidence']}. Next: {v['next_step']}")
        lines += [f"note: {n}" for n in v.get("notes", [])]
    return "\n".join(lines)
