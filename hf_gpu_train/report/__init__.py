"""The run report: telemetry.jsonl, telemetry_summary.json, report.md and SVG charts in output_dir."""

from .writer import load_run, render_terminal_summary, write_run_report

__all__ = ["write_run_report", "load_run", "render_terminal_summary"]
