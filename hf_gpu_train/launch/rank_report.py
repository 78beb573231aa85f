"""When a launch of several processes fails: which rank went first, how, and the last step every rank finished.

The launcher (torchelastic, under `accelerate launch`) already stops the other ranks when one dies, and prints a
"Root Cause" block with that rank and its exit code; it cannot say how far each rank got. `hf-gpu-train launch`
gives every process a folder (``PROGRESS_DIR_ENV``) where the watchdog writes the step each rank finished, and ends a
failed launch with one line: ``rank 1 died (SIGKILL, exit -9); last step finished: rank 0 12, rank 1 12``.
No torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from pathlib import Path

PROGRESS_DIR_ENV = "HF_GPU_TRAIN_PROGRESS_DIR"
HANG_EXIT_CODE = 3  # faults/watchdog.py: a hang was detected and every rank's stacks were written
PREEMPTED_EXIT_CODE = 75  # faults/preemption.py: stopped for a scheduler's signal after a complete checkpoint (EX_TEMPFAIL)
PREEMPTED_MARKER_ENV = "HF_GPU_TRAIN_PREEMPTED_MARKER"  # a file hf-gpu-train launch leaves when it ends with 75 (the sbatch's)


PROGRESS_RECORD_BYTES = 256  # one record, padded: each write replaces the whole of the last one
_progress_files: dict[str, int] = {}  # path -> a descriptor kept open: one pwrite per step, not a file made and renamed


def write_progress(rank: int, step: int, phase: str, environ=os.environ) -> None:
    """This rank's last finished step, for the launcher's report (nothing when not launched by hf-gpu-train; a full
    or gone /tmp must not stop training: the report is a courtesy). Written at every step, so it costs one ``pwrite``
    of a padded record into a file kept open (~10 us; a new file renamed into place cost ~0.4 ms a step). The launcher
    reads it after the process ended, when no write can be half done."""
    folder = environ.get(PROGRESS_DIR_ENV)
    if not folder:
        return
    path = str(Path(folder) / f"rank-{rank}.json")
    record = json.dumps({"step": step, "phase": phase, "pid": os.getpid()}).encode()
    try:
        fd = _progress_files.get(path)
        if fd is None:
            fd = _progress_files[path] = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(fd, record.ljust(PROGRESS_RECORD_BYTES), 0)  # JSON ends at its last brace: the padding is whitespace
    except OSError:
        _progress_files.pop(path, None)  # a courtesy to the launcher: try a new descriptor next time


def _write_json(name: str, record: dict, environ=os.environ) -> None:
    folder = environ.get(PROGRESS_DIR_ENV)
    if not folder:
        return
    path = Path(folder) / name
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        pass  # a courtesy to the launcher, as the progress


def write_rank_gpu(rank: int, record: dict, environ=os.environ) -> None:
    """This rank's GPU ({"gpu": NVML index, "bus_id": ...}), so the launcher can name a dead rank's GPU's health
    events with the rank (``faults/gpu_health.py``)."""
    _write_json(f"gpu-{rank}.json", record, environ)


def read_rank_gpus(folder: Path) -> dict[int, int]:
    """{rank: NVML index of its GPU} from what the ranks left with ``write_rank_gpu``."""
    found = {}
    for path in Path(folder).glob("gpu-*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            found[int(path.stem.split("-")[1])] = int(json.loads(path.read_text())["gpu"])
    return found


STRAGGLER = "straggler.json"
_NAMED_NOW: list[dict | None] = [None]


def note_straggler(named: dict | None, write: bool, environ=os.environ) -> None:
    """The straggler telemetry names now (``callbacks/arrivals.py``: its line), or none: kept in this process for the
    hang summary (``faults/watchdog.py``), and with ``write`` (rank 0) left for the launcher's failure line too: a run
    that failed after one rank fell behind says which."""
    _NAMED_NOW[0] = named
    if write:
        _write_json(STRAGGLER, {"named": named}, environ)


def named_straggler() -> dict | None:
    """The straggler named now in this process (every rank names the same one), or None."""
    return _NAMED_NOW[0]


def read_straggler(folder: Path) -> str | None:
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        named = json.loads((Path(folder) / STRAGGLER).read_text()).get("named")
        return f"{named['line']} (named at step {named['since_step']})" if isinstance(named, dict) else None
    return None


RESUMES = "resumes.json"  # the training processes resume from their newest complete checkpoint: a restart helps


def write_resumes(environ=os.environ) -> None:
    """Say to the launcher that this run resumes from its newest complete checkpoint when started again
    (``launch/restarts.py`` restarts only such a run: another would train from step 0 over its own checkpoints)."""
    _write_json(RESUMES, {"pid": os.getpid()}, environ)


def read_resumes(folder: Path) -> bool:
    return (Path(folder) / RESUMES).is_file()


def write_worker_pid(rank: int, environ=os.environ) -> None:
    """This training process, for the launcher to forward a stop signal to (``launch/signals.py``)."""
    _write_json(f"worker-{rank}.json", {"pid": os.getpid()}, environ)


def worker_pids(folder: Path) -> list[int]:
    found = []
    for path in Path(folder).glob("worker-*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            found.append(int(json.loads(path.read_text())["pid"]))
    return found


STOP_REQUEST = "stop-request.json"  # launch/signals.py writes it before it forwards a stop signal


def write_stop_request(folder: Path, signum: int) -> None:
    """The launcher's note of a stop signal it forwards, for a training process that did not listen yet (it starts
    with SIGUSR1 and SIGUSR2 ignored: ``signals.ignore_warning_signals``) to find once it does. Numbered: a process
    takes each request once."""
    path = Path(folder) / STOP_REQUEST
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        number = int(json.loads(path.read_text())["number"]) + 1 if path.is_file() else 1
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"signal": int(signum), "number": number}))
        os.replace(tmp, path)


def read_stop_request(environ=os.environ) -> tuple[int, int] | None:
    """(signal, number) of the newest stop request the launcher noted, or None."""
    folder = environ.get(PROGRESS_DIR_ENV)
    if not folder:
        return None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        record = json.loads((Path(folder) / STOP_REQUEST).read_text())
        return int(record["signal"]), int(record["number"])
    return None


def write_preempted(rank: int, step: int, environ=os.environ) -> None:
    """This rank stopped for a stop signal at ``step`` (-1: at once, on a second signal or the grace running out)."""
    _write_json(f"preempted-{rank}.json", {"step": step}, environ)


def read_preempted(folder: Path) -> dict[int, int]:
    found = {}
    for path in Path(folder).glob("preempted-*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            found[int(path.stem.split("-")[1])] = int(json.loads(path.read_text())["step"])
    return found


def write_hang_report(report: dict, environ=os.environ) -> None:
    """The watchdog's verdict (rank 0), for the launcher: which ranks are not where the others are, and where the
    stacks are. torchelastic's "first failure" is only the rank that exited first, rank 0 in a hang."""
    folder = environ.get(PROGRESS_DIR_ENV)
    if folder:
        with contextlib.suppress(OSError):
            (Path(folder) / "hang.json").write_text(json.dumps(report))


def read_hang_report(folder: Path) -> dict | None:
    try:
        return json.loads((Path(folder) / "hang.json").read_text())
    except (OSError, ValueError):
        return None


def read_progress(folder: Path) -> dict[int, dict]:
    found = {}
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            found[int(path.stem.split("-")[1])] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return found


def root_cause(launcher_stderr: str) -> tuple[int, int] | None:
    """(global rank, exit code) of torchelastic's "Root Cause (first observed failure)"; None when it printed none."""
    at = launcher_stderr.rfind("Root Cause")
    if at < 0:
        return None
    match = re.search(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", launcher_stderr[at:], re.S)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"died ({signal.Signals(-code).name}, exit {code})"
        except ValueError:
            return f"died (signal {-code})"
    if code == HANG_EXIT_CODE:
        return "ended the run on a hang (exit 3; every rank's stacks are in output_dir/hang-*)"
    return f"failed (exit {code})"


def failure_line(cause: tuple[int, int] | None, progress: dict[int, dict], hang: dict | None = None,
                 health: list[str] | None = None, straggler: str | None = None) -> str | None:
    """The one line a failed launch ends with; None when there is nothing to say. ``health``: what the node's GPUs
    reported while the run went (``faults/gpu_health.named_events``), each naming the rank on that GPU. ``straggler``:
    the straggler telemetry had named when it failed (``read_straggler``)."""
    if cause is None and not progress and hang is None and not health:
        return None
    steps = ", ".join(f"rank {r} {p.get('step')}" for r, p in sorted(progress.items())) or "not recorded"
    if hang is not None:
        lagging = hang.get("behind") or []
        first = (f"hang: rank(s) {', '.join(map(str, lagging))} not where the others are" if lagging else
                 "hang: every rank at the same place") + f" (every rank's stacks in {hang.get('folder')}; exit 3)"
    else:
        first = f"rank {cause[0]} {_how(cause[1])}" if cause else "a rank failed"
    if straggler:
        first += f"; before it, telemetry had named a {straggler}"
    if health:
        return (f"{first}; last step finished: {steps}. GPU health changed during the run: " + "; ".join(health)
                + ". Do what each fix says, then run the same command again (it resumes from the last complete checkpoint, "
                "if one was saved)")
    return (f"{first}; last step finished: {steps}. Run the same command again to resume from the last complete "
            "checkpoint, if one was saved")
