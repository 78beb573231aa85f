"""Predictions piling up in anyone's Trainer's evaluation: measured at its first batch, said before the memory is spent.

With a ``compute_metrics``, the evaluation loop keeps every batch's logits until the end (on the GPU, unless
``eval_accumulation_steps`` moves them to the host), then joins them for the metric (``plan/evaluation_memory.py``:
a language model's logits are rows x sequence x vocabulary). Nothing of it shows in the batch size, and the OOM comes
at the end of the first evaluation, hours in. Here, at the first prediction step of each evaluation loop, the size of
what that step kept times the rows of the set (twice: the join) is compared with the memory it will sit in:

- on a GPU, without ``eval_accumulation_steps``: more than a tenth of the GPU's free memory sets
  ``eval_accumulation_steps`` for that evaluation (the predictions then go to the host every few steps; the metrics
  are the same numbers; no collective depends on it), said once;
- on the host: more than half of its available memory, counted for every process of the machine (each holds every
  rank's predictions, gathered), is said once, with the size and the fix (``preprocess_logits_for_metrics`` reducing
  the logits to what the metric reads; the loss alone when the metric is perplexity).

A Trainer with a ``preprocess_logits_for_metrics`` (it keeps what that returns) or ``batch_eval_metrics`` (it keeps
nothing) is left alone.

The Trainer's own evaluation (its ``evaluation_loop``) is wrapped on this instance; what the metric reads cannot be
changed for the user (a metric of probabilities needs the logits): it is said, not done.
"""

from __future__ import annotations

import logging
import os

import psutil
import torch

from ..plan.evaluation_memory import JOIN_FACTOR
from ..textfmt import human

log = logging.getLogger("hf_gpu_train.oom")
GPU_SHARE = 0.10  # predictions above this share of the GPU's free memory go to the host (eval_accumulation_steps)
HOST_SHARE = 0.50  # predictions above this share of the host's available memory are said, with the fix


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class EvaluationMemoryGuard:
    """Installed by ``enable_oom_recovery``: ``trainer.evaluation_loop`` wrapped to measure its first step's predictions."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.projected_bytes: float | None = None  # the last evaluation's predictions, joined, as projected
        self._said: set[str] = set()

    def install(self) -> EvaluationMemoryGuard:
        loop = self.trainer.evaluation_loop

        def evaluation_loop(dataloader, *args, **kwargs):
            rows = _dataset_rows(dataloader)
            step, accumulation = self.trainer.prediction_step, self.trainer.args.eval_accumulation_steps
            measured = []

            def first_step_measured(*a, **kw):
                result = step(*a, **kw)
                if not measured:
                    measured.append(True)
                    self.trainer.prediction_step = step  # one step measured: the rest of the loop as it was
                    self.check(result, rows)
                return result

            self.trainer.prediction_step = first_step_measured
            try:
                return loop(dataloader, *args, **kwargs)
            finally:
                self.trainer.prediction_step = step
                self.trainer.args.eval_accumulation_steps = accumulation  # for this loop only, not saved in the args

        self.trainer.evaluation_loop = evaluation_loop
        return self

    def check(self, result, rows: int | None) -> None:
        """``result``: the first prediction step's (loss, logits, labels); ``rows``: the set's."""
        if not isinstance(result, tuple) or len(result) < 2 or result[1] is None or not rows:
            return
        args = self.trainer.args
        if self.trainer.preprocess_logits_for_metrics is not None or getattr(args, "batch_eval_metrics", False):
            return  # the Trainer keeps what the user's reduction returns, or nothing (metrics batch by batch)
        kept = list(_tensors(result[1]))
        per_batch = sum(t.numel() * t.element_size() for t in kept)
        batch_rows = next((int(t.shape[0]) for t in kept if t.dim() > 0), 0)
        if not per_batch or not batch_rows:
            return
        self.projected_bytes = per_batch / batch_rows * rows * JOIN_FACTOR
        on_gpu = any(t.is_cuda for t in kept)
        fix = ("preprocess_logits_for_metrics=... reducing them to what the metric reads (class or token ids: "
               "logits.argmax(-1)), or no compute_metrics when the metric is the loss (perplexity)")
        if on_gpu and args.eval_accumulation_steps is None:
            free, _ = torch.cuda.mem_get_info(next(t.device for t in kept if t.is_cuda))
            if self.projected_bytes > GPU_SHARE * free:
                batch_bytes = max(1, per_batch)
                args.eval_accumulation_steps = max(1, int(GPU_SHARE * free / 2 // batch_bytes))
                self._say("gpu", f"this evaluation keeps its predictions, {human(self.projected_bytes)} for {rows} rows "
                                 f"({human(per_batch / batch_rows)} a row), more than a tenth of the GPU's free "
                                 f"{human(free)}: eval_accumulation_steps={args.eval_accumulation_steps} moves them to the "
                                 f"host every {args.eval_accumulation_steps} steps (the same metrics). To keep less: {fix}")
        # every process of this machine holds every rank's predictions, gathered
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        available = psutil.virtual_memory().available
        if self.projected_bytes * local > HOST_SHARE * available:
            self._say("host", f"this evaluation keeps its predictions for compute_metrics: {human(self.projected_bytes)} "
                              f"for {rows} rows ({human(per_batch / batch_rows)} a row, joined at the end) in each of this "
                              f"machine's {local} process(es), more than half of the host's available {human(available)}: "
                              f"it may run out of memory at its end. {fix}")

    def _say(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning("hf_gpu_train: %s", message)


def _dataset_rows(dataloader) -> int | None:
    try:
        return len(dataloader.dataset)
    except (AttributeError, TypeError):
        return None


def guard_evaluation_memory(trainer) -> EvaluationMemoryGuard:
    """Once per Trainer."""
    existing = getattr(trainer, "_hf_gpu_train_evaluation_guard", None)
    if existing is not None:
        return existing
    guard = EvaluationMemoryGuard(trainer).install()
    trainer._hf_gpu_train_evaluation_guard = guard
    return guard
