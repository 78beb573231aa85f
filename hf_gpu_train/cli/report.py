"""``hf-gpu-train report OUTPUT_DIR``: redraw the run report and print the summary and verdict."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="redraw a run's report.md (metrics, curves, config, plan, telemetry)",
                              description="Re-render OUTPUT_DIR/report.md and its SVG charts from the files the run left: "
                              "trainer_state.json (loss, learning rate, gradient norm), eval_results.json, "
                              "finetune_config.yaml, run_summary.json (the launch plan) and, when telemetry recorded the run, "
                              "telemetry.jsonl; prints the telemetry summary and verdict.")
    p.add_argument("output_dir")
    return p


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..report.writer import JSONL, load_run, render_report, render_terminal_summary, telemetry_recorded

    out = Path(args.output_dir)
    recorded = telemetry_recorded(out)
    if not recorded and not any((out / name).is_file() for name in ("trainer_state.json", "eval_results.json")):
        raise UsageError(f"{out} holds no run: no trainer_state.json, eval_results.json or {JSONL}; give the output_dir "
                         "of a fine-tune (scripts/finetune.py writes them there)")
    plots = render_report(out)
    if recorded:
        _, _, summary = load_run(out)
        print(render_terminal_summary(summary))
    print(f"\nreport: {out / 'report.md'}; charts: {', '.join(p.name for p in plots) or 'none'}")
    return 0
