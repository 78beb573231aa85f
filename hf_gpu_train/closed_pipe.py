"""A reader that goes away (``hf-gpu-train machines | head``, ``scripts/finetune.py | head``) ends the command quietly.

Python raises BrokenPipeError on the next write or flush, and once more at interpreter exit; the documented recipe
(Python docs, signal module, "Note on SIGPIPE") is to catch it where the program ends and point stdout at
/dev/null. The exit status is 141, what a shell reports for a C tool killed by SIGPIPE, so ``set -o pipefail``
scripts see what they see for ``cat | head``, and nothing claims a write that did not happen.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE


def _stdout_to_devnull() -> None:
    """Point fd 1 at /dev/null, so the interpreter's last flush at exit cannot fail again. Under pytest's capture
    stdout has no file descriptor, and there is nothing to redirect."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def until_the_pipe_closes(run: Callable[[], int]) -> int:
    """``run()``'s exit code, or EXIT_CLOSED_PIPE when stdout's reader went away."""
    try:
        try:
            return run()
        finally:
            sys.stdout.flush()  # a closed pipe surfaces here, inside the try, not as a traceback at interpreter exit
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_CLOSED_PIPE
