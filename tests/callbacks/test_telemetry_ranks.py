import json
from pathlib import Path

import pytest

from ..launching import cpu_config, launch
from .tiny import TokenDataset


@pytest.mark.slow
def test_two_gloo_processes_produce_the_per_rank_summary_and_name_the_straggler(tmp_path):
    out = tmp_path / "run"
    run = launch(cpu_config(tmp_path), Path(__file__).with_name("telemetry_probe.py"), str(out))
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
    # each rank counts its own tokens; summed once per log step they are the whole epoch's, each sample once
    data = TokenDataset(n=96)
    assert sum(w["metrics"].get("loop/tokens", 0) for w in windows) == sum(int(data[i]["attention_mask"].sum()) for i in range(96))
    assert all(r["tokens"] > 0 for r in ranks)
