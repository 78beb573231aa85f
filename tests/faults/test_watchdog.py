"""Issue 18, item 2: a rank that stalls ends the run in seconds, every rank's stacks on disk, the stalled rank
named; and the unit parts (limits, who is behind, the summary) on their own."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hf_gpu_train.faults.watchdog import HANG_EXIT_CODE, Limits, Progress, Watchdog, behind, summary
from tests.launching import cpu_config, launch


def wait_for_the_trip(exits: list, seconds: float = 10) -> None:
    """Until the watchdog has called its exit (with the hang's code), at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [HANG_EXIT_CODE]

def test_the_limit_follows_the_measured_step_time_above_its_floors():
    progress = Progress()
    limits = Limits(floor_s=5, long_floor_s=50, factor=10)
    assert progress.limit(limits)[0] == 50  # the first step: the long floor
    progress.step_times.extend([0.1, 0.2, 0.1])
    assert progress.limit(limits) == (5, "the floor for a step")
    progress.step_times.extend([2.0, 2.0, 2.0, 2.0])
    assert progress.limit(limits)[0] == pytest.approx(20.0)  # 10 x the median 2 s
    progress.step_times.append(30.0)  # a step that generates (GRPO), a recompile: 3 x the longest recent step
    assert progress.limit(limits)[0] == pytest.approx(90.0)
    progress.enter("evaluation")
    assert progress.limit(limits)[0] == 50  # evaluation: the long floor (its own batches' times, none yet)
    progress.enter("data")  # rank 0 may still write the checkpoint: the next step keeps the long floor until it ends
    assert progress.after_long_phase and progress.limit(Limits(floor_s=5, long_floor_s=500))[0] == 500
    progress.step_done(8)
    assert not progress.after_long_phase
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
    assert "watchdog=SECONDS sets the limit for every phase, watchdog=off turns it off" in lines[-1]  # the fix when merely slow
    assert not any("telemetry had named" in line for line in lines)
    named = {"rank": 1, "phase": "data", "since_step": 2, "line": "straggler: rank 1 is slow in data (+60 ms per step)"}
    lines = summary({r: {**s, "straggler": named} for r, s in at.items()}, 1, 4.0, "the floor for a step", Path("out/hang-x"))
    assert "  before the hang, telemetry had named a straggler: rank 1 is slow in data (+60 ms per step) (at step 2)" in lines


def test_one_process_that_stalls_dumps_its_stacks_and_exits(tmp_path):
    exits = []
    watchdog = Watchdog(tmp_path, Limits(floor_s=0.3, long_floor_s=0.3), poll_s=0.05, exit=exits.append)
    watchdog.start()
    wait_for_the_trip(exits)
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
    # the launch's last line names the rank the watchdog found, not the rank that exited first (rank 0 here)
    assert "hf-gpu-train launch: hang: rank(s) 1 not where the others are" in run.stderr and run.returncode == 3
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


@pytest.mark.slow
def test_saves_and_evaluations_are_every_ranks_or_a_clear_error(tmp_path):
    """Issue 18, item 6. Rank 1 alone sets should_save and should_evaluate at step 2: both ranks save and evaluate.
    Rank 0 alone calls save_model() at step 3 (plain DDP gathers nothing: allowed). Rank 0 alone calls evaluate() at
    step 4, which gathers from every rank: a clear error naming rank 1, in seconds, not a hang."""
    start = time.monotonic()
    run = launch(cpu_config(tmp_path), Path(__file__).with_name("hang_probe.py"), str(tmp_path), "alone", timeout=240)
    seconds = time.monotonic() - start
    evaluated = {r: (tmp_path / f"evaluated-rank-{r}.txt").read_text().split() if (tmp_path / f"evaluated-rank-{r}.txt").exists()
                 else [] for r in (0, 1)}
    assert evaluated == {0: ["2"], 1: ["2"]}, (evaluated, run.stderr[-3000:])
    checkpoint = tmp_path / "checkpoint-2"
    assert (checkpoint / "rng_state_0.pth").is_file() and (checkpoint / "rng_state_1.pth").is_file()
    assert (tmp_path / "rank-0-model" / "model.safetensors").is_file()
    assert run.returncode not in (0, 3) and "training finished" not in run.stdout  # an error, before any watchdog trip
    # rank 1 went on to the all-reduce of the next step's flags, which rank 0 has not entered
    assert "RankMismatch: trainer.evaluate() was entered by rank 0 at step 4, but rank 1 waits in all_reduce" in run.stderr, \
        run.stderr[-3000:]
    # the error is the run's end (rank 1's 4 s watchdog may still trip while rank 0's process exits, under load)
    assert "hf-gpu-train launch: rank 0 failed (exit 1)" in run.stderr and seconds < 90, (seconds, run.stderr[-2000:])


def test_a_training_that_ends_in_an_exception_leaves_no_watchdog_behind(tmp_path):
    """The full suite died with exit 3: a test's finetune() ended in KeyboardInterrupt (on_train_end never ran), its
    watchdog stayed armed, and 120 s later it ended the pytest process. Leaving train() by any way disarms it."""
    import threading

    from transformers import Trainer, TrainerCallback

    from hf_gpu_train.faults.watchdog import attach_watchdog
    from tests.callbacks.tiny import TokenDataset
    from tests.oom.test_oom import exact_bert, oom_args

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise KeyboardInterrupt

    exits = []
    trainer = Trainer(model=exact_bert(), args=oom_args(tmp_path, max_steps=5), train_dataset=TokenDataset(n=64),
                      callbacks=[Interrupt()])
    # a limit a loaded 2-core machine's tiny-BERT steps stay under (0.3 s tripped inside training with a benchmark beside)
    attach_watchdog(trainer, timeout=2.0, poll_s=0.05, exit=exits.append)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    time.sleep(2.5)
    assert exits == [] and not list(tmp_path.glob("hang-*"))
    assert not [t for t in threading.enumerate() if t.name == "hf_gpu_train-watchdog"]
    trainer.evaluate(TokenDataset(n=8))  # watched while it runs, and disarmed again after
    time.sleep(2.5)
    assert exits == [] and not [t for t in threading.enumerate() if t.name == "hf_gpu_train-watchdog"]


def test_a_disk_that_fails_or_stops_answering_does_not_keep_the_run_alive(tmp_path, capsys):
    """Review of issue 18: the dump ran before anything else, so a hung output_dir hung the watchdog too, and an
    OSError ended its thread silently. Now the process exits whatever the disk does, with the stacks on stderr."""
    from hf_gpu_train.faults.watchdog import _within

    started = time.monotonic()
    assert _within(0.2, lambda: time.sleep(5)) is False and time.monotonic() - started < 2
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # output_dir is a file: every write under it fails
    exits = []
    watchdog = Watchdog(blocked, Limits(floor_s=0.2, long_floor_s=0.2), poll_s=0.05, collect_s=1, exit=exits.append)
    watchdog.start()
    wait_for_the_trip(exits)
    assert "could not write" in capsys.readouterr().err
