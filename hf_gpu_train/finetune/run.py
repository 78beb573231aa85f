"""The run spine: ``FinetuneRun`` (setup -> train -> finish) behind ``scripts/finetune.py``, and the pieces
``hf-gpu-train tune`` builds its trials from (``prepared_for``, ``assemble_trainer``, ``attach_pieces``). The task's own work is the task's
(``tasks/``); this module does not branch on its name.

Exit 0 on success, 2 for a usage error (bad config, data or paths: one line naming the fix, nothing
overwritten), anything else is a bug and keeps its traceback. This module imports no torch at its top: ``tune``'s
command reads ``parse_args`` before any training process exists; what the run needs it imports in ``setup``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..closed_pipe import until_the_pipe_closes
from ..collectives.clipping_order import clipping_order_line
from ..errors import UsageError, report_usage_error
from ..fast_exit import end_quickly
from ..faults.background_save import last_write_seconds
from ..faults.checkpoint_marker import resume_point
from ..faults.disk_full import FINETUNE_WORDS, MERGED, guard_saves, saving_to
from ..faults.preflight_collective import preflight
from ..launch.rank_report import write_resumes
from ..levers.from_config import apply_levers, release_memory, release_memory_before_cuda
from ..plan.decisions import accelerate_uses_cpu
from ..report.writer import render_report
from .agreement import check_ranks_agree
from .checkpoints import (
    check_label_map,
    checkpoints,
    is_main_process,
    label_map_writer,
    last_complete_checkpoint,
    write_label_map,
)
from .config import ConfigError, FinetuneConfig, save_resolved
from .deepspeed_env import deepspeed_optimizer_line, hold_zero3_init
from .fsdp import fsdp_requested, save_full_model
from .launch_plan import apply_launch_plan, confirm_launched_strategy, strategy_of_state
from .loading import load_config_and_keys, read_config_values
from .recipe_names import resolve_recipe, shipped_names
from .run_record import (
    SHOWN_METRICS,
    RunIdentity,
    back_up_config,
    check_previous_run,
    keep_the_global_batch,
    read_previous,
    write_record,
)
from .tasks import Prepared, task_for

log = logging.getLogger("hf_gpu_train.finetune")


def parse_args(argv: list[str] | None, prog: str = "finetune.py") -> tuple[str | None, list[str]]:
    """(recipe file, key=value overrides). ``--config`` takes a file or a shipped recipe's name (``recipe_names``); a
    shipped recipe's data files, written relative to it, are found by the config loader."""

    parser = argparse.ArgumentParser(
        prog=prog,
        description="Fine-tune a transformers or timm classifier. key=value overrides follow the YAML config.",
        epilog="example: accelerate launch -m hf_gpu_train.finetune --config minilm_text_demo learning_rate=3e-5",
    )
    parser.add_argument("--config", metavar="NAME_OR_PATH",
                        help=f"a YAML recipe file, or a shipped recipe's name: {', '.join(shipped_names())}")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. num_train_epochs=1")
    args = parser.parse_args(argv)
    recipe = resolve_recipe(args.config) if args.config is not None else None
    return recipe, list(args.overrides)


def _resume_point(cfg: FinetuneConfig, label_names: list[str], previous_finished: bool) -> str | None:

    out = Path(cfg.output_dir)
    if checkpoints(out) or previous_finished:  # a start that trained nothing leaves no labels to keep
        check_label_map(out, label_names, "output_dir")
    if cfg.resume == "never":
        if checkpoints(out) or previous_finished:
            what = "checkpoints of an earlier run" if checkpoints(out) else "a finished run"
            raise ConfigError(f"output_dir={cfg.output_dir!r} holds {what} and resume=never: "
                              "choose a new output_dir, or resume=auto to continue it (nothing was overwritten)")
        return None
    if cfg.resume == "auto":
        found = last_complete_checkpoint(out)
        return str(found) if found else None
    try:  # a named checkpoint that is half-written: set aside, the newest complete one beside it taken (said)
        chosen = resume_point(cfg.resume, out)
    except ValueError as error:
        raise ConfigError(f"resume={cfg.resume!r}: {error}") from None
    check_label_map(chosen, label_names, "checkpoint")
    return chosen


def prepared_for(cfg: FinetuneConfig, runtime) -> Prepared:
    """The task's model and data (``tasks/``), its notes said on the main process. Each task orders its work for
    whoever made a mistake: first what is cheap to check (the model's path or timm name and its weights; the data's
    files, splits, columns and labels), then the model, and only then the passes over every row, once per machine
    (``prepare_once``)."""

    def say(notes):
        if is_main_process():
            for note in notes:
                print(f"hf_gpu_train: {note}", flush=True)

    return task_for(cfg.task).prepare(cfg, runtime, say)


def default_callbacks(cfg: FinetuneConfig, label_names: list[str]) -> list:
    from ..callbacks import CpuByAccidentGuard
    from ..faults.checkpoint_costs import CheckpointCosts
    from .intervals import interval_callbacks

    # the completion marker (with the label map) comes with guard_saves in assemble_trainer; the save costs are measured
    # before the interval is planned from them (callbacks run in this order)
    costs = CheckpointCosts()
    return [CpuByAccidentGuard(allow_cpu=cfg.allow_cpu or accelerate_uses_cpu(os.environ)), costs,
            *interval_callbacks(cfg.eval_strategy, cfg.save_strategy, cfg.checkpoint_minutes, cfg.mtbf_hours, costs)]


def check_output_dir(cfg: FinetuneConfig) -> None:
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir={cfg.output_dir!r} is a file: give a directory (it is created when missing)")


# TrainingArguments the run derives from its own config keys (trainer_factory.training_arguments). Given in ``extra`` they
# would override, after the fact, what the run printed, recorded in finetune_config.yaml and agreed across ranks.
# (warmup_steps stays open: a count of warm-up steps has no config key, warmup_ratio is a share.)
OWNED_BY_CONFIG = {
    "output_dir": "output_dir", "num_train_epochs": "num_train_epochs", "max_steps": "max_steps",
    "per_device_train_batch_size": "per_device_train_batch_size", "per_device_eval_batch_size": "per_device_eval_batch_size",
    "gradient_accumulation_steps": "global_batch_size", "learning_rate": "learning_rate", "weight_decay": "weight_decay",
    "warmup_ratio": "warmup_ratio", "lr_scheduler_type": "lr_scheduler_type",
    "bf16": "precision", "fp16": "precision", "torch_compile": "torch_compile", "dataloader_num_workers": "dataloader_num_workers",
    "eval_strategy": "eval_strategy", "eval_steps": "eval_steps", "save_strategy": "save_strategy", "save_steps": "save_steps",
    "save_total_limit": "save_total_limit", "logging_steps": "logging_steps", "report_to": "report_to", "seed": "seed",
    "use_cpu": "allow_cpu", "eval_on_start": "evaluate_before", "gradient_checkpointing": "gradient_checkpointing",
    "activation_checkpointing": "gradient_checkpointing",
}


def check_extra_arguments(cfg: FinetuneConfig) -> None:
    """``extra`` goes to TrainingArguments as it is: a typo must fail here, named, not as a TypeError traceback after
    the model has loaded."""

    from transformers import TrainingArguments

    known = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    for key in cfg.extra:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            raise ConfigError(f"extra={{{key}: ...}}: {key!r} is not a TrainingArguments argument"
                              + (f"; did you mean {close[0]!r}?" if close else ""))
        if key in OWNED_BY_CONFIG:
            raise ConfigError(f"extra={{{key}: ...}}: the run sets {key} from its own key {OWNED_BY_CONFIG[key]} (and says so, "
                              f"records it, agrees it across ranks); set {OWNED_BY_CONFIG[key]}= instead")


def final_metrics(trainer, first_step: int) -> dict:
    """The evaluation at the last step when this run's schedule already ran it (eval_strategy=epoch), else one now:
    the final evaluation runs once. One restored from a checkpoint (a resume with nothing left to train) is not
    reused: it may have been measured on other samples."""
    last = next((h for h in reversed(trainer.state.log_history) if "eval_loss" in h), None)
    if last is not None and last.get("step") == trainer.state.global_step > first_step:
        return {k: v for k, v in last.items() if k.startswith("eval_") or k == "epoch"}
    return trainer.evaluate()


# the figures a run reports: its summary, its last line, and what it scored before training (evaluate_before.py)


def result_line(metrics: dict, baseline: dict | None, rows: int, cfg: FinetuneConfig) -> str:
    """The run's last line: the figures that mean something, and what the model scored before training."""
    def figures(values: dict) -> str:
        return ", ".join(f"{name} {values[key]:.4g}" for key, name in SHOWN_METRICS.items() if key in values)

    from .evaluate_before import sample_words  # here: it imports transformers' Trainer, and the CLI imports this module

    word = task_for(cfg.task).rows_word
    line = f"{figures(metrics)} on {rows} validation {word}"
    if baseline:
        line += f"; before training (the model as loaded{sample_words(baseline, word)}): {figures(baseline)}"
    return line


def _report_finished(cfg: FinetuneConfig, results: dict) -> dict:
    if os.environ.get("RANK", "0") == "0":
        print(f"hf_gpu_train: output_dir={cfg.output_dir!r} already holds this run, finished: "
              f"{json.dumps({k: v for k, v in results.items() if k in (*SHOWN_METRICS, 'epoch')})}. "
              "Nothing was trained (output_dir=NEW_DIR to train again).", flush=True)
    return results


@dataclass
class Pieces:
    """What ``attach_pieces`` put on a Trainer, and the lines that say what it left off."""

    recovery: object = None
    telemetry: object = None
    preemption: object = None
    lines: list[str] = field(default_factory=list)


def attach_pieces(trainer, cfg: FinetuneConfig, *, recovery: bool, watchdog: bool, telemetry: dict | None,
                  preemption: bool = False) -> Pieces:
    """In-place OOM recovery, the watchdog, telemetry and preemption handling on a Trainer, by the rules that hold wherever the run's
    Trainer is built (the fine-tune, and every trial of ``hf-gpu-train tune``): no in-place recovery beside the
    optimizer step in the backward (each micro-batch of a split step would step the parameters). ``telemetry``: the
    options of ``attach_telemetry``, or None for none."""
    pieces = Pieces()
    if recovery and cfg.optimizer_in_backward:
        pieces.lines.append("in-place OOM recovery off: it splits a step into micro-batches, and with optimizer_in_backward "
                            "each micro-batch's backward would step the parameters")
    elif recovery:
        from ..oom import enable_oom_recovery

        pieces.recovery = enable_oom_recovery(trainer)
    if watchdog:
        from ..faults.watchdog import attach_watchdog

        attach_watchdog(trainer, cfg.watchdog)
    if telemetry is not None:
        from ..callbacks import attach_telemetry

        pieces.telemetry = attach_telemetry(trainer, **telemetry)
    if preemption:
        from ..faults.preemption import attach_preemption

        pieces.preemption = attach_preemption(trainer)  # off the main thread (Ray Train) it says so itself and steps aside
    return pieces


@dataclass
class AssembledTrainer:
    """A Trainer as the run builds it, before its pieces (``attach_pieces``): what its accelerator runs, in the
    planner's words, the lines that confirm what was applied (levers, a launch that runs another strategy than the
    plan's) and the task's line on the model where the Trainer placed it (None: nothing said, or not checked)."""

    trainer: object
    strategy: str | None
    lines: list[str]
    model_line: str | None = None


def assemble_trainer(cfg: FinetuneConfig, runtime, prepared: Prepared, *, callbacks=(), trainer_class=None,
                     launch_plan=None, confirm_model: bool = True) -> AssembledTrainer:
    """The seam the fine-tune and every trial of ``hf-gpu-train tune`` share: the Trainer (``build_trainer``), what its
    accelerator runs checked against the plan (``launch_plan``), its saves guarded (a full disk named, checkpoints
    marked complete once every rank wrote them), the config's memory levers applied, and the task's check of the model
    where the Trainer placed it (``confirm_model``: tune checks a shared model once). The pieces follow with
    ``attach_pieces``, after whatever the caller does before the first step."""
    from transformers import Trainer

    from ..collectives.running_statistics import share_running_statistics
    from .trainer_factory import build_trainer

    trainer = build_trainer(cfg, runtime, prepared.model, prepared.train, prepared.validation, prepared.collator,
                            prepared.processing_class, callbacks=callbacks, trainer_class=trainer_class or Trainer)
    strategy_line = confirm_launched_strategy(launch_plan, trainer.accelerator.state)  # scoped for what runs
    # a full disk while saving: a message naming it; each checkpoint marked complete (its label map first) once every
    # rank wrote it; a resume never takes a half-written one
    guard_saves(trainer, FINETUNE_WORDS, before_marker=label_map_writer(prepared.data.label_names),
                background=cfg.background_saves)
    from .intervals import EveryFewMinutes

    for callback in trainer.callback_handler.callbacks:  # a planned interval is never shorter than a background write
        if isinstance(callback, EveryFewMinutes):
            callback.write_seconds = lambda: last_write_seconds(trainer)
    lines = apply_levers(trainer, cfg.lever_keys(), runtime)  # selective checkpointing, offloading, optimizer in backward
    lines += share_running_statistics(trainer) + clipping_order_line(trainer)  # each rank evaluates the saved model
    lines += [strategy_line] if strategy_line else []
    model_line = task_for(cfg.task).confirm_model(trainer.model, cfg, runtime.precision) if confirm_model else None
    return AssembledTrainer(trainer, strategy_of_state(trainer.accelerator.state), lines, model_line)


class FinetuneRun:
    """One fine-tuning run, in three steps (the shape of torchtune's recipes): ``setup`` (checks, runtime, model and
    data, resume point, the record of the run, the Trainer and every piece on it), ``train``, ``finish`` (the final
    evaluation, the saved model, the summary, the report and the task's own outputs).

    ``hf-gpu-train tune`` builds its trials from the same pieces: ``prepared_for`` (the task's model and data, once),
    ``assemble_trainer`` and ``attach_pieces`` (a Trainer per trial)."""

    def __init__(self, cfg: FinetuneConfig, extra_callbacks=(), trainer_class=None, launch_plan=None):
        self.cfg = cfg
        self.task = task_for(cfg.task)
        self.extra_callbacks = list(extra_callbacks)
        self.trainer_class = trainer_class
        self.launch_plan = launch_plan  # an AppliedPlan: recorded in run_summary.json and the report

    def setup(self) -> dict | None:
        """Everything before the first step. The results of the finished run when ``output_dir`` already holds this
        run, finished (nothing is trained then), else None."""
        finished = self._resolve()
        if finished is None:
            finished = self._load()
        if finished is not None:
            return finished
        self._assemble()
        return None

    def _resolve(self) -> dict | None:
        """What is cheap and needs no model: the config's own checks, the runtime, the record of an earlier run."""
        from .runtime import resolve_runtime  # lazy: looked up when called, so a replacement (a test's) is seen
        from .trainer_factory import gradient_accumulation

        cfg, launch_plan = self.cfg, self.launch_plan
        check_output_dir(cfg)
        check_extra_arguments(cfg)
        self.deepspeed_optimizer = deepspeed_optimizer_line(cfg.extra, cfg.weight_decay)  # a usage error here, before anything loads
        cuda_release = release_memory_before_cuda(cfg.lever_keys())  # before anything starts CUDA: resolving the runtime asks it
        self.runtime = runtime = resolve_runtime(cfg, launch_plan.here if launch_plan is not None else None)
        self.released = release_memory(cfg.lever_keys(), runtime, cuda_release)  # before the model loads
        if runtime.on_cuda and runtime.world_size > 1:  # before the process group: NCCL reads it once
            # the NCCL flight recorder's dumps (the plan turns it on for several GPUs) go beside the run, not to /tmp
            os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(Path(cfg.output_dir).absolute() / "nccl-trace-rank-"))
        self.accumulation, self.effective = gradient_accumulation(cfg, runtime.world_size)
        self.identity = RunIdentity.of(cfg, runtime.precision, self.effective)
        self.previous = read_previous(cfg.output_dir)
        kept = keep_the_global_batch(cfg, self.identity, self.previous, runtime.world_size)
        if kept is not None:  # another number of processes than the checkpoints': the same global batch
            changes, line = kept
            self.cfg = cfg = cfg.with_values(**changes)
            self.accumulation, self.effective = gradient_accumulation(cfg, runtime.world_size)
            self.identity = RunIdentity.of(cfg, runtime.precision, self.effective)
        if check_previous_run(cfg, self.identity, self.previous, runtime.world_size) == "finished":
            return _report_finished(cfg, self.previous.results)
        if kept is not None and is_main_process():  # said of a run that goes on, not of a finished one
            print(f"hf_gpu_train: {kept[1]}", flush=True)
        return None

    def _load(self) -> dict | None:
        """Every rank joined, then the task's model and data, the resume point and the run's records."""
        from transformers import set_seed


        cfg, runtime, previous = self.cfg, self.runtime, self.previous
        set_seed(cfg.seed)
        if runtime.world_size > 1 or fsdp_requested():
            # every rank joined and the collectives work, in seconds, before the model and data load. The process group
            # must exist before the model loads anyway under FSDP, or transformers loads the whole model on every rank
            # (fsdp_cpu_ram_efficient_loading: only rank 0 reads the weights, the others wait on the meta device)

            preflight(cpu=not runtime.on_cuda, timeout=float(cfg.extra.get("ddp_timeout", 1800)),
                      backend=cfg.extra.get("ddp_backend"))
        # a ZeRO-3 launch: the model loads partitioned (why: deepspeed_env.py); held until the Trainer holds the config
        self.zero3_init = hold_zero3_init(runtime.precision)
        self.prepared = prepared_for(cfg, runtime)
        data = self.prepared.data
        if self.identity.training.get("learning_rate") is None:  # chosen with the model (learning_rates.py): compared now
            self.identity = RunIdentity.of(cfg, runtime.precision, self.effective)
            if check_previous_run(cfg, self.identity, previous, runtime.world_size) == "finished":
                return _report_finished(cfg, previous.results)
        self.resume = _resume_point(cfg, data.label_names, previous.finished)
        if cfg.resume == "auto":
            write_resumes()  # a launcher that restarts this run finds it where it stopped
        back_up_config(cfg.output_dir, cfg)
        if is_main_process():
            save_resolved(cfg, cfg.output_dir)
        write_label_map(cfg.output_dir, data.label_names)
        write_record(cfg.output_dir, self.identity, runtime.world_size)
        if cfg.global_batch_size and self.effective != cfg.global_batch_size:
            log.warning("global_batch_size=%d is not a multiple of %d x %d process(es): effective batch %d",
                        cfg.global_batch_size, cfg.per_device_train_batch_size, runtime.world_size, self.effective)
        return None

    def _assemble(self) -> None:
        """The Trainer and every piece on it, by the rules that hold in anyone's Trainer (``attach_pieces``)."""
        from .evaluate_before import attach_evaluate_before, trained_rows

        cfg, runtime, prepared = self.cfg, self.runtime, self.prepared
        data, validation = prepared.data, prepared.validation
        assembled = assemble_trainer(cfg, runtime, prepared, callbacks=default_callbacks(cfg, data.label_names) + self.extra_callbacks,
                                     trainer_class=self.trainer_class, launch_plan=self.launch_plan)
        self.trainer = trainer = assembled.trainer
        self.zero3_init = None  # the Trainer's arguments hold DeepSpeed's config from here
        lever_lines = [*self.released, *assembled.lines, *filter(None, (self.deepspeed_optimizer, assembled.model_line))]
        kept = self.task.evaluation_line(trainer.model, cfg, len(validation), len(data.label_names or ()))
        lever_lines += [kept] if kept else []
        check_ranks_agree({"per_device_train_batch_size": cfg.per_device_train_batch_size,
                           "gradient_accumulation_steps": self.accumulation, "effective_batch": self.effective,
                           "precision": runtime.precision, "method": cfg.method,
                           "gradient_checkpointing": cfg.gradient_checkpointing, "checkpoint_layers": cfg.checkpoint_layers,
                           "offload_activations": cfg.offload_activations, "optimizer_in_backward": cfg.optimizer_in_backward,
                           "torch_compile": cfg.torch_compile, "learning_rate": cfg.learning_rate,
                           "evaluate_before": cfg.evaluate_before, "validation_rows": len(validation),
                           "packing": getattr(data, "packing", cfg.values().get("packing"))})
        if trainer.is_world_process_zero():
            self._say_what_runs(lever_lines)
        self.started = self.task.before_training(trainer, cfg, prepared)
        pieces = attach_pieces(trainer, cfg, recovery=cfg.oom_recovery, watchdog=cfg.watchdog != "off",
                               telemetry={} if cfg.telemetry else None, preemption=cfg.preemption)
        for line in pieces.lines:  # on every rank: each says what it left off
            print(f"hf_gpu_train: {line}", flush=True)
        rows = trained_rows(cfg.max_steps, cfg.num_train_epochs, len(prepared.train), self.effective)
        self.before = attach_evaluate_before(cfg.evaluate_before, cfg.output_dir, trainer, len(validation),  # at train begin
                                             resuming=bool(self.resume), trained_rows=rows, derive=self.task.final_metrics)

    def _say_what_runs(self, lever_lines: list[str]) -> None:
        cfg, runtime, data = self.cfg, self.runtime, self.prepared.data
        for line in self.launch_plan.lines if self.launch_plan else ():
            print(f"hf_gpu_train: {line}", flush=True)
        print(f"hf_gpu_train: {cfg.task}, {len(data.train)} train / {len(data.validation)} validation examples"
              f"{f', {len(data.label_names)} classes' if data.label_names else ''}; {'CUDA' if runtime.on_cuda else 'CPU'} x{runtime.world_size}, "
              f"{runtime.precision} ({runtime.precision_reason}); batch {cfg.per_device_train_batch_size} x {self.accumulation} "
              f"x {runtime.world_size} = {self.effective}; workers {runtime.dataloader_workers}"
              + (f"; resuming from {self.resume}" if self.resume else ""), flush=True)
        for line in lever_lines:
            print(f"hf_gpu_train: {line}", flush=True)

    def train(self) -> None:
        resume = self.resume
        start = time.perf_counter()
        self.first_step = int(json.loads((Path(resume) / "trainer_state.json").read_text())["global_step"]) if resume else 0
        self.result = self.trainer.train(resume_from_checkpoint=resume)
        self.train_seconds = time.perf_counter() - start - (self.before.seconds if self.before is not None else 0.0)

    def finish(self) -> dict:
        """The final evaluation, the model saved, the summary and the report, then the task's own outputs."""
        from .evaluate_before import read_baseline

        cfg, trainer, runtime, before, resume = self.cfg, self.trainer, self.runtime, self.before, self.resume
        validation = self.prepared.validation
        metrics = final_metrics(trainer, self.first_step)
        trainer.save_state()  # trainer_state.json in output_dir: the logged losses, gradient norms and evaluations (the last too)
        metrics = self.task.final_metrics(metrics)
        trainer.save_metrics("eval", metrics)
        save_full_model(trainer)
        if trainer.is_world_process_zero():
            summary = {"global_step": trainer.state.global_step, "train_seconds": round(self.train_seconds, 2),
                       "train_samples_per_second": self.result.metrics.get("train_samples_per_second"),
                       **{k: metrics[k] for k in SHOWN_METRICS if k in metrics}}
            if before is not None:  # what the evaluation first took (inside train(), not in train_seconds)
                summary["evaluate_before_seconds"] = round(before.seconds, 2)
            if cfg.offload_activations:
                from ..levers.activation_offload import offloaded_bytes

                summary["offloaded_activation_bytes"] = offloaded_bytes(trainer.model)  # the last training forward's
            if self.launch_plan is not None:
                summary["plan"] = self.launch_plan.record(*measured_peak_memory(runtime))
            (Path(cfg.output_dir) / "run_summary.json").write_text(json.dumps(summary, indent=2))

            try:  # the run's story: metrics, curves, config, the plan next to what was measured
                render_report(cfg.output_dir)
            except Exception as error:  # noqa: BLE001 - a report that cannot be drawn must not cost the trained model
                log.warning("report.md not written (%s: %s); `hf-gpu-train report %s` draws it again", type(error).__name__,
                            error, cfg.output_dir)
            print("hf_gpu_train: " + json.dumps({k: v for k, v in summary.items() if k != "plan"}), flush=True)
            baseline = before.baseline if before is not None else read_baseline(cfg.output_dir) if resume else None
            print(f"hf_gpu_train: {result_line(metrics, baseline, len(validation), cfg)}", flush=True)
        self.task.after_training(trainer, cfg, self.prepared, runtime, self.started,
                                 saving=lambda: saving_to(trainer, Path(cfg.output_dir), MERGED, FINETUNE_WORDS))
        write_record(cfg.output_dir, self.identity, runtime.world_size, finished=True, global_step=trainer.state.global_step)
        return metrics


def finetune(cfg: FinetuneConfig, extra_callbacks=(), trainer_class=None, launch_plan=None) -> dict:
    """Train and evaluate ``cfg``; ``launch_plan`` (an ``AppliedPlan``) is recorded in run_summary.json and the report."""
    run = FinetuneRun(cfg, extra_callbacks, trainer_class, launch_plan)
    finished = run.setup()
    if finished is not None:
        return finished
    run.train()
    return run.finish()


def measured_peak_memory(runtime) -> tuple[int | None, str | None]:
    """This process's peak GPU memory, counted as the planner counts it (the CUDA context included)."""
    if not runtime.on_cuda:
        return None, None
    import torch

    from ..callbacks.devices import device_peak

    peak, _ = device_peak(torch.device("cuda", torch.cuda.current_device()))
    return peak, "rank 0: torch's peak reserved + what torch does not hold (CUDA context)"


def main(argv: list[str] | None = None, prog: str = "finetune.py") -> int:
    """The fine-tuning entry point: ``scripts/finetune.py``, ``python -m hf_gpu_train.finetune`` (``accelerate launch -m
    hf_gpu_train.finetune``) and ``hf-gpu-train finetune``; ``prog`` names it in its usage line."""

    end_quickly()  # the interpreter's final collections after torch and transformers: seconds per rank (fast_exit.py)
    return until_the_pipe_closes(lambda: _main(argv, prog))


def _main(argv: list[str] | None, prog: str = "finetune.py") -> int:
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:

        config_path, overrides = parse_args(argv, prog)
        cfg, explicit = load_config_and_keys(config_path, overrides)
        # before torch: NCCL and CUDA read their variables once
        cfg, plan = apply_launch_plan(cfg, explicit, recipe=config_path, overrides=tuple(overrides),
                                      command_line_keys=frozenset(read_config_values(None, overrides)))
        if cfg.preemption:  # a stop signal while the model loads ends the run with exit 75 at train(), not a kill
            from ..faults.preemption import listen  # lazy: transformers, read once the config is known good

            listen()
        finetune(cfg, launch_plan=plan)
    except UsageError as error:
        report_usage_error(f"finetune: error: {error}")
        return 2
    return 0
