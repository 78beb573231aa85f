"""TelemetryCallback: GPU, host and loop metrics through the Trainer's own logging, a verdict at
every log step, a per-rank summary with stragglers, and the run report at the end.

One line in anyone's Trainer::

    from hf_gpu_train.callbacks import attach_telemetry
    attach_telemetry(trainer)          # before trainer.train()

The hooks are thin: they take timestamps and call the pure functions in ``window.py``,
``flops.py`` and ``verdicts.py``; the ``logs`` dict given to callbacks is never mutated (metrics go
out through the public ``Trainer.log``, so TensorBoard and every ``report_to`` sink get them).

What it costs per step: two timestamps, and forward hooks that add the batch's token count into a
device tensor and time the forward (CUDA events on a GPU). With one process no host sync happens between log steps; at
a log step one device sync reads the counters and one collective gathers the ranks' summaries (tokens included). With
several, the straggler attribution (``arrivals.py``) adds a hook per phase boundary, and every 5 steps a device sync
(on CUDA) and one small all-reduce on the CPU.

That gather is entered on a decision every rank shares, never on a flag one rank set alone: a callback may set
``control.should_log`` from what only its rank sees. So the control flags are agreed across the ranks after each step
(``collectives/control_flags.agree_on_control``, the same the watchdog uses, installed once: one all-reduce of 5
integers on the CPU per step, left out where every callback sets its flags alike on every rank), and telemetry emits
right after that agreement, where the Trainer then logs its loss: every rank gathers, or none. A Trainer without that step (not transformers') gathers only at the logging schedule's
steps, which every rank computes alike, and logs any other step's figures from its own rank.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ..collectives.control_flags import agree_on_control
from ..collectives.cpu_votes import several_processes
from ..collectives.lone_rank import check_not_alone
from ..hardware.backend import NvmlBackend, NvmlFailure
from ..hardware.nvml import PynvmlBackend
from ..hardware.peaks import peak_flops
from ..oom import OOMRecoveryState
from .arrivals import PhaseClock, StragglerWatch
from .devices import cuda_memory, model_device, nvml_handles_for, torch_bus_id
from .flops import (
    ModelFlops,
    attention_flops_per_token_per_position,
    counted_flops_per_sample,
    dense_flops_per_token,
    window_throughput,
)
from .forward_timer import ForwardTimer
from .ranks import gather_ranks
from .sampler import DeviceSampler
from .tokens import TokenCounter
from .trackers import publish_texts, tracker_metrics, tracker_texts
from .verdicts import Verdict, WindowStats, judge, speed_trend
from .window import LoopTimer, deciding_window, is_full_window, summarize_samples

log = logging.getLogger("hf_gpu_train.telemetry")


class TelemetryCallback(TrainerCallback):
    hears_of_staged_saves = True  # its on_save ends the save's pause in the step clock (faults/background_save.py)

    def __init__(
        self,
        trainer=None,
        interval_s: float = 1.0,
        backend: NvmlBackend | None = None,
        gpu_indices: list[int] | None = None,
        memory_probe: Callable[[torch.device], dict[str, float] | None] | None = None,
        write_report: bool = True,
        suggested_micro_batch: int | None = None,
        straggler_check_steps: int = 5,
        health_every_s: float = 10.0,
    ):
        self.trainer = trainer
        self.interval_s = interval_s
        self.backend = backend
        self.gpu_indices = gpu_indices
        self.memory_probe = memory_probe or cuda_memory
        self.write_report = write_report
        self.suggested_micro_batch = suggested_micro_batch
        self.straggler_check_steps = straggler_check_steps
        self.health_every_s = health_every_s  # how often the sampler reads the GPUs' health (hardware/health.py)
        self.stragglers: StragglerWatch | None = None  # several processes only: which rank the others wait for (arrivals.py)
        self.sampler: DeviceSampler | None = None
        self.timer = LoopTimer()
        self.tokens = TokenCounter()
        self.forward_timer: ForwardTimer | None = None
        self.records: list[dict] = []
        self.history: list[WindowStats] = []  # full windows only
        self.gpu_names: dict[int, str] = {}
        self.device = torch.device("cpu")
        self.flops = ModelFlops()
        self.peak: float | None = None
        self.last_verdict: Verdict | None = None  # the latest window's; at train end, the run's (last full window)
        self.emitting = False  # True while telemetry metrics go through Trainer.log (the console printer checks it)
        self._original_collate: tuple | None = None
        self._interval_steps = 1
        self._last_retries = 0.0
        self._last_kind: str | None = None
        self._closed = False
        self._agreed_on: Any = None  # the Trainer whose agreed flags call _after_agreement
        self._emitted_step = -1  # the last step emitted (a Trainer logs a step once)
        self._gathered_step = -1  # the last step whose window every rank gathered

    # -- lifecycle ---------------------------------------------------------------------------
    def _open_backend(self) -> NvmlBackend | None:
        backend = self.backend
        if backend is None:

            backend = PynvmlBackend()
        try:
            backend.init()
            return backend
        except NvmlFailure as failure:
            log.info("telemetry: NVML unavailable (%s): host and loop metrics only", failure)
            return None

    def agree_flags_of(self, trainer) -> None:
        """Emit once ``trainer``'s control flags are agreed across the ranks (installing the agreement if nothing did)."""

        if self._agreed_on is not trainer and agree_on_control(trainer, self._after_agreement):
            self._agreed_on = trainer

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if self.trainer is None:  # Trainer(callbacks=[TelemetryCallback()]): the route most callbacks take
            self._attach_late(find_calling_trainer())
        self.agree_flags_of(self.trainer)
        self._closed = False
        self._emitted_step = self._gathered_step = state.global_step  # a resume's first window starts here
        self.device = model_device(model)
        backend = self._open_backend()
        handles: dict[int, Any] = {}
        if backend is not None:
            if self.gpu_indices is not None:
                handles = {i: backend.handle(i) for i in self.gpu_indices}
            elif self.device.type == "cuda":
                handles = nvml_handles_for(backend, [torch_bus_id(self.device)])
            for index, handle in handles.items():
                try:
                    self.gpu_names[index] = backend.name(handle)
                except NvmlFailure:
                    self.gpu_names[index] = f"GPU {index}"
        self.sampler = DeviceSampler(backend, handles, self.interval_s, health_every_s=self.health_every_s).start()
        if model is not None:
            self.tokens.install(model)
            self.forward_timer = ForwardTimer(self.device).install(model)
            if several_processes() is not None and self.straggler_check_steps:  # 0: no straggler attribution
                clock = PhaseClock(self.device).install(self.trainer, model)
                self.stragglers = StragglerWatch(clock, self.straggler_check_steps)
        self._estimate_flops(args, model, train_dataloader)
        self._install_batch_timer(train_dataloader)
        steps_strategy = logging_strategy(args) == "steps"
        self._interval_steps = int(state.logging_steps or 1) if steps_strategy else 1
        return control

    def close(self) -> None:
        """Stop the thread and remove hooks; safe to call twice (train end, or after an exception)."""
        if self.sampler is not None:
            self.sampler.stop()
        self.tokens.remove()
        if self.forward_timer is not None:
            self.forward_timer.remove()
        if self.stragglers is not None:
            self.stragglers.clock.remove()
        if self._original_collate is not None:
            loader, collate = self._original_collate
            loader.collate_fn = collate
            self._original_collate = None
        self._closed = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.sampler is not None and not self._closed:
            # steps since the last gather: alike on every rank (each gather was every rank's), so all gather or none
            gather = state.global_step > self._gathered_step
            if gather or self.timer.step_times:  # steps since the last log
                self._emit(args, state, final=True, gather=gather)
        self.close()
        deciding = deciding_window(self.records, self._interval_steps)
        if deciding is not None:
            self.last_verdict = Verdict.from_dict(deciding["verdict"])
            if state.is_world_process_zero:
                log.info("telemetry: run verdict (window ending at step %d): %s", deciding["step"], self.last_verdict.line())
        if self.write_report and state.is_world_process_zero:
            from ..report.writer import write_run_report  # lazy: looked up when called, so a replacement (a test's) is seen

            try:
                write_run_report(args.output_dir, self.samples(), self.records, self.last_verdict, self.gpu_names,
                                 log_history=list(state.log_history),  # the loss curves of a Trainer that never saves its state
                                 arrivals=self.stragglers.windows if self.stragglers is not None else None)
            except Exception as error:  # the report must never cost the run its final evaluation and model
                log.warning("telemetry: the run report was not written (%s: %s); the training is not affected",
                            type(error).__name__, error)
        return control

    def samples(self) -> list:
        return list(self.sampler.samples) if self.sampler else []

    # -- loop events -------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        self.timer.step_begin(time.perf_counter())
        if self.stragglers is not None:
            self.stragglers.clock.step_begin()
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.stragglers is not None:
            self.stragglers.clock.optimizer_begins()
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.stragglers is not None:
            self.stragglers.clock.optimizer_ends()
        return control

    def on_substep_end(self, args, state, control, **kwargs):
        self.tokens.micro_step_done()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.timer.step_end(time.perf_counter())
        self.tokens.micro_step_done()
        if self.stragglers is not None:  # at the step numbers every rank counts alike: every rank exchanges, or none
            self.stragglers.on_step_end(state.global_step, state.is_world_process_zero)
        if self._agreed_on is None and control.should_log and not self.emitting:  # flags not agreed: see the docstring
            self._emit_at_log(args, state, control, gather=on_logging_schedule(args, state))
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if self._agreed_on is None and control.should_log and not self.emitting and logging_strategy(args) == "epoch":
            self._emit_at_log(args, state, control, gather=True)  # every rank's epoch ends at the same step
        return control

    def _after_agreement(self) -> None:
        """The flags are every rank's here (``collectives.control_flags.agree_on_control``), and the Trainer logs next."""
        trainer = self.trainer
        control, state = trainer.control, trainer.state
        if (control.should_log and not self.emitting and self.sampler is not None and not self._closed
                and state.global_step > self._emitted_step):
            self._emit_at_log(trainer.args, state, control, gather=True)

    def _emit_at_log(self, args, state, control, gather: bool) -> None:
        self._emit(args, state, gather=gather)
        # Trainer.log -> CallbackHandler.on_log clears should_log; the Trainer still has its own loss to log
        control.should_log = True
        self._pause_ends()

    def _pause_ends(self) -> None:
        """A log, evaluation or save just finished: not the loop's time (data wait, a phase of the step)."""
        self.timer.pause_end(time.perf_counter())
        if self.stragglers is not None:
            self.stragglers.clock.pause_end()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._pause_ends()
        return control

    def on_evaluate(self, args, state, control, **kwargs):
        self._pause_ends()
        return control

    def on_save(self, args, state, control, **kwargs):
        self._pause_ends()
        return control

    def _attach_late(self, trainer) -> None:
        """Given to the Trainer as ``callbacks=[TelemetryCallback()]``: a callback is never handed its Trainer, and
        without it telemetry could not log to the ``report_to`` sinks, guard the loss or print compactly. It finds the
        Trainer whose ``train`` called it, before the first step, and does what ``attach_telemetry`` does."""
        if trainer is None:
            raise TelemetryNotAttached("TelemetryCallback() was given to a Trainer without the Trainer, and the Trainer that "
                                       "started training could not be found: build the Trainer first, then call "
                                       "hf_gpu_train.attach_telemetry(trainer) (or pass TelemetryCallback(trainer=trainer))")
        from ..oom.loss_scaling import guard_loss_scaling
        from .console import use_compact_console

        self.trainer = trainer
        guard_loss_scaling(trainer)
        use_compact_console(trainer, self, in_place=True)
        log.info("telemetry: attached to %s through callbacks=[...]: metrics go to its report_to sinks, the loss guard and "
                 "the compact console are on", type(trainer).__name__)

    # -- measurements ------------------------------------------------------------------------
    def _install_batch_timer(self, train_dataloader) -> None:
        """Timestamp the end of collation, so data wait is this rank's loading and not the item-count
        all-reduce that follows it in the Trainer (which waits for the slowest rank). Only loading in the
        main process can be timed this way; with worker processes the whole gap counts."""
        # accelerate's DataLoaderShard wraps the torch DataLoader that really collates
        train_dataloader = getattr(train_dataloader, "base_dataloader", train_dataloader)
        collate = getattr(train_dataloader, "collate_fn", None)
        if collate is None or getattr(train_dataloader, "num_workers", 0) or getattr(collate, "_hf_gpu_train_timed", False):
            return
        timer = self.timer

        def timed_collate(batch):
            out = collate(batch)
            timer.batch_ready(time.perf_counter())
            return out

        timed_collate._hf_gpu_train_timed = True
        self._original_collate = (train_dataloader, collate)
        train_dataloader.collate_fn = timed_collate

    def _estimate_flops(self, args, model, train_dataloader) -> None:
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        name = next(iter(self.gpu_names.values()), None)
        # MFU only for a real GPU of known peak: None on the CPU and for unknown GPUs
        self.peak = peak_flops(name, precision, tf32=bool(args.tf32)) if self.device.type == "cuda" else None
        if model is None:
            return
        config = getattr(model, "config", None)
        layers, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
        if layers and hidden:  # a transformer: per token, the attention term added per window from the mean length
            dense, through = dense_flops_per_token(model)
            self.flops = ModelFlops(per_token=dense, attention_per_token_per_position=attention_flops_per_token_per_position(
                layers, hidden, through))
            return
        dataset = getattr(train_dataloader, "dataset", None)
        collate = getattr(train_dataloader, "collate_fn", None)
        if dataset is None or collate is None or not hasattr(dataset, "__len__") or len(dataset) == 0:
            return
        with torch.random.fork_rng(devices=[]):  # a sample drawn here must not shift the run's randomness
            example = collate([dataset[0]])
        self.flops = ModelFlops(per_sample=counted_flops_per_sample(model, example))

    def _emit(self, args, state, final: bool = False, gather: bool = True) -> None:
        """``gather``: every rank emits here too (a decision they share), so the ranks' summaries are gathered; else
        this rank's figures alone, its tokens left for the next gathered window (the run's token count stays exact)."""
        samples = self.sampler.drain() if self.sampler else []
        metrics, reasons = summarize_samples(samples)
        loop = self.timer.take()
        metrics.update(loop)
        steps = loop.get("loop/steps", 0.0)
        if self.forward_timer is not None:
            forward_s, forwards = self.forward_timer.take()
            if forwards and steps:
                metrics["loop/forward_time_s"] = forward_s / steps  # per optimizer step, all its micro-steps
        metrics.update(self.memory_probe(self.device) or {})
        micro = self._oom_micro_batch()
        if micro is not None:
            metrics["loop/micro_batch"] = float(micro)
        if gather:
            ranks, tokens = gather_ranks(metrics, sorted(self.gpu_names), self.tokens.take(), state.is_world_process_zero)
            self._gathered_step = state.global_step
        else:
            ranks, tokens = [], 0
        self._emitted_step = state.global_step
        world = max(1, args.world_size)
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
        metrics.update(window_throughput(loop.get("loop/train_time_s"), steps, per_step, tokens, self.flops, self.peak, world))
        generated = self.tokens.take_generated()
        if generated and loop.get("loop/train_time_s"):
            metrics["loop/generated_tokens"] = float(generated)  # this process's decode steps, apart from training tokens
            metrics["loop/generated_tokens_per_s"] = generated / loop["loop/train_time_s"]
        stats = self._window_stats(metrics, reasons, args)
        full = is_full_window(metrics, self._interval_steps)
        if full:
            self.history.append(stats)
        verdict = judge(stats)
        trend = speed_trend(self.history) if full else None
        if trend:
            verdict = verdict.with_note(trend)
        named = dict(self.stragglers.named) if self.stragglers is not None and self.stragglers.named else None
        if named:  # the rank the others wait for, and in which phase (arrivals.py): numbers for the trackers too
            verdict = verdict.with_note(named["line"])
            metrics.update({"straggler/rank": float(named["rank"]), "straggler/excess_ms": named["excess_ms"]})
        for r in ranks:
            if "rank" in r:
                r["straggler"] = named is not None and r["rank"] == named["rank"]
        self.last_verdict = verdict
        record = {"step": state.global_step, "time": time.time(), "final": final, "full": full, "metrics": metrics,
                  "throttle_reasons": {str(k): sorted(v) for k, v in reasons.items()}, "verdict": verdict.to_dict()}
        if ranks:
            record["ranks"] = ranks
        if named:
            record["straggler"] = named
        health = self.sampler.take_health_events() if self.sampler else []
        if health:  # said once, by the rank whose GPU it is (each rank samples its own GPUs)
            rank = args.process_index
            record["gpu_health"] = [{**event, "rank": rank} for event in health]
            metrics["gpu_health/events"] = float(len(health))
            for event in health:
                log.warning("telemetry step %d: rank %d: %s. Fix: %s", state.global_step, rank, event["message"], event["fix"])
        self.records.append(record)
        if state.is_world_process_zero and full and verdict.kind != self._last_kind:
            # the console line names the verdict at every log step; its evidence and next step when it changes
            log.info("telemetry step %d: %s", state.global_step, verdict.line())
            self._last_kind = verdict.kind
        if self.trainer is not None and not final:
            self.emitting = True
            try:
                # the base class's log: a subclass's own log (TRL's) would fold its pending metrics into this entry and
                # clear them before the Trainer's loss log of the same step
                # the record's per-rank figures and verdict as numbers too (trackers.py), not in the record's own metrics
                Trainer.log(self.trainer, {k: round(v, 4) for k, v in {**metrics, **tracker_metrics(record)}.items()})
                publish_texts(self.trainer, state.global_step, tracker_texts(record))  # the verdict's words, where shown
            finally:
                self.emitting = False

    def _oom_micro_batch(self) -> int | None:
        """The in-place OOM recovery's current micro-batch, when it is on and has shrunk it."""
        handler = getattr(self.trainer, "callback_handler", None)
        for callback in getattr(handler, "callbacks", []):
            if isinstance(callback, OOMRecoveryState):
                return callback.micro_batch
        return None

    def _window_stats(self, metrics, reasons, args) -> WindowStats:
        gpu = min(self.gpu_names) if self.gpu_names else None  # the GPU this process samples

        def g(key):
            return metrics.get(f"gpu{gpu}/{key}") if gpu is not None else None

        retries = metrics.get("torch/alloc_retries")
        delta = int(retries - self._last_retries) if retries is not None else 0
        if retries is not None:
            self._last_retries = retries
        return WindowStats(
            on_gpu=gpu is not None,
            gpu_util_pct=g("util_pct"),
            data_wait_pct=metrics.get("loop/data_wait_pct"),
            throttled_pct=g("throttled_pct"),
            power_capped_pct=g("power_capped_pct"),
            sm_clock_mhz=g("sm_clock_mhz"),
            sm_clock_max_mhz=g("sm_clock_max_mhz"),
            throttle_reasons=frozenset(reasons.get(gpu, ())) if gpu is not None else frozenset(),
            temp_c=g("temp_c"),
            power_w=g("power_w"),
            power_limit_w=g("power_limit_w"),
            alloc_retries_delta=delta,
            reserved_gib=metrics.get("torch/mem_reserved_gib"),
            allocated_gib=metrics.get("torch/mem_allocated_gib"),
            samples_per_s=metrics.get("loop/samples_per_s"),
            dataloader_workers=args.dataloader_num_workers,
            micro_batch=args.per_device_train_batch_size,
            suggested_micro_batch=self.suggested_micro_batch,
            host_cpu_pct=metrics.get("host/cpu_pct"),
        )


class TelemetryNotAttached(RuntimeError):
    pass


def logging_strategy(args) -> str:
    return str(getattr(args.logging_strategy, "value", args.logging_strategy))


def on_logging_schedule(args, state) -> bool:
    """Whether the Trainer's own schedule logs this step (``DefaultFlowCallback``): every rank computes it alike."""
    return ((logging_strategy(args) == "steps" and bool(state.logging_steps) and state.global_step % state.logging_steps == 0)
            or (state.global_step == 1 and bool(args.logging_first_step)))


def find_calling_trainer(max_depth: int = 12):
    """The ``transformers.Trainer`` whose method is on the call stack (``_inner_training_loop`` calls
    ``callback_handler.on_train_begin``), or None."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def attach_telemetry(trainer, compact_console: bool = True, **kwargs) -> TelemetryCallback:
    """Add telemetry to a Trainer in one line; the thread also stops if ``trainer.train`` raises.

    ``compact_console`` (default): the Trainer's printer is swapped for one compact line per log step
    (``console.py``); the full metric set still goes to every ``report_to`` sink and the run report. The loss-scaling
    guard comes with it (``oom/loss_scaling.py``): the losses telemetry reports are right on N processes."""
    from ..oom.loss_scaling import guard_loss_scaling
    from .console import use_compact_console

    check_not_alone(trainer)
    guard_loss_scaling(trainer)
    callback = TelemetryCallback(trainer=trainer, **kwargs)
    trainer.add_callback(callback)
    callback.agree_flags_of(trainer)  # its gather at a log step is every rank's (module docstring)
    if compact_console:
        use_compact_console(trainer, callback)
    train = trainer.train

    def train_and_close(*args, **kw):
        try:
            return train(*args, **kw)
        finally:
            callback.close()

    trainer.train = train_and_close
    return callback
