"""One training process's side of `hf-gpu-train tune`: the model and data loaded once, a new Trainer per candidate.

Loading dominates (seconds to minutes), a trial is a few steps, so every trial of a launch shares the model, the
tokenized data and the collator that ``finetune.run.prepared_for`` made, in the real launch setup (every process, the
plan's environment). Each trial builds its Trainer through the fine-tune's own seam (``finetune.run.assemble_trainer``:
the Trainer, its saves guarded, the levers applied, the model checked; then ``attach_pieces``) for that candidate's
config, with in-place OOM recovery and telemetry on, runs warm-up steps then
measured steps, and releases what the Trainer held (optimizer states, the DDP wrapper, the recovery's gradient hooks,
cached blocks) before the next.

The model's weights are not reset between trials: a few optimizer steps move them a little, and the speed and the
memory of a step do not depend on the values of the weights. What the user trains later starts again from the
recipe's model: nothing tuned here is saved.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
from dataclasses import dataclass, replace

import psutil
import torch

from ..callbacks.devices import device_peak
from ..errors import UsageError
from ..finetune.config import ConfigError, FinetuneConfig
from ..finetune.deepspeed_env import deepspeed_requested, hold_zero3_init
from ..finetune.fsdp import fsdp_requested
from ..finetune.loading import resolve
from ..finetune.run import assemble_trainer, attach_pieces, prepared_for
from ..finetune.runtime import resolve_runtime
from ..finetune.tasks import Task, task_for
from ..levers.activation_offload import detach as detach_offloading
from . import hooks
from .candidates import Candidate
from .lm_layouts import Layout, build_layout, prepared_layout
from .resident_memory import PeakResident
from .results import FAILED, OK, OOM, SKIPPED, TrialResult
from .search import MEASURE_STEPS_RANGE, measure_steps_for


@dataclass(frozen=True)
class LocalMeasurement:
    """What one process saw in one trial (gathered to rank 0 and combined by ``combine``)."""

    status: str
    reason: str = ""
    measured_s: float | None = None
    warmup_s: float | None = None
    tokens: int = 0
    step_times_s: tuple[float, ...] = ()
    data_wait_s: float = 0.0
    peak_memory_bytes: int | None = None
    device_memory_bytes: int | None = None
    rescued_micro_batch: int | None = None
    failed_micro_batch: int | None = None
    measured_steps: int | None = None
    strategy: str | None = None  # what the trial's Trainer ran, in the planner's words (ddp, deepspeed-zero2, ...)


def trial_config(base: FinetuneConfig, candidate: Candidate, world_size: int, warmup_steps: int, measure_steps: int | None,
                 output_dir: str) -> FinetuneConfig:
    """The run's config with the candidate's values, for warm-up + measured steps (room for the most the first trial
    may decide); no evaluation, no checkpoint, and the one log after the last step (nothing inside the window)."""
    steps = warmup_steps + (measure_steps or MEASURE_STEPS_RANGE[1])
    own = base.values()
    values = {k: v for k, v in candidate.config_values(world_size).items() if k in own}
    return resolve(base.with_values(**values, max_steps=steps, eval_strategy="no", save_strategy="no",
                                    logging_steps=steps + 1, report_to="none", output_dir=output_dir))


def checkpointing_off(model) -> None:
    """Turn gradient checkpointing off again after a trial that turned it on (the next trial's Trainer only ever
    turns it on)."""
    on = getattr(model, "is_activation_checkpointing", None)
    if on if on is not None else getattr(model, "is_gradient_checkpointing", False):
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()
    inner = getattr(model, "model", None)  # tasks/image_classification/model.TimmClassifier holds the timm model
    if inner is not None and hasattr(inner, "set_grad_checkpointing"):
        inner.set_grad_checkpointing(False)
    for module in (model, getattr(model, "get_base_model", lambda: None)()):
        if module is not None and hasattr(module, "_hf_gpu_train_checkpoint_layers"):
            del module._hf_gpu_train_checkpoint_layers  # the policy marker (remedies.py) goes with the checkpointing


class TrialSession:
    """The model, data and collator of one process, and ``run(candidate)``."""

    def __init__(self, cfg: FinetuneConfig, output_dir: str, environ=None):
        from accelerate import PartialState
        from transformers import set_seed


        environ = os.environ if environ is None else environ
        self.cfg = cfg
        self.output_dir = output_dir
        self.runtime = resolve_runtime(cfg)
        state = PartialState(cpu=not self.runtime.on_cuda)  # the process group, before the first trial's Trainer
        self.rank, self.world_size = state.process_index, state.num_processes
        set_seed(cfg.seed)
        # a ZeRO-3 launch (tune's strategy round): the model loads partitioned, as scripts/finetune.py loads it; held until
        # the first Trainer's arguments hold DeepSpeed's config
        self.zero3_init = hold_zero3_init(self.runtime.precision)
        self.prepared = prepared = prepared_for(cfg, self.runtime)
        self.model, self.processing_class, self.data = prepared.model, prepared.processing_class, prepared.data
        collator, self.notes = hooks.install(self.model, prepared.collator, environ)
        # a task that checks its model (causal LM): here, on the device the trials train on; in a launch that shards the
        # model (the strategy round) on the first Trainer's model once it exists, as the fine-tune checks it (before
        # FSDP or DeepSpeed wraps it, a rank may hold no weights: FSDP's efficient loading, ZeRO-3's partitions)
        self.confirm_on_trainer = fsdp_requested(environ) or deepspeed_requested(environ)
        if type(task_for(cfg.task)).confirm_model is Task.confirm_model:
            self.confirm_on_trainer = False
        elif not self.confirm_on_trainer:
            self._confirm_model()
        self.layouts = {None: prepared_layout(prepared.train, collator)}  # by the packing value asked for (causal LM only)

    def _confirm_model(self) -> None:
        """The task's check of the model (a causal LM's chunked head) as the fine-tune makes it, on the device the
        trials train on (DDP or one process: each process holds the whole model, which its first Trainer would move
        there anyway)."""
        quantized = getattr(self.model, "hf_device_map", None) or getattr(self.model, "is_loaded_in_4bit", False)
        if self.runtime.on_cuda and not quantized:
            self.model.to(torch.device("cuda", torch.cuda.current_device()))
        line = task_for(self.cfg.task).confirm_model(self.model, self.cfg, self.runtime.precision)
        if line:
            self.notes.append(line)

    def layout(self, packing) -> Layout:
        """The data of a candidate: as prepared, or (causal LM) the other packing layout, built once."""
        if packing is None or packing == self.cfg.packing:
            return self.layouts[None]
        if packing not in self.layouts:

            built = build_layout(packing, self.cfg.options, self.model, self.processing_class, self.data, self.runtime.on_cuda)
            if built.collator is not None:
                built = replace(built, collator=hooks.install(None, built.collator, os.environ)[0])
            self.layouts[packing] = built
        return self.layouts[packing]

    def run(self, candidate: Candidate, warmup_steps: int, measure_steps: int | None) -> LocalMeasurement:
        """One trial; ``measure_steps`` None: this trial decides the count (``LocalMeasurement.measured_steps``)."""
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        from ..oom import OutOfMemoryAtMicroBatchOne
        from .meter import TrialMeter

        layout = self.layout(candidate.packing)
        if layout.train is None:
            return LocalMeasurement(SKIPPED, layout.reason)
        try:
            cfg = trial_config(self.cfg, candidate, self.world_size, warmup_steps, measure_steps, self.output_dir)
        except ConfigError as error:  # a combination the run refuses (every rank refuses it alike: the same config)
            return LocalMeasurement(SKIPPED, str(error))
        runtime = resolve_runtime(cfg, profile=self.runtime.profile)
        device = torch.device("cuda", torch.cuda.current_device()) if runtime.on_cuda else torch.device("cpu")
        if runtime.on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        trainer = recovery = telemetry = meter = None
        ran = None
        outcome: tuple[str, str] = (OK, "")
        resident = PeakResident() if not runtime.on_cuda else contextlib.nullcontext()
        try:
            trial_data = replace(self.prepared, train=layout.train, collator=layout.collator)
            confirm, self.confirm_on_trainer = self.confirm_on_trainer, False
            try:  # a lever this setting rules out: the same config on every rank, before any step
                assembled = assemble_trainer(cfg, runtime, trial_data, confirm_model=confirm)
            except UsageError as error:
                raise ConfigError(str(error)) from None
            trainer, ran = assembled.trainer, assembled.strategy
            self.zero3_init = None  # the Trainer's arguments hold DeepSpeed's config from here
            if assembled.model_line and self.rank == 0:
                print(f"tune: {assembled.model_line}", flush=True)
            # the fine-tune's rules (no in-place recovery beside the optimizer in the backward); a trial always
            # measures with recovery and telemetry, and has no watchdog (tune's own timeouts end it)
            pieces = attach_pieces(trainer, cfg, recovery=True, watchdog=False,
                                   telemetry={"compact_console": False, "write_report": False})
            recovery, telemetry = pieces.recovery, pieces.telemetry
            for printer in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(printer)
            meter = TrialMeter(warmup_steps, measure_steps, telemetry, decide=measure_steps_for)
            trainer.add_callback(meter)
            with resident:
                trainer.train()
        except OutOfMemoryAtMicroBatchOne as error:  # every rank raises it together (the recovery's vote)
            outcome = (OOM, f"out of memory at micro-batch 1: {str(error).splitlines()[0]}")
        except torch.OutOfMemoryError as error:  # outside a training step (the optimizer's states, wrapping the model)
            if self.world_size > 1:
                raise  # one rank may run out where another does not: end the launch rather than hang in a collective
            outcome = (OOM, f"out of memory outside a step: {str(error).splitlines()[0]}")
        except ConfigError as error:  # a refusal before the first step (checkpointing on a model without it, a lever this
            outcome = (SKIPPED, str(error))  # setting rules out): every rank refuses it alike
        except Exception as error:
            if self.world_size > 1:
                raise  # another rank may be inside a collective: end the launch rather than hang it
            outcome = (FAILED, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        peak, total = device_peak(device)
        if isinstance(resident, PeakResident) and resident.bytes:  # the CPU: the process's peak resident memory
            peak, total = resident.bytes, psutil.virtual_memory().total
        events = list(recovery.events) if recovery is not None else []
        failed = [e["from"] for e in events if e.get("phase") == "train"]
        status, reason = outcome
        if status == OK and failed:
            status, reason = OOM, f"ran out of memory at micro-batch {min(failed)}; the OOM recovery finished at {recovery.micro_batch}"
        measured = LocalMeasurement(
            status=status, reason=reason, measured_s=meter.measured_s if meter else None, warmup_s=meter.warmup_s if meter else None,
            tokens=meter.measured_tokens if meter else 0, step_times_s=tuple(meter.step_times) if meter else (),
            data_wait_s=sum(meter.data_waits) if meter else 0.0, peak_memory_bytes=peak, device_memory_bytes=total,
            rescued_micro_batch=recovery.micro_batch if recovery is not None and failed else None,
            failed_micro_batch=min(failed) if failed else None, measured_steps=meter.measure_steps if meter else measure_steps,
            strategy=ran)
        self._close(trainer, recovery, telemetry, meter)
        trainer = recovery = telemetry = meter = None  # the last references: the collection below frees them
        if candidate.torch_compile:
            torch.compiler.reset()  # the compiled graphs of this trial are not needed again
        gc.collect()
        if runtime.on_cuda:
            torch.cuda.empty_cache()
        return measured

    def _close(self, trainer, recovery, telemetry, meter) -> None:
        """Detach what the trial's Trainer put on the shared model and let go of what it held."""
        for closer in (meter, telemetry):
            if closer is not None:
                closer.close()
        if recovery is not None and recovery.reducer is not None:
            recovery.reducer.remove()  # its gradient hooks sit on the shared model's parameters
        if trainer is not None:
            from ..levers.optimizer_in_backward import remove_hooks

            remove_hooks(trainer.optimizer)  # a trial that raised never reached on_train_end, which removes them
            trainer.accelerator.free_memory()
            trainer.optimizer = trainer.lr_scheduler = None
        checkpointing_off(self.model)
        detach_offloading(self.model)
        self.model.zero_grad(set_to_none=True)


def combine(candidate: Candidate, local: list[LocalMeasurement], warmup_steps: int, seconds: float, world_size: int,
            memory_budget_bytes: int | None = None) -> TrialResult:
    """Every process's measurement of one trial -> its result: throughput over all processes in the slowest one's
    measured time, memory of the fullest process, data wait of the one that waited most."""
    statuses = {m.status for m in local}
    status = next((s for s in (FAILED, SKIPPED, OOM) if s in statuses), OK)
    reason = next((m.reason for m in local if m.status == status and m.reason), "")
    rescued = [m.rescued_micro_batch for m in local if m.rescued_micro_batch]
    failed = [m.failed_micro_batch for m in local if m.failed_micro_batch]
    peaks = [m.peak_memory_bytes for m in local if m.peak_memory_bytes is not None]
    totals = [m.device_memory_bytes for m in local if m.device_memory_bytes]
    measure_steps = local[0].measured_steps or 0
    common = dict(peak_memory_bytes=max(peaks) if peaks else None, device_memory_bytes=min(totals) if totals else None,
                  rescued_micro_batch=min(rescued) if rescued else None, failed_micro_batch=min(failed) if failed else None,
                  warmup_steps=warmup_steps, measured_steps=measure_steps, seconds=round(seconds, 3),
                  memory_budget_bytes=memory_budget_bytes, launched_strategy=local[0].strategy,
                  peak_by_rank_bytes=tuple(m.peak_memory_bytes for m in local))
    times = [m.measured_s for m in local]
    if status in (FAILED, SKIPPED) or None in times or not times:
        return TrialResult(candidate, status, reason, **common)
    measured_s = max(times)
    samples = measure_steps * candidate.micro_batch * candidate.accumulation * world_size
    steps = local[0].step_times_s
    spread = None
    if len(steps) > 1 and statistics.mean(steps) > 0:
        spread = 100.0 * statistics.stdev(steps) / statistics.mean(steps) / len(steps) ** 0.5
    tokens = sum(m.tokens for m in local)
    step_time = measured_s / measure_steps
    warmup = local[0].warmup_s
    compile_s = max(0.0, warmup - warmup_steps * step_time) if candidate.torch_compile and warmup is not None else None
    return TrialResult(candidate, status, reason, samples_per_s=samples / measured_s, tokens_per_s=tokens / measured_s if tokens else None,
                       spread_pct=spread, step_time_s=step_time, data_wait_pct=max(100.0 * m.data_wait_s / measured_s for m in local),
                       warmup_s=warmup, compile_s=compile_s, step_times_s=tuple(round(t, 6) for t in steps), **common)


def trial_line(index: int, result: TrialResult) -> str:
    """One console line per trial, from rank 0."""
    speed = ""
    if result.samples_per_s:
        speed = f"{result.samples_per_s:,.1f} samples/s"
        if result.tokens_per_s:
            speed = f"{result.tokens_per_s:,.0f} tokens/s, " + speed
        if result.data_wait_pct is not None:
            speed += f", data wait {result.data_wait_pct:.0f}%"
        if result.peak_memory_bytes:
            speed += f", peak {result.peak_memory_bytes / 2**30:.2f} GiB"
        speed = " " + speed + ";"
    elapsed = f" ({result.seconds:.1f} s)" if result.seconds else ""
    return f"tune: trial {index}{elapsed}: {result.candidate.describe()}:{speed} {result.verdict()}"

