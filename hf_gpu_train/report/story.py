"""The run's story in report.md, from the files a fine-tune leaves in ``output_dir``: what it learned (training and
evaluation loss against steps), how it was driven (learning rate, gradient norm), where it ended (the final metrics),
and what it ran with (the resolved config's key values). The telemetry panels and the launch plan follow in
``writer.render_report``; this module reads only what the Trainer and ``scripts/finetune.py`` write:

- ``trainer_state.json``: the Trainer's ``log_history`` (``loss``, ``learning_rate``, ``grad_norm`` at each logging
  step, ``eval_*`` at each evaluation); without it (anyone's Trainer that never called ``save_state``), the
  ``log_history.json`` telemetry writes at train end, else the newest checkpoint's ``trainer_state.json`` (a run killed
  before its end);
- ``eval_results.json``: the final metrics;
- ``finetune_config.yaml``: the resolved config.

Each piece is optional, and a file that is not what the Trainer or the toolkit writes (a truncated or hand-edited one)
is read as missing: what is missing is left out, never guessed.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..svg import Chart

# the resolved config's values a reader of the report wants first, in this order (present ones only)
CONFIG_KEYS = ("task", "model", "method", "dataset", "train_file", "num_train_epochs", "max_steps", "learning_rate",
               "lr_scheduler_type", "warmup_ratio", "per_device_train_batch_size", "global_batch_size", "precision",
               "max_length", "image_size", "packing", "gradient_checkpointing", "checkpoint_layers", "chunked_lm_loss",
               "offload_activations", "optimizer_in_backward", "lora_r", "seed")
SKIPPED_DEFAULTS = {"max_steps": -1, "offload_activations": False, "optimizer_in_backward": False}


CHECKPOINTING_RECORD = "hf_gpu_train_checkpointing.json"  # saves and lost work, faults/checkpoint_costs.py
LOG_HISTORY = "log_history.json"  # the Trainer's log_history, written by telemetry at train end (callbacks/telemetry.py)


def read_json_object(path: Path) -> dict | None:
    """The JSON object in ``path``; None when the file is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _checkpoint_step(path: Path) -> int:
    tail = path.name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1


def read_history(out: Path) -> tuple[list[dict], str | None]:
    """(the run's log history, the file it came from): ``trainer_state.json``, telemetry's ``log_history.json``, or the
    newest ``checkpoint-N/trainer_state.json``; ([], None) when none holds one."""
    # the run's own files, the newest first (a Trainer of someone's own writing log_history.json into an output_dir where
    # an earlier run saved its state draws its own curves), then the checkpoints, the newest first
    own = sorted((f for f in (out / "trainer_state.json", out / LOG_HISTORY) if f.is_file()), key=lambda f: f.stat().st_mtime_ns,
                 reverse=True)
    candidates = own + [c / "trainer_state.json" for c in sorted(out.glob("checkpoint-*"), key=_checkpoint_step, reverse=True)]
    for path in candidates:
        history = (read_json_object(path) or {}).get("log_history")
        if isinstance(history, list):
            return [h for h in history if isinstance(h, dict)], str(path.relative_to(out))
    return [], None


def log_series(history: list[dict], baseline: dict | None = None) -> dict[str, tuple[list[float], list[float]]]:
    """(steps, values) for the training loss, the evaluation loss, the learning rate and the gradient norm; the
    evaluation before training (``baseline``, baseline_results.json) is the evaluation loss at step 0."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    before = baseline.get("eval_loss") if baseline else None
    for key in ("loss", "eval_loss", "learning_rate", "grad_norm"):
        points = [(h["step"], h[key]) for h in history if isinstance(h.get(key), (int, float)) and "step" in h]
        if key == "eval_loss" and isinstance(before, (int, float)) and not any(step == 0 for step, _ in points):
            points.insert(0, (0, before))
        if points:
            series[key] = ([float(s) for s, _ in points], [float(v) for _, v in points])
    return series


def charts(out: Path, series: dict) -> list[Path]:
    """The loss, learning-rate and gradient-norm charts (SVG), for the series that have points."""
    paths = []
    if "loss" in series or "eval_loss" in series:
        chart = Chart("loss", xlabel="optimizer step")
        if "loss" in series:
            chart.line(*series["loss"], "training loss")
        if "eval_loss" in series:
            chart.line(*series["eval_loss"], "evaluation loss", marker="circle")
        paths.append(chart.save(out / "run_loss.svg"))
    for key, title, name in (("learning_rate", "learning rate", "run_learning_rate.svg"),
                             ("grad_norm", "gradient norm (before clipping)", "run_grad_norm.svg")):
        if key in series:
            paths.append(Chart(title, xlabel="optimizer step").line(*series[key], title.split(" (")[0]).save(out / name))
    return paths


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def baseline_sample(baseline: dict | None) -> tuple[int, int] | None:
    """(rows read, validation rows) when the evaluation before training read a sample (baseline_results.json's
    ``rows`` below its ``validation_rows``), else None."""
    rows, of = (baseline or {}).get("rows"), (baseline or {}).get("validation_rows")
    return (rows, of) if rows and of and rows < of else None


def metrics_section(results: dict) -> list[str]:
    shown = {k: v for k, v in results.items() if k.startswith("eval_") and isinstance(v, (int, float))
             and not k.endswith(("_runtime", "_per_second", "_preparation_time"))}  # time, not a metric
    if not shown:
        return []
    lines = ["## Final metrics", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k.removeprefix('eval_')} | {_fmt(v)} |" for k, v in shown.items()]
    baseline = results.get("baseline")
    if isinstance(baseline, dict) and baseline:
        sample = baseline_sample(baseline)
        where = (f"the same evaluation on a seeded sample of {sample[0]} of the {sample[1]} validation rows" if sample
                 else "the same evaluation")
        lines += ["", f"Before training ({where} of the model as it was loaded): "
                  + ", ".join(f"{k.removeprefix('eval_')} {_fmt(v)}" for k, v in baseline.items() if k.startswith("eval_"))]
    return lines + [""]


def _irrelevant(config: dict) -> set[str]:
    """Keys that say nothing about this run: the method of a task that trains no adapters (its config has no adapter
    key), a dataset beside a train_file, a policy without checkpointing, adapter settings for full fine-tuning. Another
    task's keys are not in a run's config: ``finetune_config.yaml`` holds its own task's."""
    found = set() if "lora_r" in config else {"method"}
    if config.get("train_file"):
        found.add("dataset")
    if not config.get("gradient_checkpointing"):
        found.add("checkpoint_layers")
    if config.get("method") == "full":
        found.add("lora_r")
    return found


def config_section(config: dict) -> list[str]:
    skip = _irrelevant(config)
    rows = [(k, config[k]) for k in CONFIG_KEYS if k in config and k not in skip and config[k] is not None
            and SKIPPED_DEFAULTS.get(k, object()) != config[k]]
    if not rows:
        return []
    return ["## Configuration", "", "The resolved config's key values (all of them: `finetune_config.yaml`).", "",
            "| key | value |", "|---|---|", *[f"| {k} | {_fmt(v)} |" for k, v in rows], ""]


def checkpointing_lines(record: dict) -> list[str]:
    """The run report's section: checkpointing's cost and the lost work, measured and expected."""
    if not record:
        return []
    blocked = sum(record.get("blocked_seconds", []))
    training = float(record.get("training_seconds", 0.0) or 0.0)
    lines = ["## Checkpoints", "",
             f"- {record.get('saves', 0)} saves blocked training {blocked:.2f} s"
             + (f" ({100 * blocked / training:.2f}% of {training:.0f} s of training)" if training else "")]
    lost = record.get("lost", [])
    if lost:
        lines.append(f"- lost to failures: {sum(e['steps'] for e in lost)} steps ({sum(e['seconds'] for e in lost):.0f} s) "
                     f"over {len(lost)} restart{'s' if len(lost) != 1 else ''} ("
                     + ", ".join(f"step {e['from_step']} -> {e['resumed_at']}" for e in lost) + ")")
    else:
        lines.append("- lost to failures: nothing (no restart from an older checkpoint)")
    plan = record.get("plan")
    if plan:
        lines.append(f"- expected: a save every {plan['interval_s'] / 60:.1f} min costing {100 * plan['expected_saving_fraction']:.2f}% "
                     f"of the training; {plan['expected_failures']:.3f} failures over this training (one every "
                     f"{plan['mtbf_s'] / 3600:.0f} h: {plan['mtbf_source']}), each losing "
                     f"{plan['expected_lost_per_failure_s'] / 60:.1f} min on average")
    return [*lines, ""]


def story(out: Path) -> tuple[list[str], list[Path]]:
    """(report.md lines, chart paths) for the run in ``out``."""
    lines: list[str] = []
    results = read_json_object(out / "eval_results.json") or {}
    baseline = read_json_object(out / "baseline_results.json")
    if baseline:
        results = {**results, "baseline": baseline}
    lines += metrics_section(results)
    history, source = read_history(out)
    series = log_series(history, baseline)
    plots = charts(out, series)
    if plots:
        sample = baseline_sample(baseline) if "eval_loss" in series else None
        lines += ["## Training", "", *([f"From `{source}` (the run's final state was not saved)."]
                                       if source != "trainer_state.json" else []),
                  *([f"The evaluation loss at step 0 is the evaluation before training's, on a seeded sample of {sample[0]} "
                     f"of the {sample[1]} validation rows; the later points are on every row."] if sample else []),
                  *[f"![{p.stem}]({p.name})" for p in plots], ""]
    lines += checkpointing_lines(read_json_object(out / CHECKPOINTING_RECORD) or {})
    config_file = out / "finetune_config.yaml"
    if config_file.is_file():
        import yaml

        try:
            config = yaml.safe_load(config_file.read_text()) or {}
        except yaml.YAMLError:
            config = {}
        lines += config_section(config if isinstance(config, dict) else {})
    return lines, plots
