"""The launcher's part in preemption: a stop signal reaches the training processes, and the launch ends with
their exit code.

A scheduler signals what it knows: Kubernetes sends SIGTERM to the container's PID 1 only (the launcher), SLURM's
``--signal=B:USR1`` the batch shell only, ``scancel --full`` every process. torchrun (inside ``accelerate launch``)
starts each worker in a process group of its own, so a signal to the launcher's group does not reach them; on
SIGTERM it terminates them itself and SIGKILLs them 30 s later; SIGUSR1 and SIGUSR2 simply kill it (their default
action), orphaning workers that are then killed with the job step. And it ends with its own exit code, not theirs.

``hf-gpu-train launch`` therefore: starts the launcher with SIGUSR1 and SIGUSR2 ignored (a training process that
handles them installs its own handler, ``faults/preemption.py``; one that does not ignores them instead of dying),
forwards SIGTERM, SIGUSR1 and SIGUSR2 to the training processes themselves (the pids they registered in the
progress folder, else the launcher's children), and ends with ``PREEMPTED_EXIT_CODE`` when they stopped for it. Each
forwarded signal is also noted in the progress folder first: a training process that does not listen yet (it ignores
the warning signals until it does) takes the request when it begins to listen, so an early warning is not lost.
No torch here.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from .rank_report import worker_pids, write_stop_request

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
IGNORED_BY_THE_LAUNCHER = (signal.SIGUSR1, signal.SIGUSR2)


def ignore_warning_signals() -> None:
    """``preexec_fn`` of the launcher process: SIGUSR1/SIGUSR2 ignored there (inherited across exec)."""
    for signum in IGNORED_BY_THE_LAUNCHER:
        signal.signal(signum, signal.SIG_IGN)


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc; empty where there is none)."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            parent = int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state": the parent pid
            if parent == pid:
                found.append(int(entry.name))
    return found


class SignalForwarder:
    """While a launch runs: each stop signal this process receives goes to the training processes."""

    def __init__(self, launcher_pid: int, progress: Path):
        self.launcher_pid = launcher_pid
        self.progress = progress
        self.received: list[int] = []
        self._previous: dict = {}

    def __enter__(self) -> SignalForwarder:
        for signum in FORWARDED:
            with contextlib.suppress(ValueError):  # not the main thread: nothing to forward from here
                self._previous[signum] = signal.signal(signum, self._forward)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def targets(self) -> list[int]:
        """The training processes: those that registered (they handle the signal), else the launcher's children."""
        return worker_pids(self.progress) or children_of(self.launcher_pid)

    def _forward(self, signum, frame) -> None:
        self.received.append(signum)
        # noted first: a training process that does not listen yet (importing, loading its model) ignores SIGUSR1 and
        # SIGUSR2, and finds the request when it begins to (faults/preemption.py); SLURM sends its warning once
        write_stop_request(self.progress, signum)
        targets = self.targets()
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
        with contextlib.suppress(OSError):
            os.write(2, f"hf-gpu-train launch: {signal.Signals(signum).name} forwarded to the training processes "
                        f"({', '.join(map(str, targets)) or 'none yet'})\n".encode())
        if not targets and signum == signal.SIGTERM:
            # nothing has started training yet: stop the launcher the way the signal would have
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.launcher_pid, signum)

