"""``hf-gpu-train doctor``: preflight checks, each PASS / WARN / FAIL / SKIP with the exact fix."""

from .checks import FAIL, PASS, SKIP, WARN, Check
from .runner import exit_code, run_checks

__all__ = ["Check", "PASS", "WARN", "FAIL", "SKIP", "run_checks", "exit_code"]
