"""Leaving the default process group when a training process is done.

A process that exits with its process group alive can abort at interpreter shutdown: Gloo's worker threads still
hold work objects whose tensors reach back into Python, and destroying them while the interpreter is torn down ends
in ``std::terminate`` ("terminate called without an active exception", exit -6) after all the work succeeded. It
shows intermittently on 2 gloo processes (pytorch#190489; torch's own atexit fix, pytorch#179291, was abandoned),
and NCCL warns about the same omission. torch's advice is to call ``destroy_process_group`` once the process needs
no more communication, near the end of main: the entry points do it after a run that finished.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def leave_process_group() -> bool:
    """Destroy the default process group if this process made one; True when it did. Only after the last
    collective of every rank (a finished run): with NCCL, destroying while a peer still waits can hang it. Only at
    the end of the process: accelerate's state (``PartialState``) still describes the group afterwards, so anything
    that uses accelerate later in the same process would find no group."""
    torch = sys.modules.get("torch")  # never import torch here: a process without it has no group to leave
    if torch is None:
        return False
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return False
    distributed.destroy_process_group()
    return True


def launch_attempt() -> str:
    """This launch and its restart (torchelastic's), for keys in the rendezvous store: a restarted launch keeps the
    store, and must not read the keys of its earlier attempt."""

    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def rendezvous_store():
    """A private connection to the store the default process group was made with (None: no group, or a store
    without ``clone``): for words between ranks that must never wait in a collective."""
    torch = sys.modules.get("torch")
    if torch is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store().clone()
    except Exception:  # noqa: BLE001 (a backend without a store: the callers go without)
        return None


def exit_process(code: int) -> NoReturn:
    """An entry point's last line: leave the process group after a run that finished (exit 0), then exit with ``code``.
    After a failure the group is left as it is: a peer may still be inside a collective.

    After a finished run in a process group the process ends without the interpreter's finalisation: leaving the
    default group is not enough on its own (seen in CI on 2 gloo FSDP processes: "terminate called without an active
    exception", exit -6, on one rank after it wrote everything; gloo's threads and the groups FSDP and DeepSpeed make
    are torn down with the interpreter's objects). What an exit must do still happens, in order: threading's shutdown
    (its exit callbacks, the join of non-daemon threads), the exit handlers (logging's flush, temporary directories,
    ``end_quickly``), the standard streams' flush; then ``os._exit``. Not done: a file object left open and unflushed
    is not flushed by its finaliser (the entry points close what they write)."""
    if code == 0:
        if leave_process_group():  # this process had a group: gloo's threads live until the interpreter ends
            _exit_without_finalisation(code)
    sys.exit(code)


def _exit_without_finalisation(code: int) -> NoReturn:
    try:
        # what a normal exit does first: threading's exit callbacks (concurrent.futures finishing queued work, a Hub
        # upload's included) and the join of every non-daemon thread; then the atexit handlers
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()  # the handlers a normal exit runs, which os._exit would skip
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing left to say
                pass
        os._exit(code)
