"""The search order, early stopping and the time budget of `hf-gpu-train tune`. Pure: no torch, no clock of its own.

``Search.steps()`` is a generator: it yields the next candidate and receives its ``TrialResult``. The order puts
the axis that matters most first and stops each axis as soon as it stops paying:

1. micro-batch, from the planner's (or the recipe's) value: up by roughly doubling while throughput improves by
   more than the noise and the candidate fits; down (to below the smallest micro-batch known to fail, which the
   OOM recovery reports) when the start does not fit; then, where nothing smaller was measured, about half the best
   once (followed down while faster). Micro-batches the planner rules out are never tried.
2. gradient checkpointing, only where memory stopped the climb: it is slower per sample and pays only when it
   lets a larger micro-batch fit (or, when the run has it on, off at the best micro-batch).
3. dataloader workers, only when the best candidate waited for data (``DATA_WAIT_GATE_PCT``): with no data wait,
   other worker counts cannot be faster.
4. the other valid precision, packing (causal LM), then torch.compile last: it costs its compile time first.

``run_search`` drives it against a trial runner (or, in the CLI, only against saved measurements), spends the
budget, and says which candidates were not run and why.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, replace

from .candidates import POLICIES_BY_COST, Candidate, CandidateSpace
from .results import OOM, SKIPPED, TrialResult, faster

DATA_WAIT_GATE_PCT = 5.0
# Default budget: the issue asks for about a minute. On a GPU one trial (a new Trainer, 2 warm-up steps and about
# 2 s of measured steps) takes 3-5 s for models up to ~1B parameters, so a minute holds the micro-batch ladder
# (typically 4-6 rungs) and the cheaper axes; model and data loading come on top, once.
DEFAULT_BUDGET_S = 60.0
COMPILE_GUESS_S = 45.0  # compile time assumed for a first torch.compile trial (a BERT-base-sized model on a GPU)
WARMUP_STEPS = 2  # step 1: the longest batch (length grouping puts it first), allocator growth, kernel selection
MEASURE_TARGET_S = 2.0  # trials measure about this long (the first trial's step time decides the count)
MEASURE_STEPS_RANGE = (3, 30)

Steps = Generator[Candidate, TrialResult, "TrialResult | None"]


class Search:
    def __init__(self, space: CandidateSpace):
        self.space = space
        self.results: dict[str, TrialResult] = {}
        self.notes: list[str] = []  # why each axis stopped where it did

    # -- helpers ---------------------------------------------------------------------------------
    def fastest(self) -> TrialResult | None:
        fitting = [r for r in self.results.values() if r.fits and r.throughput(self.space.metric)]
        return max(fitting, key=lambda r: r.throughput(self.space.metric)) if fitting else None

    def _try(self, candidate: Candidate) -> Steps:
        """Yield the candidate unless it was measured already; None when the planner rules it out."""
        if candidate.key in self.results:
            return self.results[candidate.key]
        if not self.space.planner_allows(candidate):
            return None
        result = yield candidate
        self.results[candidate.key] = result
        return result

    def _faster(self, a: TrialResult, b: TrialResult | None) -> bool:
        return b is None or faster(a, b, self.space.metric)

    # -- the order -------------------------------------------------------------------------------
    def steps(self) -> Generator[Candidate, TrialResult, None]:
        base = self.space.base
        best_micro, failing, why = yield from self._ladder(base, base.micro_batch)
        self.notes.append(f"micro-batch: {why}")
        if best_micro is not None:
            best_micro = yield from self._below(base, best_micro)
        yield from self._checkpointing(failing, best_micro)
        top = self.fastest()
        if top is None:
            self.notes.append("no candidate fits: the other axes were not tried")
            return
        yield from self._workers()
        for axis, options, field in (("precision", self.space.precisions, "precision"), ("packing", self.space.packing, "packing"),
                                     ("compile", self.space.compile, "torch_compile")):
            top = self.fastest()
            for option in options[1:]:
                result = yield from self._try(replace(top.candidate, **{field: option}))
                self.notes.append(f"{axis} {option}: " + (self._outcome(result, top)))

    def _outcome(self, result: TrialResult | None, against: TrialResult | None) -> str:
        if result is None:
            return "ruled out by the planner"
        if not result.fits:
            return result.verdict()
        return "faster" if self._faster(result, against) else "not faster"

    def _ladder(self, template: Candidate, start: int, bar: TrialResult | None = None, floor: int = 0) -> Steps:
        """(largest micro-batch that fits and gains, smallest known not to fit, why it stopped); only micro-batches
        above ``floor`` (checkpointing at a micro-batch that fits without it is only slower)."""
        rungs = [m for m in self.space.micro_batches if m > floor]
        pruned = [m for m in rungs if not self.space.planner_allows(template.with_micro_batch(m))]
        limit = min(pruned) if pruned else None
        usable = [m for m in rungs if limit is None or m < limit]
        if not usable:
            if limit is None:
                return None, None, f"no micro-batch above {floor} keeps the effective batch"
            return None, limit, f"the planner says not even micro-batch {limit} fits"
        micro = max([m for m in usable if m <= start] or usable[:1])
        result = yield from self._try(template.with_micro_batch(micro))
        if result.status == SKIPPED:
            return None, None, f"stopped: {result.reason}"
        if not result.fits:
            return (yield from self._descend(template, usable, _failing(result, micro)))
        if bar is not None and not self._faster(result, bar):
            return micro, None, f"micro-batch {micro} fits ({template.describe()}) but is not faster than {bar.candidate.describe()}"
        return (yield from self._climb(template, usable, limit, micro, result))

    def _descend(self, template: Candidate, usable: list[int], failing: int) -> Steps:
        while True:
            lower = [m for m in usable if m < failing]
            if not lower:
                return None, failing, f"not even micro-batch {usable[0]} fits"
            micro = max(lower)
            result = yield from self._try(template.with_micro_batch(micro))
            if result.status == SKIPPED:
                return None, failing, f"stopped: {result.reason}"
            if result.fits:
                return micro, failing, f"micro-batch {failing} does not fit; {micro} is the largest that does"
            failing = min(failing, _failing(result, micro))

    def _climb(self, template: Candidate, usable: list[int], limit: int | None, micro: int, result: TrialResult) -> Steps:
        while True:
            up = [m for m in usable if m >= 2 * micro] or [m for m in usable if m > micro]
            if not up:
                if limit is not None:
                    return micro, limit, f"the planner says micro-batch {limit} does not fit; {micro} is the largest it allows"
                return micro, None, f"micro-batch {micro} is the largest that keeps the effective batch ({self.space.effective_batch})"
            nxt = min(up)
            trial = yield from self._try(template.with_micro_batch(nxt))
            if trial.status == SKIPPED:
                return micro, None, f"stopped at micro-batch {micro}: {trial.reason}"
            if not trial.fits:
                failing = _failing(trial, nxt)
                between = [m for m in usable if micro < m < failing]
                if between:  # one bisection step between the last fit and the first failure
                    mid = yield from self._try(template.with_micro_batch(max(between)))
                    if mid.fits and self._faster(mid, result):
                        micro = max(between)
                    elif not mid.fits and mid.status != SKIPPED:
                        failing = max(between)
                return micro, failing, f"micro-batch {failing} does not fit"
            if not self._faster(trial, result):
                return micro, None, f"micro-batch {nxt} is not faster than {micro} by more than the noise: stopped climbing"
            micro, result = nxt, trial

    def _below(self, template: Candidate, micro: int) -> Steps:
        """Where the ladder never rose above its start, or the descent stopped at the first fit, the micro-batch about
        half as large is unmeasured: tried once, and followed down while it is faster (a micro-batch at the edge of
        memory can be slower than a smaller one: allocator retries, fragmentation)."""
        best = self.results[template.with_micro_batch(micro).key]
        while True:
            lower = [m for m in self.space.micro_batches if m <= micro // 2]
            if not lower or template.with_micro_batch(max(lower)).key in self.results:
                return micro
            below = max(lower)
            trial = yield from self._try(template.with_micro_batch(below))
            if trial is None or not trial.fits or not self._faster(trial, best):
                self.notes.append(f"micro-batch {below}: {self._outcome(trial, best)} than {micro}: {micro} stays")
                return micro
            self.notes.append(f"micro-batch {below} is faster than {micro}: going down")
            micro, best = below, trial

    def _checkpointing(self, failing: int | None, best_micro: int | None) -> Generator[Candidate, TrialResult, None]:
        """Checkpointing pays only by letting a larger micro-batch fit: where memory stopped the ladder, each policy's
        ladder above the best micro-batch, the cheapest recomputation first (selective, one layer in two, lean selective,
        every layer), until one no longer meets memory; then activation offloading, where memory still stops it. A run
        that has checkpointing on tries it off, and the cheaper policies, at the best candidate, then offloading where
        memory stopped its ladder."""
        space, base = self.space, self.space.base
        open_axis = len(space.checkpointing) > 1 or len(space.policies) > 1
        top = self.fastest()
        start = top.candidate if top is not None else base
        if base.gradient_checkpointing and open_axis:  # the run has it on: off (and a cheaper policy) is faster wherever it fits
            rank = POLICIES_BY_COST.index(base.checkpoint_layers) if base.checkpoint_layers in POLICIES_BY_COST else 0
            cheaper = [p for p in POLICIES_BY_COST[:rank] if p in space.policies]
            for policy in (["off"] if len(space.checkpointing) > 1 else []) + cheaper:
                result = yield from self._try(start.with_checkpointing(policy))
                self.notes.append(f"checkpointing {policy}: {self._outcome(result, top)}")
            yield from self._offload(failing, None)
            return
        if not open_axis or base.gradient_checkpointing:
            yield from self._offload(failing, None)
            return
        if failing is None:
            self.notes.append(f"checkpointing: not tried: memory did not stop the micro-batch ladder (best {best_micro}), "
                              "and checkpointing only pays by letting a larger micro-batch fit")
            yield from self._offload(None, None)
            return
        # each costlier policy starts where the cheaper one ran out of memory: at a micro-batch the cheaper one fits it
        # is only slower; a policy whose larger micro-batch fits but does not pay (or whose ladder met no memory limit)
        # ends the walk: a costlier one would recompute more for the same or a smaller gain
        still_failing, best_policy = failing, None
        for policy in [p for p in POLICIES_BY_COST if p in space.policies] if len(space.checkpointing) > 1 else []:
            top = self.fastest()
            template = (top.candidate if top is not None else base).with_checkpointing(policy)
            floor = max(best_micro or 0, top.candidate.micro_batch if top is not None else 0)
            micro, failed_at, why = yield from self._ladder(template, still_failing, bar=top, floor=floor)
            self.notes.append(f"checkpointing {policy}: {why}")
            if micro is not None:
                best_policy = policy
            if failed_at is None:
                still_failing = None
                self.notes.append("checkpointing: memory no longer stops the ladder: the costlier policies are not tried")
                break
            still_failing = failed_at
        yield from self._offload(still_failing, best_policy)

    def _offload(self, failing: int | None, policy: str | None) -> Generator[Candidate, TrialResult, None]:
        """Activation offloading (CUDA): a run that has it on tries it off at the best candidate; else it is tried only
        where memory still stops the ladder, with the best checkpointing found (``policy``; None: the best candidate's
        own, as when the checkpointing axis is closed: tune never turns on what the user fixed)."""
        space = self.space
        if len(space.offload) < 2:
            return
        top = self.fastest()
        start = top.candidate if top is not None else space.base
        if space.base.offload_activations:
            result = yield from self._try(replace(start, offload_activations=False))
            self.notes.append(f"offload off: {self._outcome(result, top)}")
            return
        if failing is None:
            self.notes.append("offload: not tried: memory did not stop the ladder")
            return
        template = replace(start.with_checkpointing(policy) if policy else start, offload_activations=True)
        _, _, why = yield from self._ladder(template, failing, bar=top, floor=top.candidate.micro_batch if top else 0)
        self.notes.append(f"offload: {why}")

    def _workers(self) -> Generator[Candidate, TrialResult, None]:
        if len(self.space.workers) < 2:
            return
        top = self.fastest()
        wait = top.data_wait_pct
        if wait is not None and wait < DATA_WAIT_GATE_PCT:
            self.notes.append(f"workers: not tried: the best candidate waited {wait:.1f}% of its time for data (under "
                              f"{DATA_WAIT_GATE_PCT:.0f}%): other worker counts cannot make it faster")
            return
        waited = "" if wait is None else f" (data wait {wait:.1f}% with {top.candidate.dataloader_num_workers})"
        for workers in self.space.workers:
            if workers != top.candidate.dataloader_num_workers:
                result = yield from self._try(replace(top.candidate, dataloader_num_workers=workers))
                self.notes.append(f"workers {workers}: {self._outcome(result, top)}{waited}")


def _failing(result: TrialResult, micro: int) -> int:
    """The smallest micro-batch this trial showed not to fit: what the OOM recovery failed at, else its own."""
    if result.status == OOM and result.failed_micro_batch:
        return min(micro, result.failed_micro_batch)
    return micro


@dataclass(frozen=True)
class SearchOutcome:
    results: tuple[TrialResult, ...]  # in the order the search asked for them, skipped ones included
    notes: tuple[str, ...]
    spent_s: float
    needs_trials: bool  # run without a trial runner: the search wants a candidate that has no saved measurement


def measure_steps_for(step_time_s: float) -> int:
    """About ``MEASURE_TARGET_S`` of measured steps at this step time (decided once, in the first trial)."""
    low, high = MEASURE_STEPS_RANGE
    return max(low, min(high, math.ceil(MEASURE_TARGET_S / max(step_time_s, 1e-6))))


def measure_steps_of(results: list[TrialResult]) -> int | None:
    """The step count of the search so far (the first trial that ran decided it); None before."""
    return next((r.measured_steps for r in results if r.ran and r.measured_steps), None)


def predicted_seconds(candidate: Candidate, results: list[TrialResult]) -> float | None:
    """What the next trial will cost: the median trial so far, plus the compile time for a first compile."""
    ran = [r.seconds for r in results if r.ran and r.seconds]
    if not ran:
        return None
    guess = statistics.median(ran)
    if candidate.torch_compile:
        compiled = [r.compile_s for r in results if r.candidate.torch_compile and r.compile_s is not None]
        guess += compiled[-1] if compiled else COMPILE_GUESS_S
    return guess


RunTrial = Callable[[Candidate, int, "int | None"], TrialResult]  # (candidate, warm-up steps, measured steps) -> result


def run_search(space: CandidateSpace, budget_s: float, run_trial: RunTrial | None, cached: Mapping[str, TrialResult] | None = None,
               warmup_steps: int = WARMUP_STEPS, measure_steps: int | None = None) -> SearchOutcome:
    """Drive the search. A saved measurement (``cached``, by candidate key) is used as it is and its recorded
    seconds count against the budget, so a rerun with the same budget asks for exactly what the first run asked
    and needs no trial. A trial predicted to overrun the budget is not run (skipped, with the numbers)."""
    cached = cached or {}
    search = Search(space)
    steps = search.steps()
    results: list[TrialResult] = []
    spent = 0.0
    candidate = next(steps, None)
    while candidate is not None:
        if candidate.key in cached:  # measured before, judged against this search's memory budget
            result = replace(cached[candidate.key].cached(), memory_budget_bytes=space.memory_budget_bytes)
        else:
            predicted = predicted_seconds(candidate, results)
            if predicted is not None and spent + predicted > budget_s:
                result = TrialResult(candidate, SKIPPED, f"budget: {max(0.0, budget_s - spent):.0f} s of {budget_s:.0f} s left, "
                                     f"this trial needs about {predicted:.0f} s (raise --budget-s)")
            elif run_trial is None:
                return SearchOutcome(tuple(results), tuple(search.notes), spent, needs_trials=True)
            else:
                result = run_trial(candidate, warmup_steps, measure_steps or measure_steps_of(results))
        if result.memory_budget_bytes != space.memory_budget_bytes:
            result = replace(result, memory_budget_bytes=space.memory_budget_bytes)
        spent += result.seconds
        results.append(result)
        try:
            candidate = steps.send(result)
        except StopIteration:
            candidate = None
    return SearchOutcome(tuple(results), tuple(search.notes), spent, needs_trials=False)


def grid(space: CandidateSpace) -> list[Candidate]:
    """Every candidate of the space the planner allows, micro-batch fastest-varying: the exhaustive search that
    ``benchmarks/tune_vs_grid.py`` sets against ``Search``."""
    found = []
    policies = [policy for ckpt in space.checkpointing for policy in (space.policies if ckpt else ("off",))]
    for precision in space.precisions:
        for compiled in space.compile:
            for packing in space.packing:
                for policy in policies:
                    for offloaded in space.offload:
                        for workers in space.workers:
                            for micro in space.micro_batches:
                                c = replace(space.base.with_micro_batch(micro).with_checkpointing(policy),
                                            offload_activations=offloaded, dataloader_num_workers=workers, precision=precision,
                                            torch_compile=compiled, packing=packing)
                                if space.planner_allows(c):
                                    found.append(c)
    return found


def run_fixed(candidates: list[Candidate], run_trial: RunTrial, warmup_steps: int = WARMUP_STEPS,
              measure_steps: int | None = None) -> SearchOutcome:
    """Run these candidates as they are, in order (tune's strategy round: one candidate in a launch of another
    strategy's config), each measuring ``measure_steps`` (None: the first decides)."""
    results: list[TrialResult] = []
    for candidate in candidates:
        results.append(run_trial(candidate, warmup_steps, measure_steps or measure_steps_of(results)))
    return SearchOutcome(tuple(results), (), sum(r.seconds for r in results), False)


def run_grid(space: CandidateSpace, run_trial: RunTrial, warmup_steps: int = WARMUP_STEPS,
             measure_steps: int | None = None) -> SearchOutcome:
    """Run every candidate (no budget, no early stop), with the same trial runner and step count as the search."""
    outcome = run_fixed(grid(space), run_trial, warmup_steps, measure_steps)
    return replace(outcome, notes=(f"grid: {len(outcome.results)} candidate(s)",))
