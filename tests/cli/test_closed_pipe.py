"""`hf-gpu-train ... | head` must end quietly: no BrokenPipeError traceback, exit 141 like a tool killed by SIGPIPE.

The reader's end of a real OS pipe is closed before the command starts, so every write fails with EPIPE:
deterministic, unlike `| head -1`, which races the writer against the pipe buffer.
"""

import os
import subprocess
import sys

import pytest

from hf_gpu_train.closed_pipe import EXIT_CLOSED_PIPE


def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "hf_gpu_train", *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [["machines"], ["detect", "--machine", "8x-h100-sxm"], ["doctor", "--machine", "cpu-only"]],
                         ids=["machines", "detect", "doctor"])
def test_a_closed_pipe_ends_quietly_with_141(args):
    result = run_into_closed_pipe(*args)
    assert result.stderr == ""  # no traceback, no "Exception ignored ... BrokenPipeError" at interpreter exit
    assert result.returncode == EXIT_CLOSED_PIPE == 141


def test_an_open_pipe_still_gets_everything():
    result = subprocess.run(f"{sys.executable} -m hf_gpu_train machines | head -1", shell=True, capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.split() == ["Name", "GPUs", "Description"]
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr
