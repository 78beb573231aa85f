"""Every integration example runs as its docstring says (one process, a tiny Llama) and recovers the OOM it injects."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", ["own_trainer.py", "trl_sft.py", "trl_dpo.py"])
def test_example_runs_and_recovers_an_oom(tmp_path, script):
    pytest.importorskip("trl")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--max-steps", "2", "--inject-oom",
                           "--output", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "OOM recovery (train, step 0)" in output and "retrying the same" in output
    assert re.search(r"step 2/2 \[\d\d:\d\d<00:00\] \| loss", output) and "tok/s" in output  # the step line
