"""Issue 18, item 2: a rank that stalls ends the run in seconds, every rank's stacks on disk, the stalled rank
named; and the unit parts (limits, who is behind, the summary) on their own."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hf_gpu_train.training.watchdog import HANG_EXIT_CODE, Limits, Progress, Watchdog, behind, summary

from ..launching import cpu_config, launch


def test_the_limit_follows_the_measured_step_time_above_its_floors():
    progress = Progress()
    limits = Limits(floor_s=5, long_floor_s=50, factor=10)
    assert progress.limit(limits)[0] == 50  # the first step: the long floor
    progress.step_times.extend([0.1, 0.2, 0.1])
    assert progress.limit(limits) == (5, "the floor for a step")
    progress.step_times.extend([2.0, 2.0, 2.0, 2.0])
    assert progress.limit(limits)[0] == pytest.approx(20.0)  # 10 x the median 2 s
    progress.enter("evaluation")
    assert progress.limit(limits)[0] == 50  # evaluation has the long floor
    assert Limits.from_setting("off") is None and Limits.from_setting(30) == Limits(floor_s=30, long_floor_s=30)


def test_the_ranks_not_where_the_others_are_are_named():
    at = {0: {"step": 3, "phase": "backward", "stalled_s": 9}, 1: {"step": 3, "phase": "data", "stalled_s": 9},
          2: {"step": 3, "phase": "backward", "stalled_s": 9}}
    assert behind(at) == [1]
    assert behind({0: at[0], 2: at[2]}) == []
    # the same phase on both, but rank 0 waits in its 7th collective and rank 1 entered only 6: rank 1 is elsewhere
    gather = {0: {"step": 2, "phase": "data", "stalled_s": 5, "collectives": 7, "in_collective": "all_gather"},
              1: {"step": 2, "phase": "data", "stalled_s": 5, "collectives": 6, "in_collective": "all_reduce"}}
    assert behind(gather) == [1]
    lines = summary({**at, 3: None}, 1, 4.0, "the floor for a step", Path("out/hang-x"))
    assert lines[0].startswith("hang: no progress for 9 s on rank 1 (limit 4 s")
    assert "  rank 1: step 3 finished, in data for 9 s, not in a collective (0 entered)   <- not where the others are" in lines
    assert "  rank 3: no answer (stuck holding the interpreter, or gone)" in lines


def test_one_process_that_stalls_dumps_its_stacks_and_exits(tmp_path):
    exits = []
    watchdog = Watchdog(tmp_path, Limits(floor_s=0.3, long_floor_s=0.3), poll_s=0.05, exit=exits.append)
    watchdog.start()
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [HANG_EXIT_CODE]
    (folder,) = tmp_path.glob("hang-*")
    assert "test_one_process_that_stalls_dumps_its_stacks_and_exits" in (folder / "rank-0.txt").read_text()  # the main thread
    assert json.loads((folder / "summary.json").read_text())["ranks"]["0"]["phase"] == "data"


@pytest.mark.slow
@pytest.mark.parametrize("mode, where", [("collate", "collate_that_stalls_on_rank_1"), ("collective", "on_step_end")])
def test_a_rank_that_stalls_ends_the_run_with_every_ranks_stacks_and_its_name(tmp_path, mode, where):
    start = time.monotonic()
    run = launch(cpu_config(tmp_path), Path(__file__).with_name("hang_probe.py"), str(tmp_path), mode, timeout=240)
    seconds = time.monotonic() - start
    assert run.returncode != 0 and "training finished" not in run.stdout
    (folder,) = tmp_path.glob("hang-*")
    stacks = {r: (folder / f"rank-{r}.txt").read_text() for r in (0, 1)}
    assert where in stacks[1] and where not in stacks[0]  # rank 1's stack shows where it stalled
    report = json.loads((folder / "summary.json").read_text())
    assert report["behind"] == [1], (folder / "summary.txt").read_text()
    assert "<- not where the others are" in (folder / "summary.txt").read_text()
    assert "hf_gpu_train: hang: no progress" in run.stderr
    assert seconds < 120, seconds  # not the 1800 s collective timeout (the launch itself takes ~15 s here)


@pytest.mark.slow
def test_a_rank_that_dies_is_named_with_its_signal_and_every_ranks_last_step(tmp_path):
    """Issue 18, item 1: the launcher stopped the other rank in seconds, but nothing named the dead rank."""
    import re

    run = launch(cpu_config(tmp_path), Path(__file__).with_name("hang_probe.py"), str(tmp_path), "kill", timeout=240)
    assert run.returncode != 0 and "training finished" not in run.stdout
    line = next((x for x in run.stderr.splitlines() if x.startswith("hf-gpu-train launch: rank 1 died")), None)
    assert line is not None, run.stderr[-3000:]
    assert re.search(r"rank 1 died \(SIGKILL, exit -9\); last step finished: rank 0 [23], rank 1 [23]\.", line), line
