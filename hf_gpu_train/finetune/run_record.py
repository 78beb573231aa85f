"""What a run in ``output_dir`` was, so a second command into the same directory never surprises.

``hf_gpu_train_run.json`` records the values that decide the model a run produces: every config key except
the ones that only change how it is watched or stored (``OUTPUT_ONLY``), plus what ``auto`` resolved to
(precision) and the effective batch (per-device batch x accumulation x processes; the per-device batch alone
does not change the training: 2 processes of 8 train the model 1 process of 16 does, tests/scaling).

Before anything is loaded or written, ``check_previous_run`` compares the new command with the record:
- same training, run finished: report its results, train nothing;
- same training, not finished: resume (``resume=auto``), whatever the number of processes;
- different training: exit 2 naming the keys that differ, with the choices; nothing is overwritten. An
  explicit ``resume=PATH`` continues on purpose with the new values (the old config is kept as a backup).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .checkpoints import checkpoints, is_main_process
from .config import ConfigError, FinetuneConfig
from .recipe_names import FILE_KEYS, portable

log = logging.getLogger("hf_gpu_train.finetune")
RECORD = "hf_gpu_train_run.json"
CONFIG = "finetune_config.yaml"
OUTPUT_ONLY = frozenset({
    "output_dir", "per_device_train_batch_size", "global_batch_size", "per_device_eval_batch_size", "precision",
    "gradient_checkpointing", "checkpoint_layers", "offload_activations", "torch_compile", "dataloader_num_workers", "eval_strategy", "eval_steps", "save_strategy",
    "save_steps", "save_total_limit", "checkpoint_minutes", "mtbf_hours", "background_saves", "logging_steps", "resume", "report_to", "allow_cpu", "telemetry", "oom_recovery",
    "max_eval_samples", "generation_samples", "generation_max_new_tokens", "merge_adapter", "evaluate_before",
})
# Resolved only once the model is built (finetune/learning_rates.py): None before that means "not known yet", and is
# not compared; the run compares again, and records the number, after the model loads.
RESOLVED_WITH_THE_MODEL = ("learning_rate",)

# The metrics a run prints at its end and records (the evaluation before training keeps the same), in words.
SHOWN_METRICS = {"eval_accuracy": "accuracy", "eval_f1": "macro F1", "eval_loss": "eval loss", "eval_perplexity": "perplexity"}


EVALUATION = ("max_eval_samples",)  # keys that change the reported results, not the model


@dataclass(frozen=True)
class RunIdentity:
    training: dict[str, Any]  # the config keys that change the model, as resolved
    precision: str  # bf16 | fp16 | fp32, after "auto"
    effective_batch: int
    evaluation: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the results were measured on

    @classmethod
    def of(cls, cfg: FinetuneConfig, precision: str, effective_batch: int) -> RunIdentity:
        values = {k: v for k, v in cfg.values().items() if k not in OUTPUT_ONLY}
        values.update({k: portable(values[k]) for k in FILE_KEYS if isinstance(values.get(k), str)})  # not the install's path
        return cls(training=json.loads(json.dumps(values, default=str)), precision=precision, effective_batch=effective_batch,
                   evaluation={k: getattr(cfg, k) for k in EVALUATION})

    def differences(self, before: dict) -> list[tuple[str, Any, Any]]:
        """(key, before, now) for each value that differs from a record (keys the record lacks are not compared)."""
        diffs = [(k, before["training"][k], v) for k, v in self.training.items()
                 if k in before.get("training", {}) and before["training"][k] != v
                 and not (v is None and k in RESOLVED_WITH_THE_MODEL)]
        for key in ("precision", "effective_batch"):
            if before.get(key) is not None and before[key] != getattr(self, key):
                diffs.append((key, before[key], getattr(self, key)))
        return diffs


@dataclass(frozen=True)
class Previous:
    record: dict | None  # None: no earlier run in output_dir
    finished: bool
    results: dict | None


def read_previous(output_dir: str | Path) -> Previous:
    out = Path(output_dir)
    record_path, config_path = out / RECORD, out / CONFIG
    if record_path.is_file():
        record = json.loads(record_path.read_text())
    elif config_path.is_file():  # written by an earlier version: the config alone
        saved = yaml.safe_load(config_path.read_text()) or {}
        record = {"training": {k: v for k, v in saved.items() if k not in OUTPUT_ONLY}}
    else:
        return Previous(None, False, None)
    results_path = out / "eval_results.json"
    finished = bool(record.get("finished")) and results_path.is_file()
    return Previous(record, finished, json.loads(results_path.read_text()) if finished else None)


def resume_batch_fix(effective: int, micro: int, processes: int) -> str:
    """The keys that give ``effective`` again on ``processes`` processes: accumulation is a whole number, so the
    per-device batch x processes must divide the effective batch (48 on 2 processes of 16 would round up to 64)."""
    processes = max(1, processes)
    head = "the effective batch is per-device batch x accumulation x processes"
    candidate = batch_on(effective, micro, processes)
    if candidate is not None:
        keys = f"global_batch_size={effective}"
        if candidate != micro:
            keys += f" per_device_train_batch_size={candidate}"
        return f"{head}: set {keys} to resume it on {processes} process(es)"
    return (f"{head}: {effective} cannot be split evenly over {processes} processes; resume it with a number of processes "
            f"that divides {effective}")


def batch_on(effective: int, micro: int, processes: int) -> int | None:
    """The largest per-device batch up to ``micro`` whose ``x processes`` divides ``effective`` (accumulation is a whole
    number), or None."""
    for candidate in range(min(micro, effective // max(1, processes)), 0, -1):
        if effective % (candidate * max(1, processes)) == 0:
            return candidate
    return None


def keep_the_global_batch(cfg: FinetuneConfig, identity: RunIdentity, previous: Previous,
                          processes: int) -> tuple[dict[str, int], str] | None:
    """A run continued on another number of processes than the one that wrote its checkpoints (a requeued job on fewer
    nodes, a shrunken spot pool, a single-GPU resume): the same command keeps the run's global batch, accumulation
    adjusted (and the per-device batch, when it does not divide), said in one line. (changes to the config, the line),
    or None where nothing is to adjust: the same number of processes, another difference than the effective batch,
    a ``global_batch_size`` the user set to another value (a change on purpose: refused as before), or a batch that
    cannot be split over ``processes``.

    The data position follows: accelerate shards each step's global batch over the processes in the sampler's order, so
    after k steps of the same global batch the first k x global batch rows of the epoch's order were consumed, on any
    number of processes (a length-grouped sampler's order depends on the per-step batch: it is kept only where the
    per-device batch is). The optimizer's state under DDP is whole on every rank: nothing to re-shard."""
    record = previous.record
    if record is None or cfg.resume != "auto" or record.get("processes") in (None, processes):
        return None
    if [k for k, _, _ in identity.differences(record)] != ["effective_batch"]:
        return None
    effective = int(record["effective_batch"])
    if cfg.global_batch_size not in (None, effective):
        return None
    micro = batch_on(effective, cfg.per_device_train_batch_size, processes)
    if micro is None:
        return None
    changes = {"global_batch_size": effective}
    if micro != cfg.per_device_train_batch_size:
        changes["per_device_train_batch_size"] = micro
    accumulation = effective // (micro * processes)
    line = (f"resuming a run of {record['processes']} process(es) on {processes}: its global batch of {effective} kept "
            f"(per-device batch {micro} x accumulation {accumulation} x {processes} process(es))")
    return changes, line


def check_previous_run(cfg: FinetuneConfig, identity: RunIdentity, previous: Previous, processes: int = 1) -> str:
    """"new", "resume" or "finished"; a ConfigError when the earlier run trained something else."""
    if previous.record is None:
        return "new"
    diffs = identity.differences(previous.record)
    if not diffs:
        if previous.finished and cfg.resume == "auto" and previous.record.get("evaluation", {}) == identity.evaluation:
            return "finished"
        return "resume"  # the same training (evaluated on other samples: evaluated again)
    listed = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, a, b in diffs)
    if cfg.resume not in ("auto", "never"):
        log.warning("resume=%s continues a run with other settings, on purpose: %s", cfg.resume, listed)
        return "resume"
    if not previous.record.get("finished") and not checkpoints(cfg.output_dir):
        # an earlier start that stopped before its first checkpoint (a typo, an OOM at micro-batch 1): nothing trained
        # to lose; its config and record are kept as backups when they are replaced
        log.warning("output_dir=%r holds an earlier start that saved no checkpoint (%s): starting anew", cfg.output_dir, listed)
        return "new"
    hint = ""
    if any(k == "effective_batch" for k, _, _ in diffs):
        hint = f" ({resume_batch_fix(previous.record['effective_batch'], cfg.per_device_train_batch_size, processes)})"
    raise ConfigError(
        f"output_dir={cfg.output_dir!r} holds a run that trained differently: {listed}{hint}. Nothing was changed. "
        f"Choose: output_dir=NEW_DIR for a new run; the earlier values to continue it; or resume=PATH/checkpoint-N to "
        f"continue from a checkpoint with the new values on purpose")


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def write_record(output_dir: str | Path, identity: RunIdentity, processes: int, finished: bool = False,
                 global_step: int | None = None) -> None:
    """On the main process; the resolved config beside it, an earlier different one kept as a backup."""
    if not is_main_process():
        return
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RECORD
    record = {"training": identity.training, "precision": identity.precision, "effective_batch": identity.effective_batch,
              "evaluation": identity.evaluation, "processes": processes, "finished": finished, "global_step": global_step,
              "time": time.time()}
    if path.is_file() and not finished:
        earlier = json.loads(path.read_text())
        if identity.differences(earlier):
            path.rename(out / f"{RECORD}.{int(time.time())}.bak")
    path.write_text(json.dumps(record, indent=2))


def back_up_config(output_dir: str | Path, cfg: FinetuneConfig) -> None:
    """Keep an earlier, different finetune_config.yaml before the resolved one replaces it."""
    path = Path(output_dir) / CONFIG
    if not (is_main_process() and path.is_file()):
        return
    saved = yaml.safe_load(path.read_text()) or {}
    if saved != json.loads(json.dumps(cfg.values(), default=str)):
        path.rename(path.with_name(f"finetune_config.{int(time.time())}.yaml"))
