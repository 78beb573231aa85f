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
