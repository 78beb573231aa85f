"""What telemetry hands the ``report_to`` trackers beyond the numbers it logs through ``Trainer.log``.

Telemetry's window figures (``gpu{i}/...``, ``loop/...``, ``torch/...``, ``host/...``) reach every tracker the Trainer
runs (TensorBoard, MLflow, Weights & Biases) through the base ``Trainer.log``. Two things do not get there that way:

- the per-rank summaries (``callbacks/ranks.py``) and the verdict live in the window's record, not in its numbers:
  ``tracker_metrics(record)`` turns them into numbers (``rank{r}/step_time_s``, ``rank{r}/straggler`` as 0/1,
  ``telemetry/verdict_code``) for telemetry to log with the window's own;
- text: the integration callbacks drop a string (MLflow's) or keep it as a step value (W&B's, TensorBoard's) only when it
  rides in a log dict, and our console printer would print it. ``publish_texts`` hands each text to each running
  tracker the way that tracker shows text: a TensorBoard text summary (the TEXT tab, one entry per step), an MLflow run
  tag (the latest, on the run's page), a W&B history value (the latest also in the run's summary).

Called from rank 0's log steps; nothing here may cost the run its training: a tracker that fails is said once and
skipped. The trackers are found among the Trainer's callbacks by the class names transformers gives its integrations
(``transformers.integrations.integration_utils``), subclasses included (DagsHub's is an MLflow callback), so neither
mlflow nor wandb is imported unless the Trainer already runs it.
"""

from __future__ import annotations

import logging
from typing import Any

from .verdicts import Verdict

log = logging.getLogger("hf_gpu_train.telemetry")

# telemetry/verdict_code: a verdict kind as a number a tracker can chart. Stable: a code never changes meaning; a new kind
# gets the next free number. Ordered as judge() ranks the causes (callbacks/verdicts.py): the higher, the more it explains.
VERDICT_CODES = {"healthy": 0, "under-utilized": 1, "memory-pressure": 2, "data-bound": 3, "throttled": 4}
UNKNOWN_VERDICT_CODE = -1  # a kind this table does not hold yet
# per-rank figures from callbacks/ranks.gather_ranks, logged as rank{r}/<field> when known
RANK_FIELDS = ("step_time_s", "own_step_time_s", "data_wait_pct", "tokens", "mem_used_gib", "torch_mem_allocated_gib")
VERDICT_TEXT_KEY = "telemetry/verdict"
STRAGGLER_TEXT_KEY = "telemetry/straggler"
HEALTH_TEXT_KEY = "telemetry/gpu_health"
TENSORBOARD, MLFLOW, WANDB = "TensorBoardCallback", "MLflowCallback", "WandbCallback"
_warned: set[str] = set()  # trackers that failed once in this process (said once, then quiet)


def verdict_code(kind: str) -> int:
    return VERDICT_CODES.get(kind, UNKNOWN_VERDICT_CODE)


def rank_metrics(record: dict) -> dict[str, float]:
    """A window's per-rank summaries as numbers: ``rank{r}/<field>`` for each of ``RANK_FIELDS`` that is known,
    ``rank{r}/straggler`` (1.0 or 0.0) and ``telemetry/uneven_memory`` (1.0 or 0.0). Empty for one process (no ranks)."""
    entries = record.get("ranks") or []
    ranks = [entry for entry in entries if "rank" in entry]
    if not ranks:
        return {}
    out: dict[str, float] = {}
    for entry in ranks:
        prefix = f"rank{entry['rank']}/"
        for field in RANK_FIELDS:
            value = entry.get(field)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[prefix + field] = float(value)
        out[prefix + "straggler"] = 1.0 if entry.get("straggler") else 0.0
    out["telemetry/uneven_memory"] = 1.0 if any(entry.get("uneven_memory") for entry in entries) else 0.0
    return out


def tracker_metrics(record: dict) -> dict[str, float]:
    """The numbers a window's record adds to its logged figures: ``telemetry/verdict_code`` and ``rank_metrics``."""
    out = {"telemetry/verdict_code": float(verdict_code(record["verdict"]["kind"]))} if record.get("verdict") else {}
    out.update(rank_metrics(record))
    return out


def tracker_texts(record: dict) -> dict[str, str]:
    """The texts a window's record hands the trackers: its verdict line (kind, evidence, next step, notes), while
    telemetry names a straggler rank (``callbacks/arrivals.py``) that finding's line, and the GPU health events rank 0
    saw in the window (``hardware/health.py``: each rank's own GPUs; another rank's are in its log and telemetry.jsonl)."""
    texts = {VERDICT_TEXT_KEY: Verdict.from_dict(record["verdict"]).line()} if record.get("verdict") else {}
    straggler = record.get("straggler")
    if isinstance(straggler, dict) and straggler.get("line"):
        texts[STRAGGLER_TEXT_KEY] = straggler["line"]
    health = [e for e in record.get("gpu_health") or [] if isinstance(e, dict) and e.get("message")]
    if health:
        texts[HEALTH_TEXT_KEY] = "; ".join(f"rank {e.get('rank')}: {e['message']} (fix: {e.get('fix')})" for e in health)
    return texts


def active_trackers(trainer) -> dict[str, Any]:
    """The Trainer's running integration callbacks by the transformers class they are (or derive from)."""
    found: dict[str, Any] = {}
    handler = getattr(trainer, "callback_handler", None)
    for callback in getattr(handler, "callbacks", ()):
        for cls in type(callback).__mro__:
            if cls.__name__ in (TENSORBOARD, MLFLOW, WANDB) and cls.__module__.startswith("transformers."):
                found.setdefault(cls.__name__, callback)
    return found


def publish_texts(trainer, step: int, texts: dict[str, str]) -> None:
    """Each ``key: text`` to each tracker the Trainer runs, at ``step``; on the world's process zero only. Never raises."""
    if not texts or not trainer.is_world_process_zero():
        return
    for name, callback in active_trackers(trainer).items():
        try:
            _SENDERS[name](callback, step, texts)
        except Exception as error:  # a tracker's failure must never stop the training
            if name not in _warned:
                _warned.add(name)
                log.warning("telemetry: %s did not take the verdict text (%s: %s); its numbers still go through "
                            "Trainer.log, and this is said once", name, type(error).__name__, error)


def _to_tensorboard(callback, step: int, texts: dict[str, str]) -> None:
    writer = callback.tb_writer  # None before train begin and after train end (the callback closed it)
    if writer is None:
        return
    for key, text in texts.items():
        writer.add_text(key, text, step)
    writer.flush()


def _to_mlflow(callback, step: int, texts: dict[str, str]) -> None:
    import mlflow  # the Trainer's MLflowCallback imported it already
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    if mlflow.active_run() is None:  # ended (train end), or never started: set_tag would start a run of its own
        return
    # a tag holds the latest; the callback logs its own metrics asynchronously, so do the tags (flushed by end_run)
    mlflow.set_tags({key: text[:MAX_TAG_VAL_LENGTH] for key, text in texts.items()}, synchronous=False)


def _to_wandb(callback, step: int, texts: dict[str, str]) -> None:
    import wandb  # the Trainer's WandbCallback imported it already

    run = wandb.run
    if run is None:
        return
    # train/global_step: the x axis the WandbCallback defines for every key ("*"), so the text lines up with the numbers
    run.log({**texts, "train/global_step": step})


_SENDERS = {TENSORBOARD: _to_tensorboard, MLFLOW: _to_mlflow, WANDB: _to_wandb}
