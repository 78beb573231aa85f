"""``hf-gpu-train report OUTPUT_DIR``: redraw the run report and print the summary and verdict."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UsageError
from ..report.story import LOG_HISTORY, read_history
from ..report.writer import JSONL, load_run, render_report, render_terminal_summary, telemetry_recorded


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="redraw a run's report.md (metrics, curves, config, plan, telemetry)",
                              description="Re-render OUTPUT_DIR/report.md and its SVG charts from the files the run left: "
                              "trainer_state.json (loss, learning rate, gradient norm), eval_results.json, "
                              "finetune_config.yaml, run_summary.json (the launch plan) and, when telemetry recorded the run, "
                              "telemetry.jsonl; prints the telemetry summary and verdict.")
    p.add_argument("output_dir")
    return p


def run(args: argparse.Namespace) -> int:

    out = Path(args.output_dir)
    if not out.is_dir():
        raise UsageError(f"{out} is not a directory: give the output_dir of a fine-tune")
    recorded = telemetry_recorded(out)
    history, _ = read_history(out)
    if not recorded and not history and not (out / "eval_results.json").is_file():
        raise UsageError(f"{out} holds no run: no trainer_state.json (nor one in a checkpoint-N), {LOG_HISTORY}, "
                         f"eval_results.json or {JSONL}; give the output_dir of a fine-tune (scripts/finetune.py and "
                         "attach_telemetry write them there)")
    try:
        plots = render_report(out)
        summary = load_run(out)[2] if recorded else None
        printed = render_terminal_summary(summary) if summary else None
    except (KeyError, TypeError, ValueError, AttributeError) as error:  # files edited or cut short by hand or a crash
        raise UsageError(f"{out}: a file the run left is not in the shape the toolkit writes ({type(error).__name__}: "
                         f"{error}); report.md was not redrawn. Remove or fix the file named, then run this again") from None
    if printed:
        print(printed)
    print(f"\nreport: {out / 'report.md'}; charts: {', '.join(p.name for p in plots) or 'none'}")
    return 0
