"""Checkpoints written in the background, in anyone's Trainer: training goes on while the files reach the disk.

The Trainer's ``_save_checkpoint`` stops training for as long as it writes (model, optimizer, scheduler, RNG): users
space their saves out and lose the work between them. Here, while ``_save_checkpoint`` runs, the tensor files it
writes (``torch.save``, safetensors' ``save_file``: every name a loaded module holds for them) are *staged* instead: each
tensor copied to host memory (pinned, from a GPU) at the step boundary, the state exactly as a synchronous save would
have written it. A background thread then writes the staged files and ``fsync``s them (the tensor files only: the
marker, ``trainer_state.json`` and the small files are written as the Trainer writes them). Everything else the save
does (``trainer_state.json``, the tokenizer, the config, collectives of FSDP and DeepSpeed) happens as before, at once.

The completion marker (``checkpoint_marker.py``) is written only once every rank's background write finished: each
writer thread, its files written, takes one vote with the other ranks' writers (on a gloo group of their own: never
the training's), and the main process's writer then writes the marker, and only then does the Trainer's rotation
(``save_total_limit``) delete older checkpoints. A process that dies during a background write leaves a folder without
a marker, which the next run sets aside, resuming from the newest complete one: the work a failure can lose is the
interval and the write (a synchronous save: the interval). The callbacks hear of the save (``on_save``) at the first
step boundary where every rank has seen it complete (a vote of the training threads, as every rank must act alike). At most one write is in flight: a save that comes while the previous one
still writes waits for it (said once, with the time the write takes, to space saves out). ``train()`` returns only
once the last write is complete and marked (the final save and a stop signal's save are waited for), and the
Trainer's ``_load_best_model`` waits first too.

``torch.distributed.checkpoint`` writes (FSDP's SHARDED_STATE_DICT model and optimizer, through accelerate) become DCP's
own ``async_save``: DCP copies the rank's shards to host memory at once, then plans and writes them on a thread and a
gloo group of its own; the writer thread waits for that before the vote. What is not moved to the background: a file
object rather than a path, a DCP save given its own process group, and saves outside ``train()``. The host memory
the staging takes (the size of the checkpoint's tensors, on each writing rank) is in the memory plan.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..collectives.cpu_votes import lowest_and_highest

log = logging.getLogger("hf_gpu_train.checkpoints")

BACKGROUND_ENV = "HF_GPU_TRAIN_BACKGROUND_SAVES"  # 1 / 0: background saves on / off in anyone's Trainer (unset: on a GPU)
WRITING, DONE, FAILED = 0, 1, 2


def background_saves_wanted(asked: bool | str | None, on_gpu: bool) -> bool:
    """``asked``: true / false, or None / "auto": ``HF_GPU_TRAIN_BACKGROUND_SAVES`` (1 / 0) where set, else on where
    the training runs on a GPU. There the writer takes a CPU core the training leaves idle (the GIL is released while
    the files are written: the training thread's longest wait measured 2.8 ms during a 100 MB ``torch.save``). A run on
    the CPU trains on every core: measured here (2 cores, benchmarks/resilience.py) the writer cost more steps/s than
    the synchronous save (0.83x against 0.92x of a run that never saves) though it blocked a tenth as long."""
    if isinstance(asked, bool):
        return asked
    if isinstance(asked, str) and asked != "auto":
        return asked.strip().lower() in ("1", "true", "yes", "on")
    environ = os.environ.get(BACKGROUND_ENV)
    if environ is not None and environ.strip():
        return environ.strip().lower() not in ("0", "false", "no", "off")
    return on_gpu


# ---------------------------------------------------------------------------------------------------------- staging

class StagingBuffers:
    """Host buffers reused from one save to the next: a save copies into the buffers the previous one wrote from (its
    write is done before the next save stages: one in flight), so after the first save staging is a memory copy, with
    no allocation, page faults or pinning (``cudaHostAlloc`` of a checkpoint's size takes seconds). They hold host
    memory the size of a checkpoint's tensors for the run's length: the memory plan counts it."""

    def __init__(self):
        self.free: dict[tuple, list] = {}
        self.lent: list[tuple[tuple, object]] = []
        self.dcp: dict[int, tuple[tuple, object]] = {}  # index of a checkpoint's DCP save -> (its layout, its stager)

    def dcp_stager(self, index: int, state_dict):
        """The stager of a checkpoint's ``index``-th DCP save (FSDP's model, then its optimizer): its host copy of the
        shards made at the first save and copied into after, as long as the state's layout is the same. DCP's own
        staging builds that copy afresh at every save (a deep copy of every DTensor: 0.39 s of a 0.50 s save for
        MiniLM's shards here, against 0.04 s for the copy itself)."""
        layout = _layout(state_dict)
        held = self.dcp.get(index)
        if held is None or held[0] != layout:
            held = self.dcp[index] = (layout, _reused_staging_class()())
        return held[1]

    def copy_of(self, tensor):
        import torch

        pinned = tensor.device.type != "cpu" and torch.cuda.is_available()
        key = (tuple(tensor.shape), tensor.dtype, pinned)
        pool = self.free.get(key)
        buffer = pool.pop() if pool else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        buffer.copy_(tensor, non_blocking=pinned)  # from a GPU: waited for once per save (``staged``)
        self.lent.append((key, buffer))
        return buffer

    def give_back(self) -> None:
        """The write that read the lent buffers is over: they are free for the next save."""
        for key, buffer in self.lent:
            self.free.setdefault(key, []).append(buffer)
        self.lent = []

    @property
    def bytes(self) -> int:
        held = [b for pool in self.free.values() for b in pool] + [b for _, b in self.lent]
        return (sum(b.numel() * b.element_size() for b in held)
                + sum(_tensor_bytes(stager.state_dict_cache) for _, stager in self.dcp.values()))


def _layout(value, path: str = "") -> tuple:
    """What a staged copy of ``value`` must match to be copied into: every tensor's place, kind, shape and dtype."""
    import torch

    if isinstance(value, torch.Tensor):
        return ((path, type(value).__name__, tuple(value.shape), value.dtype),)
    if isinstance(value, dict):
        return tuple(item for key in sorted(value, key=str) for item in _layout(value[key], f"{path}/{key}"))
    if isinstance(value, (list, tuple)):
        return tuple(item for i, v in enumerate(value) for item in _layout(v, f"{path}/{i}"))
    return ((path, type(value).__name__),)


@functools.cache
def _reused_staging_class():
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    class ReusedStaging(BlockingAsyncStager):
        """DCP's blocking stager with its cached host copy, pinned only where there is a GPU to copy from (DCP's pins
        always, which fails without one)."""

        def __init__(self):
            super().__init__(cache_staged_state_dict=True)

        def stage(self, state_dict):
            import torch

            if self.state_dict_cache is None:
                self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            return _copy_state_dict(state_dict, self.state_dict_cache, type_check=False)  # as DCP's own staging

    return ReusedStaging


def stage(value, memo: dict | None = None, buffers: StagingBuffers | None = None):
    """A copy of ``value`` whose tensors live in host memory and share nothing with the training's: what the file would
    hold if written now. Containers are rebuilt (their types and attributes kept: a state dict's ``_metadata``), tensors
    that share storage and layout share their copy (tied weights stay tied), anything else is deep-copied. ``buffers``:
    where the copies go (None: fresh memory)."""
    import torch

    memo = {} if memo is None else memo
    buffers = StagingBuffers() if buffers is None else buffers
    if isinstance(value, torch.Tensor):
        key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
               tuple(value.stride()), value.dtype)
        if key not in memo:
            copied = buffers.copy_of(value.detach())
            if isinstance(value, torch.nn.Parameter):
                copied = torch.nn.Parameter(copied, requires_grad=value.requires_grad)
            memo[key] = copied
        return memo[key]
    if isinstance(value, dict):
        rebuilt = copy.copy(value)
        for name in list(rebuilt.keys()):
            rebuilt[name] = stage(value[name], memo, buffers)
        return rebuilt
    if isinstance(value, list):
        return [stage(item, memo, buffers) for item in value]
    if isinstance(value, tuple):
        items = [stage(item, memo, buffers) for item in value]
        return type(value)._make(items) if hasattr(value, "_fields") else type(value)(items)
    try:
        return copy.deepcopy(value)
    except Exception:  # not copyable: written as it is (a plain value the training does not change)
        return value


@dataclass
class StagedFile:
    """One file a save asked for, its content staged: ``write`` puts it on the disk as the original call would have."""

    writer: Callable
    content: object
    path: str
    kwargs: dict
    size: int = 0

    def write(self) -> None:
        self.writer(self.content, self.path, **self.kwargs)
        with open(self.path, "rb") as handle:
            os.fsync(handle.fileno())


@dataclass
class DistributedCheckpointWrite:
    """One ``torch.distributed.checkpoint.save`` made asynchronous (``async_save``: the state copied to host memory at
    once, planned and written by DCP's own thread on a gloo group of its own); ``write`` waits for it."""

    future: object
    size: int = 0
    content: object = None  # nothing of ours to let go once written (the writer clears it after every file)

    def write(self) -> None:
        self.future.result()  # DCP's FileSystemWriter fsyncs its files (sync_files) before the future completes


_DCP_GROUPS: list = []


def _dcp_group(index: int):
    """The gloo group the ``index``-th DCP save of a checkpoint plans on (FSDP's model, then its optimizer): each
    ``async_save`` runs on a thread of its own, at the same time as the others of its checkpoint, so each gets its own
    group (one group shared by two threads would interleave their collectives differently on each rank: a hang), and
    none is the training's. Made at the first checkpoint, which every rank reaches together, in the same order."""
    import torch.distributed as dist

    while len(_DCP_GROUPS) <= index:
        _DCP_GROUPS.append(dist.new_group(backend="gloo"))
    return _DCP_GROUPS[index]


def _tensor_bytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", value)  # a DTensor: this rank's shard is what it writes
        return local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


_NAMES = ("save", "save_file", "safe_save_file", "safetensors_save_file")


@contextlib.contextmanager
def staged(into: list[StagedFile], buffers: StagingBuffers | None = None):
    """Inside, ``torch.save(obj, path)`` and safetensors' ``save_file(tensors, path)`` (under every name a loaded module
    holds them: transformers' ``safe_save_file``, PEFT's, accelerate's) stage their content into ``into`` instead of
    writing. A file object, or anything but a path, is written at once as before. ``torch.distributed.checkpoint``'s
    ``save`` (FSDP's sharded model and optimizer, through accelerate) becomes its ``async_save`` on a process group of
    several: its future joins ``into``."""
    import safetensors.torch
    import torch
    import torch.distributed.checkpoint as dcp

    originals = {id(torch.save): torch.save, id(safetensors.torch.save_file): safetensors.torch.save_file}
    device_copies = [False]
    dcp_saves = [0]

    def asynchronous(original):
        def async_instead(state_dict=None, *args, checkpoint_id=None, storage_writer=None, planner=None,
                          process_group=None, **kwargs):
            import torch.distributed as dist

            if args or kwargs or process_group is not None or not (dist.is_initialized() and dist.get_world_size() > 1):
                return original(state_dict, *args, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                                planner=planner, process_group=process_group, **kwargs)
            stager = None if buffers is None else buffers.dcp_stager(dcp_saves[0], state_dict)
            future = dcp.async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                                    planner=planner, process_group=_dcp_group(dcp_saves[0]), async_stager=stager)
            dcp_saves[0] += 1
            into.append(DistributedCheckpointWrite(future, _tensor_bytes(state_dict)))
            return None
        return async_instead

    def staging(original):
        def stage_instead(content, path, *args, **kwargs):
            if args or not isinstance(path, (str, os.PathLike)):
                return original(content, path, *args, **kwargs)
            memo: dict = {}
            copied = stage(content, memo, buffers)
            device_copies[0] |= any(key[0].type != "cpu" for key in memo)
            into.append(StagedFile(original, copied, os.fspath(path), kwargs, _tensor_bytes(copied)))
            return None
        return stage_instead

    replaced: list[tuple[object, str, object]] = []
    for module in list(sys.modules.values()):
        for name in _NAMES:
            found = getattr(module, name, None) if module is not None else None
            if found is not None and id(found) in originals and found is originals[id(found)]:
                replaced.append((module, name, found))
    dcp_save = dcp.save
    dcp_modules = [m for m in (dcp, sys.modules.get("torch.distributed.checkpoint.state_dict_saver")) if m is not None]
    try:
        for module, name, found in replaced:
            setattr(module, name, staging(found))
        for module in dcp_modules:
            module.save = asynchronous(dcp_save)
        yield into
    finally:
        for module, name, found in replaced:
            setattr(module, name, found)
        for module in dcp_modules:
            module.save = dcp_save
        if device_copies[0]:
            torch.cuda.synchronize()  # the pinned copies are complete before training changes the tensors


# ------------------------------------------------------------------------------------------------ the write in flight

@dataclass
class BackgroundWrite:
    """One checkpoint's staged files, written by a thread of their own, which then waits for every rank's write
    (``agree``: a vote on a process group of its own) and marks the checkpoint complete (``mark``: the marker on the
    main process, then the rotation of older checkpoints) at once, whatever the training threads are doing."""

    folder: Path
    step: int
    files: list[StagedFile]
    mark: Callable[[], None]
    agree: Callable[[int], tuple[int, int]] = lambda status: (status, status)
    started: float = field(default_factory=time.monotonic)
    blocked_seconds: float = 0.0  # the training time its staging took
    ended: float | None = None
    error: BaseException | None = None  # this rank's write, or its marker, failed
    every_rank_wrote: bool = False
    thread: threading.Thread | None = None
    state: object = None  # the TrainerState at the save (a copy): what the callbacks hear of it with
    announced: bool = False  # the Trainer called on_save for it (a direct _save_checkpoint call does not)

    def start(self) -> None:
        # a daemon: a process that dies with a write in flight leaves the folder unmarked (a resume sets it aside)
        # rather than hang in the vote of a rank that is gone; a process that ends normally waited for it (``drain``)
        self.thread = threading.Thread(target=self._write, name=f"hf_gpu_train-save-{self.step}", daemon=True)
        self.thread.start()

    def _write(self) -> None:
        try:
            for staged_file in self.files:
                staged_file.write()
                staged_file.content = None  # the host copy goes as soon as its file is on the disk
        except BaseException as error:  # noqa: BLE001 - said on the main thread, at the next step boundary
            self.error = error
            for left in self.files:  # DCP's threads still reading a host copy: done before it may be staged into again
                if isinstance(left, DistributedCheckpointWrite):
                    with contextlib.suppress(BaseException):
                        left.future.result(timeout=600)
        try:
            lowest, highest = self.agree(FAILED if self.error is not None else DONE)
            self.every_rank_wrote = lowest == highest == DONE
            if self.every_rank_wrote:
                self.mark()
        except BaseException as error:  # noqa: BLE001
            self.error = self.error or error
        finally:
            self.ended = time.monotonic()

    @property
    def status(self) -> int:
        if self.thread is not None and self.thread.is_alive():
            return WRITING
        return DONE if self.error is None and self.every_rank_wrote else FAILED

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)


class BackgroundSaves:
    """One Trainer's background writes: at most one in flight; the callbacks told (``on_save``) when every rank has
    seen its write complete.

    ``vote`` is every rank's agreement on the main thread (``lowest_and_highest`` of a status): every rank calls
    ``poll`` at each step boundary and ``drain`` before a save and at the end of ``train()``, alike, because every rank
    saved at the same step (the control flags are agreed: ``guard_saves``). ``write_vote`` makes the writers' own vote
    (None: one process), on a gloo group of its own (made at the first save, on every rank's main thread): a collective
    in a background thread never shares a group with the training's."""

    def __init__(self, vote: Callable[[int], tuple[int, int]], raise_failure: Callable[[BackgroundWrite], None],
                 write_vote: Callable[[], Callable[[int], tuple[int, int]]] | None = None):
        self.vote = vote
        self.raise_failure = raise_failure
        self.write_vote = write_vote
        self._writers_agree: Callable[[int], tuple[int, int]] | None = None
        self.in_flight: BackgroundWrite | None = None
        self.buffers = StagingBuffers()  # reused by every save (``staged(files, saves.buffers)``)
        self.blocked_seconds: list[float] = []  # training time each save took (staging included)
        self.write_seconds: list[float] = []  # the background write of each, start to end
        self.staged_bytes: list[int] = []  # each save's tensors, staged in host memory
        self.tell: Callable[[BackgroundWrite], None] = lambda write: None  # on_save, once a write is complete
        self.waited_seconds = 0.0  # training time spent waiting for a previous write (a save that came too soon)
        self._said_waiting = False

    def begin(self, write: BackgroundWrite, blocked_seconds: float) -> None:
        if self.write_vote is not None:
            if self._writers_agree is None:
                self._writers_agree = self.write_vote()  # a collective: every rank is here, saving the same step
            write.agree = self._writers_agree
        self.in_flight = write
        write.blocked_seconds = blocked_seconds
        self.blocked_seconds.append(blocked_seconds)
        self.staged_bytes.append(write.bytes)
        write.start()

    def poll(self) -> None:
        """At a step boundary: when every rank's write is done, finish it (marker, rotation); a failed write on any rank
        stops the run on every rank."""
        if self.in_flight is None:
            return
        lowest, highest = self.vote(self.in_flight.status)
        if highest == FAILED:
            self._fail()
        elif lowest == DONE:
            self._finish()

    def drain(self, why: str | None = None) -> None:
        """Wait for the write in flight, then finish it on every rank (``why``: a new save came while it wrote)."""
        write = self.in_flight
        if write is None:
            return
        began = time.monotonic()
        write.join()
        waited = time.monotonic() - began
        if why is not None:
            self.waited_seconds += waited
            if waited > 0.05 and not self._said_waiting:
                self._said_waiting = True
                log.warning("hf_gpu_train: %s while checkpoint-%d was still being written (%.1f s of writing; training "
                            "waited %.1f s for it): at most one checkpoint is written at a time. Save less often than "
                            "every %.0f s of training to never wait (said once)", why, write.step, write.seconds, waited,
                            write.seconds)
        lowest, highest = self.vote(write.status)
        if highest == FAILED:
            self._fail()  # raises
            return
        self._finish()

    def wait_here(self, timeout_s: float = 60.0) -> None:
        """This rank alone (an exception is ending ``train()``): the write gets ``timeout_s`` to finish (its vote waits
        for the other ranks', which may not come: then the folder stays unmarked and a resume sets it aside)."""
        if self.in_flight is not None:
            self.in_flight.join(timeout_s)
            if self.in_flight.status == WRITING:  # DCP may still read its host copies: the next save makes new ones
                self.buffers.dcp.clear()
            self.in_flight = None

    def _finish(self) -> None:
        write, self.in_flight = self.in_flight, None
        self.buffers.give_back()
        self.write_seconds.append(write.seconds)
        self.tell(write)

    def _fail(self) -> None:
        write, self.in_flight = self.in_flight, None
        self.buffers.give_back()
        self.raise_failure(write)


def last_write_seconds(trainer) -> float:
    """Seconds the newest finished background write took (0 without one): what a stop's save adds to its blocked time."""
    saves = getattr(trainer, "_hf_gpu_train_background_saves", None)
    return saves.write_seconds[-1] if saves is not None and saves.write_seconds else 0.0



def attach_to_trainer(trainer, saves: BackgroundSaves) -> None:
    """Wire ``saves`` into ``trainer``: every rank's vote on the write in flight at every step's start and end while
    one is (``BackgroundSaves.poll``), before any other callback's (one that ends the process at a step's end must find
    the checkpoint before it marked, when its write is done); the last write waited for at ``on_train_end``, before any
    other callback's ``on_train_end``; and ``on_save`` told to the callbacks once the checkpoint is complete, not when it
    was staged: a callback that reads ``checkpoint-{state.global_step}`` in ``on_save`` (MLflow's, W&B's, Neptune's,
    ClearML's artifact uploads; a user's copy to object storage) finds it whole. It gets the TrainerState as it was at
    the save (a copy: step, epoch, log history, best metric), and ``blocked_seconds`` (the training time the save
    took); a control flag it sets acts at the step boundary where it hears, not at the save's. Made on call: this module is
    imported before transformers is."""
    from transformers import TrainerCallback

    class BackgroundSavesAtStepBoundaries(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            saves.poll()

        def on_step_end(self, args, state, control, **kwargs):
            saves.poll()

        def on_train_end(self, args, state, control, **kwargs):
            saves.drain()  # every rank ends training alike

    handler = trainer.callback_handler
    handler.callbacks.insert(0, BackgroundSavesAtStepBoundaries())
    told_now = handler.on_save

    def some(callbacks: list, event: str, *args, **kwargs):
        """The handler's ``event`` for ``callbacks`` only, in their order."""
        everyone = handler.callbacks
        handler.callbacks = callbacks
        try:
            return event_call(event, *args, **kwargs)
        finally:
            handler.callbacks = everyone

    def event_call(event, *args, **kwargs):
        return told_now(*args) if event == "now" else handler.call_event("on_save", *args, **kwargs)

    def on_save_once_written(args, state, control):
        write = saves.in_flight
        if write is None or write.announced or write.step != state.global_step:
            return told_now(args, state, control)
        write.announced = True  # the save just staged: the callbacks about the files hear of it once it is written
        return some([c for c in handler.callbacks if hears_of_staged_saves(c)], "now", args, state, control)

    def tell(write: BackgroundWrite) -> None:
        if not write.announced:  # a direct _save_checkpoint call (transformers' JIT checkpoint): the Trainer told no one
            return
        as_saved = write.state if write.state is not None else copy.copy(trainer.state)
        later = [c for c in handler.callbacks if not hears_of_staged_saves(c)]
        trainer.control = some(later, "on_save", trainer.args, as_saved, trainer.control, blocked_seconds=write.blocked_seconds)

    handler.on_save = on_save_once_written
    saves.tell = tell


def hears_of_staged_saves(callback) -> bool:
    """A callback whose ``on_save`` is about the training's control or clock, not the checkpoint's files, sets the class
    attribute ``hears_of_staged_saves = True`` and hears of a background save at once (preemption's stop after the
    save, telemetry's pause, the checkpoint interval's measurement); every other callback once the files are written."""
    return bool(getattr(callback, "hears_of_staged_saves", False))


def writers_vote() -> Callable[[int], tuple[int, int]]:
    """The background writers' vote (lowest, highest of a status over every rank) on a gloo group made now, on every
    rank's main thread at the same point (a collective)."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    return lambda status: lowest_and_highest(status, group)
