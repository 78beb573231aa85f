import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_gloo_processes_produce_the_per_rank_summary_and_name_the_straggler(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "cpu2"
    made = subprocess.run([sys.executable, "-m", "hf_gpu_train", "config", "--machine", "cpu-only", "--num-processes", "2",
                           "--main-process-port", str(port), "--output", str(cfg)], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "hf_gpu_train", "launch", "--config-file", f"{cfg}.yaml",
                          str(Path(__file__).with_name("telemetry_probe.py")), str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    windows = [json.loads(line) for line in (out / "telemetry.jsonl").read_text().splitlines() if '"kind": "window"' in line]
    ranked = [w for w in windows if w.get("ranks")]
    assert ranked, windows
    ranks = [r for r in ranked[-1]["ranks"] if "rank" in r]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert all("own_step_time_s" in r and "data_wait_pct" in r for r in ranks)
    summary = json.loads((out / "telemetry_summary.json").read_text())
    assert summary["straggler_ranks"] == [1]
    assert "straggler rank(s) [1]" in run.stderr
