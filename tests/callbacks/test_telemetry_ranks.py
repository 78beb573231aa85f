import json
from pathlib import Path

import pytest

from tests.callbacks.tiny import TokenDataset
from tests.launching import cpu_config, launch


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
    assert "telemetry step 4: straggler: rank 1 is slow in data" in run.stderr, run.stderr[-3000:]
    assert [(n["rank"], n["phase"], n["since_step"]) for n in summary["stragglers_named"]] == [(1, "data", 4)]
    # each rank counts its own tokens; summed once per log step they are the whole epoch's, each sample once
    data = TokenDataset(n=96)
    assert sum(w["metrics"].get("loop/tokens", 0) for w in windows) == sum(int(data[i]["attention_mask"].sum()) for i in range(96))
    assert all(r["tokens"] > 0 for r in ranks)


@pytest.mark.slow
def test_a_flag_one_rank_sets_alone_never_leaves_a_collective_to_that_rank(tmp_path):
    """Issue 28, item 4: a callback sets should_log (should_evaluate, should_save) at step 3 on rank 0 only. Telemetry
    (alone, or with the watchdog), guard_saves and the OOM recovery must not enter a collective on it alone: every case ends, both ranks
    act on the flag together and end with the weights of the run without that callback, and telemetry's figures, with
    both ranks' summaries, come with every log step."""
    import torch

    out = tmp_path / "run"
    run = launch(cpu_config(tmp_path), Path(__file__).with_name("rank_local_probe.py"), str(out), timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    seen = {case: [json.loads((out / case / f"rank-{r}.json").read_text()) for r in (0, 1)]
            for case in ("reference", "log", "log+watchdog", "evaluate", "evaluate-everywhere", "save", "save+guard",
                         "save-in-log+guard", "evaluate+oom")}
    for case in seen:  # an evaluation draws a seed from the global RNG: the rank-0 one ends as the every-rank one
        reference = torch.load(out / ("evaluate-everywhere" if case.startswith("evaluate") else "reference") / "rank-0.pt")
        for r in (0, 1):
            weights = torch.load(out / case / f"rank-{r}.pt")
            # the OOM recovery averages gradients with its own reducer: the same sums, in another order (fp32 ulps)
            same = torch.equal if case != "evaluate+oom" else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
            assert all(same(weights[k], reference[k]) for k in reference), (case, r)
    assert [s["evaluated"] for s in seen["evaluate+oom"]] == [[3]] * 2
    assert [s["saved"] for s in seen["save-in-log+guard"]] == [[4]] * 2  # set in on_log at step 4, inside the same call
    assert [s["telemetry_steps"] for s in seen["reference"]] == [[2, 4, 6]] * 2
    for case in ("log", "log+watchdog"):  # the Trainer logs step 3 on both ranks, telemetry's figures with it
        assert [s["telemetry_steps"] for s in seen[case]] == [[2, 3, 4, 6]] * 2, case
        assert seen[case][0]["both_ranks_steps"] == [2, 3, 4, 6], case
    for case in ("evaluate", "save"):
        assert [s["telemetry_steps"] for s in seen[case]] == [[2, 4, 6]] * 2, case
        assert seen[case][0]["both_ranks_steps"] == [2, 4, 6], case
    assert [s["evaluated"] for s in seen["evaluate"]] == [s["evaluated"] for s in seen["evaluate-everywhere"]] == [[3]] * 2
    assert [s["saved"] for s in seen["save"]] == [[3]] * 2 and (out / "save" / "checkpoint-3" / "rng_state_1.pth").is_file()
    assert [s["saved"] for s in seen["save+guard"]] == [[3]] * 2
    from hf_gpu_train.faults.checkpoint_marker import COMPLETE_MARKER

    assert (out / "save+guard" / "checkpoint-3" / COMPLETE_MARKER).is_file()
