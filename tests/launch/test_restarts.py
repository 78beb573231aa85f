"""When hf-gpu-train launch starts a failed launch again (issue 38, item 4): only where a restart can help."""

from __future__ import annotations

import pytest

from hf_gpu_train.cli.launch import take_restarts
from hf_gpu_train.errors import UsageError
from hf_gpu_train.launch.restarts import Outcome, RestartPolicy

KILLED_AT_5 = Outcome(1, cause=(1, -9), steps=((0, 5), (1, 5)), resumes=True)


def test_a_rank_that_died_is_restarted_and_the_same_failure_twice_is_not():
    policy = RestartPolicy()
    again, line = policy.restart_line(KILLED_AT_5)
    assert again and line.startswith("rank 1 died of SIGKILL after step 5: restarting (1 of 3")
    again, line = policy.restart_line(KILLED_AT_5)
    assert not again and "the same failure as the start before (rank 1 died of SIGKILL after step 5)" in line


def test_failures_at_other_steps_are_restarted_up_to_the_limit():
    policy = RestartPolicy(max_restarts=2)
    answers = [policy.restart_line(Outcome(1, cause=(0, -9), steps=((0, step),), resumes=True)) for step in (3, 7, 11)]
    assert [again for again, _ in answers] == [True, True, False]
    assert "2 restart(s) used (--max-restarts)" in answers[-1][1]


@pytest.mark.parametrize("outcome", [Outcome(0), Outcome(2, usage_error=True), Outcome(2), Outcome(75, preempted=True),
                                     Outcome(1, cause=(0, 1), preempted=True)])
def test_success_usage_errors_and_stop_signals_are_never_restarted(outcome):
    assert RestartPolicy().restart_line(outcome) == (False, None)


def test_zero_restarts_is_the_launch_as_before():
    assert RestartPolicy(0).restart_line(KILLED_AT_5) == (False, None)


def test_a_failure_whose_step_was_not_recorded_is_said_so():
    assert Outcome(1, cause=(0, 1)).describe() == "rank 0 exited 1 (its step not recorded: watchdog=off?)"


def test_a_script_that_does_not_resume_is_not_restarted():
    again, line = RestartPolicy().restart_line(Outcome(1, cause=(1, -9), steps=((0, 5),)))
    assert not again and "did not say they resume" in line and "train from step 0" in line


def test_the_option_is_taken_out_of_accelerates_options_in_either_spelling():
    argv = ["--num_processes", "2", "--max_restarts", "5", "--config-file", "c.yaml", "train.py", "--max-restarts", "9"]
    assert take_restarts(argv) == (5, ["--num_processes", "2", "--config-file", "c.yaml", "train.py", "--max-restarts", "9"])
    assert take_restarts(["--max-restarts=0", "train.py"]) == (0, ["train.py"])
    assert take_restarts(["train.py"]) == (None, ["train.py"])  # the default: DEFAULT_RESTARTS on one machine
    with pytest.raises(UsageError, match="--max-restarts -1"):
        take_restarts(["--max-restarts", "-1", "train.py"])
