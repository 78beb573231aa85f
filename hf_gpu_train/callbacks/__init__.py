"""Trainer callbacks: telemetry with verdicts, and the guard against training on the CPU by accident."""

from .guards import CpuByAccidentGuard, TrainingOnCpuByAccident
from .telemetry import TelemetryCallback, attach_telemetry

__all__ = ["TelemetryCallback", "attach_telemetry", "CpuByAccidentGuard", "TrainingOnCpuByAccident"]
