"""Which rank is slow, and in which phase of its step: by its arrival at the step's collectives.

A rank's step time cannot say it. DDP's gradient all-reduce ends every rank's backward together, so 200 ms more in one
rank's backward makes every rank's step 200 ms longer, and every rank's backward looks alike from outside. What differs
is where each rank spent the step. The late rank arrives at a collective after the others are already there: it waits
there least, and its own work before that collective is longer. So each rank splits every optimizer step into its own
work, by phase, and its waiting:

- ``data``: fetching and collating its batches (``Trainer.get_batch_samples`` up to the item count);
- ``forward``: its training forwards (model hooks);
- ``backward``: from a forward's end to the last gradient this rank computed: the loss and the backward's compute
  (DDP's bucket all-reduces run beside it and do not hold it);
- ``optimizer``: ``optimizer.step()`` (between ``on_pre_optimizer_step`` and ``on_optimizer_step``);
- ``host``: the rest of the step: callbacks, the scheduler, ``zero_grad``, Python between micro-steps;
- ``wait``: the item-count gather, DDP's buffer broadcast before the forward, the gradient all-reduce's end (from the
  last gradient to the optimizer step, gradient clipping in it) and our own collectives (``collectives/wait_clock.py``).

Every ``check_steps`` optimizer steps (a step number every rank shares, so every rank enters the exchange, whatever it
measured) the ranks exchange their per-phase sums over those steps in one small all-reduce on the CPU. A rank whose own
time in one phase exceeds the other ranks' (their median; forward and backward per unit of work, so longer rows are not
a sick rank) by at least ``min_excess_fraction`` of the median step, while the others waited longer by at least half
that excess (they were there before it), is flagged; flagged in ``NAMED_AFTER`` exchanges in a row, it is named: rank,
phase, milliseconds per step. The first step of a run is left out (the ranks' start-up skew).

On CUDA a host clock around a forward times kernel launches, not the work, so the step's start, forward, backward, the
gradient wait and the optimizer are timed with CUDA events (read at the exchange, after a device synchronisation);
data loading and our collectives are host work, timed by the host clock. A rank whose device waits for another's
blocks its host later (at a loss check, the allocator), inside what would be its host phase: on CUDA the host phase is
not named. Not run on two GPUs yet (scripts/gpu_checks/stragglers_on_gpu.py is the check).

Where it does not hold (said in docs/telemetry-and-report.md): under FSDP and DeepSpeed ZeRO-3 the forward and the
backward hold the parameter all-gathers and reduce-scatters, so a rank that waits for a late rank inside them shows a
longer forward or backward; such a finding fails the arrival check (the rank that waited did not wait less) unless the
late rank also waited less at a collective we see, and nothing is named. Under DeepSpeed the optimizer step runs inside
the backward call and counts as waiting. The backward's end is the gradient of the parameter that came last in the
first backward: a step in which it gets none (a branch not taken) puts that backward in the host phase. With one
process there is no other rank: no clock is installed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..collectives.cpu_votes import cpu_group, several_processes
from ..collectives.wait_clock import waited_so_far, waiting
from ..instance_methods import replace_methods
from ..launch.rank_report import note_straggler

log = logging.getLogger("hf_gpu_train.telemetry")

PHASES = ("data", "forward", "backward", "optimizer", "host")
PER_UNIT = ("forward", "backward")  # compared per unit of work: a rank that drew longer rows is slower, not sick
COLUMNS = (*PHASES, "wait", "period", "units", "steps")
CHECK_STEPS = 5
MIN_EXCESS_FRACTION = 0.15  # of the median step: smaller differences are noise on a shared host
MIN_EXCESS_S = 0.001
ARRIVAL_SHARE = 0.5  # the others must have waited longer by at least this share of the excess
NAMED_AFTER = 3  # exchanges in a row that flag the same rank and phase before it is named (one or two: batch noise)
TIMELINE_WINDOWS = 200  # exchanges kept for the report's picture (the ones that named a rank are always kept)


def _nothing_to_restore() -> None:
    pass


@dataclass(frozen=True)
class Mark:
    """A point in the step: the host clock, this process's waiting in our collectives so far, and a CUDA event where
    the device's time is what counts."""

    t: float
    waited: float
    event: Any = None


def own_seconds(start: Mark, end: Mark) -> float:
    """Own work between two marks: the device's time between their events, or the host's less our collectives' waits."""
    if start.event is not None and end.event is not None:
        return start.event.elapsed_time(end.event) / 1000.0
    return max(0.0, (end.t - start.t) - (end.waited - start.waited))


@dataclass
class _Step:
    """One optimizer step's marks, in the order the loop reaches them."""

    begin: Mark | None = None
    fetch: tuple[Mark, Mark | None, Mark | None] | None = None  # (fetch began, item count began, item count ended)
    forwards: list[tuple[Mark, Mark | None]] = field(default_factory=list)
    units: float = 0.0  # the work its forwards were given: input positions (rows x padded length), else rows
    last_grads: list[Mark | None] = field(default_factory=list)  # per forward: this rank's last gradient after it
    optimizer: tuple[Mark | None, Mark | None] = (None, None)


class PhaseClock:
    """This rank's own time per phase and its waiting, summed over the optimizer steps since the last ``take``."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.sums = dict.fromkeys(COLUMNS, 0.0)
        self._pending: list[tuple[_Step, Mark, Mark]] = []  # (step, the gap's start, the step's end), resolved at take
        self._step = _Step()
        self._gap_start: Mark | None = None
        self._handles: list[Any] = []
        self._restore: Callable[[], None] = _nothing_to_restore  # the Trainer's methods back as they were
        self._grad_params: list[torch.nn.Parameter] = []
        self._grads_seen: list[int] = []  # the parameters' order of gradients in the first backward
        self._learning = True
        # the first step holds what each rank did before the loop (a tracker's start on rank 0 alone, a first compile):
        # the others wait for it there, which is no straggler's phase; it is left out
        self._skip = 1

    # -- marks -------------------------------------------------------------------------------
    def mark(self, on_device: bool = False) -> Mark:
        event = None
        if on_device and self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return Mark(time.perf_counter(), waited_so_far(), event)

    # -- installing --------------------------------------------------------------------------
    def install(self, trainer, model: torch.nn.Module) -> PhaseClock:
        self._handles = [model.register_forward_pre_hook(self._forward_begins, with_kwargs=True),
                         model.register_forward_hook(self._forward_ends)]
        self._grad_params = [p for p in model.parameters() if p.requires_grad]
        for index, param in enumerate(self._grad_params):
            self._handles.append(param.register_post_accumulate_grad_hook(self._grad_hook(index)))
        if trainer is not None:
            self._restore = replace_methods(trainer, {"get_batch_samples": self._timed_fetch,
                                                      "_get_num_items_in_batch": self._timed_item_count})
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._restore()
        self._restore = _nothing_to_restore

    def _timed_fetch(self, original):
        def fetch(*args, **kwargs):
            began = self.mark()
            self._step.fetch = (began, None, None)
            return original(*args, **kwargs)

        return fetch

    def _timed_item_count(self, original):
        def count(*args, **kwargs):
            began = self.mark()
            try:
                return original(*args, **kwargs)
            finally:
                if self._step.fetch is not None:
                    self._step.fetch = (self._step.fetch[0], began, self.mark())

        return count

    def _forward_begins(self, module, args, kwargs) -> None:
        if module.training and torch.is_grad_enabled():
            self._step.forwards.append((self.mark(on_device=True), None))
            self._step.last_grads.append(None)
            self._step.units += work_units(args, kwargs)

    def _forward_ends(self, module, args, output) -> None:
        forwards = self._step.forwards
        if module.training and forwards and forwards[-1][1] is None:
            forwards[-1] = (forwards[-1][0], self.mark(on_device=True))

    def _grad_hook(self, index: int):
        def noted(param) -> None:
            if self._learning:
                self._grads_seen.append(index)
            if self._step.last_grads:
                self._step.last_grads[-1] = self.mark(on_device=True)

        return noted

    def _keep_only_the_last_gradient_hook(self) -> None:
        """After the first backward: the parameter whose gradient came last marks the backward's end; the other hooks go
        (one hook per backward, not one per parameter, and on CUDA one event)."""
        self._learning = False
        if not self._grads_seen:
            return
        last = self._grads_seen[-1]
        keep = 2 + last  # the two forward hooks come first
        for position, handle in enumerate(self._handles):
            if position >= 2 and position != keep:
                handle.remove()
        self._handles = [self._handles[0], self._handles[1], self._handles[keep]]
        self._grads_seen = []

    # -- loop events -------------------------------------------------------------------------
    def step_begin(self) -> None:
        self._step.begin = self.mark(on_device=True)  # on CUDA: where the device waits for the item count's gather
        if self._gap_start is None:  # the first step, or the first after a pause: its gap starts at its fetch
            self._gap_start = self._step.fetch[0] if self._step.fetch else self._step.begin

    def optimizer_begins(self) -> None:
        self._step.optimizer = (self.mark(on_device=True), None)

    def optimizer_ends(self) -> None:
        self._step.optimizer = (self._step.optimizer[0], self.mark(on_device=True))

    def step_end(self) -> None:
        end = self.mark()
        if self._skip:
            self._skip -= 1
        elif self._gap_start is not None and self._step.begin is not None:
            self._pending.append((self._step, self._gap_start, end))
        if self._learning:
            self._keep_only_the_last_gradient_hook()
        self._step = _Step()
        self._gap_start = end

    def pause_end(self) -> None:
        """A log, evaluation or save just finished: the time since the last step is not the loop's (as ``LoopTimer``)."""
        self._gap_start = self.mark()

    def take(self) -> dict[str, float]:
        """This rank's sums over the steps since the last take (on CUDA after the last recorded event finished)."""
        pending, self._pending = self._pending, []
        try:
            if self.cuda and pending:
                torch.cuda.synchronize()  # every stream: a gradient hook's event is on its backward op's stream
            for step, gap_start, end in pending:
                for key, value in split_step(step, gap_start, end).items():
                    self.sums[key] += value
                self.sums["steps"] += 1
        except Exception as error:  # this rank then brings no steps to the exchange, which it still enters
            log.warning("telemetry: this rank's step phases could not be read (%s: %s); its exchange holds no steps",
                        type(error).__name__, error)
            self.sums["steps"] = 0.0
        out, self.sums = self.sums, dict.fromkeys(COLUMNS, 0.0)
        return out


def work_units(args: tuple, kwargs: dict) -> float:
    """The work a forward is given, known on the host without a sync: ``input_ids``' (or ``inputs_embeds``') rows x
    length, padding included (the compute is spent on it), else the first tensor's rows (images)."""
    for name in ("input_ids", "inputs_embeds"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return float(value.shape[0] * value.shape[1])
    first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() >= 1), None)
    return float(first.shape[0]) if first is not None else 0.0


def split_step(step: _Step, gap_start: Mark, end: Mark) -> dict[str, float]:
    """One step's seconds by phase, ``wait`` and ``period`` (the step with the gap before it)."""
    period = max(0.0, end.t - gap_start.t)
    out = dict.fromkeys((*PHASES, "wait"), 0.0)
    out["period"] = period
    out["units"] = step.units
    out["wait"] = end.waited - gap_start.waited  # our own collectives, wherever they fell in the step
    if step.fetch is not None:
        began, count_began, count_ended = step.fetch
        if count_began is not None and count_ended is not None:
            out["data"] += own_seconds(began, count_began)
            out["wait"] += own_seconds(count_began, count_ended)
        elif step.begin is not None:
            out["data"] += own_seconds(began, step.begin)
    elif step.begin is not None:  # a loop without get_batch_samples: it loads in the gap before the step
        out["data"] += own_seconds(gap_start, step.begin)
    if step.forwards and step.begin is not None:  # the item count's end to the first forward: DDP's broadcast
        first = step.forwards[0][0]
        if step.begin.event is not None and first.event is not None:  # CUDA: the device's wait for the gather, the broadcast
            out["wait"] += own_seconds(step.begin, first)
        else:
            before = step.fetch[2] if step.fetch is not None and step.fetch[2] is not None else step.begin
            out["wait"] += own_seconds(Mark(before.t, before.waited), Mark(first.t, first.waited))
    for (began, ended), last_grad in zip(step.forwards, step.last_grads):
        if ended is None:
            continue
        out["forward"] += own_seconds(began, ended)
        if last_grad is not None:
            out["backward"] += own_seconds(ended, last_grad)
    opt_begin, opt_end = step.optimizer
    last_grad = next((g for g in reversed(step.last_grads) if g is not None), None)
    if opt_begin is not None and last_grad is not None:
        out["wait"] += own_seconds(last_grad, opt_begin)
    if opt_begin is not None and opt_end is not None:
        out["optimizer"] += own_seconds(opt_begin, opt_end)
    out["host"] = max(0.0, period - sum(out[p] for p in (*PHASES[:4], "wait")))
    return out


@dataclass(frozen=True)
class Finding:
    """A rank slower than the others in one phase, over one exchange's steps."""

    rank: int
    phase: str
    excess_s: float  # its own time in that phase per step, less the other ranks' median
    step_s: float  # the median rank's step (with the gap before it)
    waited_less_s: float  # how much less it waited per step than the other ranks' median

    def to_dict(self) -> dict:
        return {"rank": self.rank, "phase": self.phase, "excess_ms": round(1000 * self.excess_s, 2),
                "step_ms": round(1000 * self.step_s, 2), "waited_less_ms": round(1000 * self.waited_less_s, 2)}

    def line(self) -> str:
        return (f"straggler: rank {self.rank} is slow in {self.phase} (+{1000 * self.excess_s:.0f} ms per step over "
                f"the other ranks, of a {1000 * self.step_s:.0f} ms step; they wait for it: "
                f"{1000 * self.waited_less_s:.0f} ms more per step)")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def per_step(row: dict[str, float]) -> dict[str, float]:
    steps = max(1.0, row.get("steps", 0.0))
    return {key: row.get(key, 0.0) / steps for key in COLUMNS if key != "steps"}


def attribute(rows: list[dict[str, float]], min_excess_fraction: float = MIN_EXCESS_FRACTION,
              min_excess_s: float = MIN_EXCESS_S, phases: tuple[str, ...] = PHASES) -> Finding | None:
    """The slowest (rank, phase) of one exchange, or None. ``rows[r]``: rank r's sums (``COLUMNS``). Pure: every rank
    computes it from the same exchanged numbers, so every rank finds the same. Forward and backward are compared per
    unit of work where every rank counted some: the others' median rate times this rank's work is what it should
    have taken (dynamic padding gives one rank longer rows now and then: it is slower, and the others wait, but it is
    not sick)."""
    if len(rows) < 2 or any(row.get("steps", 0.0) < 1 for row in rows):
        return None
    means = [per_step(row) for row in rows]
    step_s = _median([m["period"] for m in means])
    threshold = max(min_excess_fraction * step_s, min_excess_s)
    best: Finding | None = None
    for rank, mine in enumerate(means):
        others = [m for r, m in enumerate(means) if r != rank]
        waited_less = _median([m["wait"] for m in others]) - mine["wait"]
        for phase in phases:
            if phase in PER_UNIT and all(m["units"] > 0 for m in means):
                excess = mine[phase] - _median([m[phase] / m["units"] for m in others]) * mine["units"]
            else:
                excess = mine[phase] - _median([m[phase] for m in others])
            if excess >= threshold and waited_less >= ARRIVAL_SHARE * excess and (best is None or excess > best.excess_s):
                best = Finding(rank, phase, excess, step_s, waited_less)
    return best


class StragglerWatch:
    """The exchange every ``check_steps`` steps, the verdict, and its history for the report's timeline."""

    def __init__(self, clock: PhaseClock, check_steps: int = CHECK_STEPS):
        self.clock = clock
        self.check_steps = max(1, int(check_steps))
        self.named: dict | None = None  # the straggler named now: Finding.to_dict() with "since_step" and "line"
        self.windows: list[dict] = []  # one per exchange: {"step", "ranks": [per-step seconds by column], "finding"}
        self._flagged: tuple[int, str] | None = None
        self._run = 0  # exchanges in a row that flagged it
        self._clear_run = 0

    def on_step_end(self, global_step: int, is_world_zero: bool) -> dict | None:
        """Every rank calls this at every step end; the exchange runs on the steps every rank counts alike. Returns the
        straggler named at this step when it is new (for the caller to say once), else None."""
        self.clock.step_end()
        if global_step % self.check_steps:
            return None
        rows = exchange(self.clock.take())
        if rows is None:
            return None
        # on CUDA a rank that waits for another on the device blocks its host later (a loss check, the allocator):
        # that shows as its host time, so host is not a phase named there (data, forward, backward, optimizer are)
        finding = attribute(rows, phases=PHASES[:4] if self.clock.cuda else PHASES)
        self._keep(global_step, rows, finding)
        return self._judge(global_step, finding, is_world_zero)

    def _keep(self, step: int, rows: list[dict], finding: Finding | None) -> None:
        self.windows.append({"step": step, "ranks": [{k: round(v, 6) for k, v in per_step(row).items()} for row in rows],
                             "finding": finding.to_dict() if finding else None})
        if len(self.windows) > TIMELINE_WINDOWS:  # keep the ones that found a rank, and the latest
            found = [w for w in self.windows[:-TIMELINE_WINDOWS // 2] if w["finding"]][-TIMELINE_WINDOWS // 2:]
            self.windows = found + self.windows[-TIMELINE_WINDOWS // 2:]

    def _judge(self, step: int, finding: Finding | None, is_world_zero: bool) -> dict | None:
        before = self.named
        said = self._decide(step, finding, is_world_zero)
        if self.named is not before or said is not None:  # for the hang summary and hf-gpu-train launch's failure line
            note_straggler(self.named, write=is_world_zero)
        return said

    def _decide(self, step: int, finding: Finding | None, is_world_zero: bool) -> dict | None:
        key = (finding.rank, finding.phase) if finding else None
        self._run = self._run + 1 if key is not None and key == self._flagged else 1
        self._flagged = key
        if key is not None and self._run >= NAMED_AFTER:
            self._clear_run = 0
            if self.named is None or (self.named["rank"], self.named["phase"]) != key:
                self.named = {**finding.to_dict(), "since_step": step, "line": finding.line()}
                if is_world_zero:
                    log.warning("telemetry step %d: %s", step, finding.line())
                return self.named
            self.named.update({**finding.to_dict(), "line": finding.line()})  # the latest figures
            return None
        if self.named is not None and (key is None or key != (self.named["rank"], self.named["phase"])):
            self._clear_run += 1
            if self._clear_run >= 2:
                if is_world_zero:
                    log.info("telemetry step %d: rank %d is no longer slow in %s", step, self.named["rank"],
                             self.named["phase"])
                self.named = None
                self._clear_run = 0
        return None


def exchange(mine: dict[str, float]) -> list[dict[str, float]] | None:
    """Every rank's sums, in rank order, through one all-reduce on the CPU (None with one process)."""
    dist = several_processes()
    if dist is None:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    table = torch.zeros(world, len(COLUMNS), dtype=torch.float64)
    table[rank] = torch.tensor([mine[c] for c in COLUMNS], dtype=torch.float64)
    with waiting():
        dist.all_reduce(table, group=cpu_group(dist))
    return [dict(zip(COLUMNS, row)) for row in table.tolist()]
