"""``hf-gpu-train report OUTPUT_DIR``: redraw the run report and print the summary and verdict."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="render the telemetry report of a run and print its verdict",
                              description="Re-render report.md and the SVG charts from OUTPUT_DIR/telemetry.jsonl.")
    p.add_argument("output_dir")
    return p


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..report.writer import JSONL, SUMMARY, load_run, render_report, render_terminal_summary

    out = Path(args.output_dir)
    if not (out / JSONL).is_file() or not (out / SUMMARY).is_file():
        raise UsageError(f"{out} has no {JSONL} / {SUMMARY}: was the run trained with telemetry (telemetry=true)?")
    plots = render_report(out)
    _, _, summary = load_run(out)
    print(render_terminal_summary(summary))
    print(f"\nreport: {out / 'report.md'}; plots: {', '.join(p.name for p in plots) or 'none (no GPU samples)'}")
    return 0
