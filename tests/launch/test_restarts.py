"""When hf-gpu-train launch starts a failed launch again (issue 38, item 4): only where a restart can help."""

from __future__ import annotations

import json

import pytest

from hf_gpu_train.cli.launch import take_restarts
from hf_gpu_train.errors import UsageError
from hf_gpu_train.launch.restarts import Outcome, RestartPolicy, record_verdict

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


DIED = Outcome(1, (1, -9), ((0, 5), (1, 5)), resumes=True)
PEER_GONE = Outcome(1, (0, 1), ((0, 5),), resumes=True)  # what the other node sees of the same failure


def verdicts(folder) -> dict[str, str]:
    return {p.name: p.read_text().strip() for p in folder.iterdir() if p.suffix in (".restart", ".stop")}


def test_a_jobs_restarts_are_counted_once_per_start_however_many_nodes_decide(tmp_path):
    """The sbatch's ledger: two nodes of one start decide from the same state (one restart used, not two), and the
    failure either saw counts as "the start before" for both at the next start."""
    line = record_verdict(DIED, 3, tmp_path, "n2", "0.1")
    assert line.startswith("rank 1 died of SIGKILL after step 5: restarting (1 of 3")
    assert record_verdict(PEER_GONE, 3, tmp_path, "n1", "0.1").startswith("rank 0 exited 1 after step 5: restarting (1 of 3")
    assert set(verdicts(tmp_path)) == {"n1.restart", "n2.restart"}
    for name in verdicts(tmp_path):
        (tmp_path / name).unlink()
    # the next start fails the same way, seen first by the node that saw the other side before
    again = record_verdict(PEER_GONE, 3, tmp_path, "n2", "0.2")
    assert again.startswith("the same failure as the start before (rank 0 exited 1 after step 5)")
    assert verdicts(tmp_path) == {"n2.stop": again}


def test_the_restarts_are_kept_across_requeues_and_end_at_the_limit(tmp_path):
    for start, step in enumerate((3, 5), start=1):
        assert "restarting" in record_verdict(Outcome(1, (1, -9), ((1, step),), resumes=True), 2, tmp_path, "n1", f"{start - 1}.1")
    last = record_verdict(Outcome(1, (1, -9), ((1, 7),), resumes=True), 2, tmp_path, "n1", "2.1")
    assert "2 restart(s) used (--max-restarts): not restarting again" in last and (tmp_path / "n1.stop").is_file()


def test_a_usage_error_says_stop_and_a_stop_signal_or_success_says_nothing(tmp_path):
    record_verdict(Outcome(0), 3, tmp_path, "n1", "0.1")
    record_verdict(Outcome(75, preempted=True), 3, tmp_path, "n2", "0.1")
    assert verdicts(tmp_path) == {}
    record_verdict(Outcome(2, usage_error=True), 3, tmp_path, "n1", "0.2")
    assert list(verdicts(tmp_path)) == ["n1.stop"]


def test_an_unreadable_ledger_is_said_and_counted_from_zero(tmp_path, capsys):
    (tmp_path / "ledger.json").write_text('{"attempt": "0.1", "bef')  # a writer killed mid-write (before os.replace)
    assert "restarting (1 of 3" in record_verdict(DIED, 3, tmp_path, "n1", "0.2")
    assert "ledger.json unreadable" in capsys.readouterr().out
    assert json.loads((tmp_path / "ledger.json").read_text())["after"]["restarts"] == 1


def test_failures_whose_step_is_not_known_are_never_the_same_one():
    """A failure before any step was recorded (watchdog off, a crash at start) says nothing of where: restarted up to
    the limit rather than refused as the one before."""
    policy = RestartPolicy(2)
    unknown = Outcome(1, (0, 1), (), resumes=True)
    assert policy.restart_line(unknown)[0] and policy.restart_line(unknown)[0]
    assert not policy.restart_line(unknown)[0]  # the limit
