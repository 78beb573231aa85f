"""The line a failed launch ends with (issue 18, item 1), from torchelastic's report and the ranks' progress files."""

from hf_gpu_train.launch.rank_report import failure_line, read_progress, root_cause, write_progress

ELASTIC = """
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_17:50:01
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
"""


def test_the_dead_rank_its_signal_and_every_ranks_last_step(tmp_path):
    for rank, step in ((0, 12), (1, 11)):
        write_progress(rank, step, "data", environ={"HF_GPU_TRAIN_PROGRESS_DIR": str(tmp_path)})
    assert root_cause(ELASTIC) == (1, -9)
    assert failure_line(root_cause(ELASTIC), read_progress(tmp_path)) == (
        "rank 1 died (SIGKILL, exit -9); last step finished: rank 0 12, rank 1 11. Run the same command again to resume "
        "from the last complete checkpoint, if one was saved")
    assert "ended the run on a hang (exit 3" in failure_line((0, 3), {})
    assert root_cause("Traceback ... ValueError") is None and failure_line(None, {}) is None
    # a hang: the watchdog's verdict, not torchelastic's first exit (rank 0, which writes the summary and leaves first)
    hang = {"behind": [1], "folder": "out/hang-x"}
    assert failure_line((0, 3), {}, hang).startswith("hang: rank(s) 1 not where the others are (every rank's stacks in "
                                                     "out/hang-x; exit 3)")


def test_the_failure_line_names_the_straggler_telemetry_had_named(tmp_path, monkeypatch):
    """Issue 39, item 1: a run that dies after telemetry named a straggler says which rank and phase, from the file rank
    0 leaves in the launcher's progress folder; cleared, it says nothing of it."""
    from hf_gpu_train.callbacks.arrivals import StragglerWatch, attribute
    from hf_gpu_train.launch.rank_report import PROGRESS_DIR_ENV, read_straggler
    from tests.callbacks.test_stragglers import row

    monkeypatch.setenv(PROGRESS_DIR_ENV, str(tmp_path))
    watch = StragglerWatch(clock=None)
    slow = attribute([row(wait=70.0), row(optimizer=61.0, wait=10.0)])
    watch._judge(5, slow, True)
    watch._judge(10, slow, True)
    assert read_straggler(tmp_path) is None  # found twice: not named yet
    watch._judge(15, slow, True)
    line = failure_line((0, -9), {0: {"step": 12}, 1: {"step": 12}}, straggler=read_straggler(tmp_path))
    assert line.startswith("rank 0 died (SIGKILL, exit -9); before it, telemetry had named a straggler: rank 1 is slow in "
                           "optimizer (+60 ms per step"), line
    assert line.endswith("(named at step 15); last step finished: rank 0 12, rank 1 12. Run the same command again to "
                         "resume from the last complete checkpoint, if one was saved")
    watch._judge(20, None, True)
    watch._judge(25, None, True)
    assert read_straggler(tmp_path) is None
