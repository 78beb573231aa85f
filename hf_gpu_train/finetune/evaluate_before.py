"""The evaluation of the model as loaded, for the comparison a run ends with (``evaluate_before``).

Why at train begin, not before ``trainer.train()``: an evaluation before training would be the first to prepare the
model with accelerate, in evaluation mode, and then training prepares it again: measured on 2 gloo processes, the
run then trained other weights than the same run without the evaluation (torch.compile would even leave the model
outside DDP). At ``on_train_begin`` the model is already prepared as it trains, and the evaluation takes the path of
any evaluation during training, which tests/scaling shows changes nothing; the watchdog and the CPU-by-accident guard
(both on_train_begin too, attached before) are already on. The random generators are put back after it: building the
evaluation DataLoader's iterator draws a seed from torch's generator, and the training sampler's order comes next.

Every rank takes the same decision from the same config and validation set (and the ranks agree on both,
``agreement.py``); rank 0 writes ``baseline_results.json``, which a resumed run reads back for its last line.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_utils import has_length

from ..report.story import baseline_sample
from .fsdp import fsdp_requested
from .run_record import SHOWN_METRICS

BASELINE = "baseline_results.json"
# The figure before training is a reference the run's last line compares with, not the result: above SAMPLE_ROWS
# validation rows it is measured on a seeded sample of that many (said on the line and in baseline_results.json), at a
# bounded cost however large the validation set (issue 40: on a fast GPU a short fine-tune is mostly fixed work).
# 512 rows put accuracy's standard error at most 0.022 (+-0.044 at 95%), below what a fine-tune moves it; macro F1
# over many classes of few rows each, and the loss of a model that is sure and wrong, vary more than that on a sample.
SAMPLE_ROWS = 512
SAMPLE_SEED = 0  # the same rows on every rank and in every run of the same validation set
# evaluate_before=auto: the evaluation first is worth it when it costs little beside the training. Rows are the
# measure (each evaluated row is one forward, each trained row a forward and a backward, about three forwards, of rows
# of the same shape: the same max_length, image size, packing); evaluating at most a quarter of the rows the training
# processes adds under about a tenth to the run, and at most SMALL_VALIDATION_ROWS is seconds anyway.
SMALL_VALIDATION_ROWS = 256
TRAINED_ROWS_SHARE = 0.25


def sample_rows(validation_rows: int) -> int:
    """How many validation rows the evaluation before training reads."""
    return min(validation_rows, SAMPLE_ROWS)


def sample_indices(validation_rows: int) -> list[int] | None:
    """The seeded sample's row indices in the dataset's order (longest first stays longest first); None: every row."""
    if validation_rows <= SAMPLE_ROWS:
        return None
    return sorted(random.Random(SAMPLE_SEED).sample(range(validation_rows), SAMPLE_ROWS))


@contextlib.contextmanager
def untouched_random_state():
    """Python's, NumPy's and torch's generators (every CUDA device's too) as they were before the block."""

    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def why_not(evaluate_before: bool | str, validation_rows: int, sharded: bool, trained_rows: float | None = None) -> str:
    """'' when the run evaluates before training, else the reason it does not. ``trained_rows``: the rows the training
    processes over the run (every epoch, every process), None when unknown."""
    if evaluate_before is True:
        return ""
    if evaluate_before is False:
        return "evaluate_before=false"
    rows = sample_rows(validation_rows)
    if trained_rows is not None and rows > SMALL_VALIDATION_ROWS and rows > TRAINED_ROWS_SHARE * trained_rows:
        return (f"its {rows} validation rows{' (a sample)' if rows < validation_rows else ''} would cost more than about a "
                f"tenth of the training's {trained_rows:.0f} rows (auto: at most {TRAINED_ROWS_SHARE:g} of them, or "
                f"{SMALL_VALIDATION_ROWS} rows)")
    if sharded:
        return "the model is sharded (FSDP, DeepSpeed): a model that large evaluates for long"
    return ""


def sample_words(baseline: dict, word: str = "rows") -> str:
    """' on a sample of 512 of 5000 validation rows' when the figure before training is a sample's, else ''."""
    sample = baseline_sample(baseline)
    return f" on a sample of {sample[0]} of {sample[1]} validation {word}" if sample else ""


class EvaluateBeforeTraining(TrainerCallback):
    """At the first ``on_train_begin``: ``trainer.evaluate()`` (on the seeded sample above ``SAMPLE_ROWS`` rows) with the
    generators put back; ``baseline`` holds the figures and the rows they were measured on, with what the task derives from them (``derive``: a causal LM's perplexity, ``Task.final_metrics``), and
    rank 0 writes them to ``output_dir/baseline_results.json``."""

    def __init__(self, trainer, output_dir: str | Path, derive=lambda metrics: metrics):
        self.trainer = trainer
        self.file = Path(output_dir) / BASELINE
        self.derive = derive
        self.baseline: dict | None = None
        self.seconds = 0.0  # what it took: inside trainer.train(), not training
        self.done = False

    def on_train_begin(self, args, state, control, **kwargs):
        if self.done:
            return
        self.done = True
        started = time.perf_counter()
        validation = self.trainer.eval_dataset
        rows = len(validation) if has_length(validation) and not isinstance(validation, dict) else None  # None has none
        chosen = sample_indices(rows) if rows is not None else None
        with untouched_random_state(), _loader_not_kept(self.trainer, chosen is not None):
            metrics = self.trainer.evaluate(**({} if chosen is None else {"eval_dataset": _subset(validation, chosen)}))
        self.seconds = time.perf_counter() - started
        metrics = self.derive(metrics)
        self.baseline = {k: v for k, v in metrics.items() if k in SHOWN_METRICS}
        if rows is not None:
            self.baseline.update(rows=sample_rows(rows), validation_rows=rows)
        if self.trainer.is_world_process_zero():
            self.file.write_text(json.dumps(self.baseline, indent=2))


@contextlib.contextmanager
def _loader_not_kept(trainer, sampled: bool):
    """With ``dataloader_persistent_workers`` the Trainer keeps an evaluation's DataLoader under "eval" and hands it
    to every later evaluation, even one built from a dataset passed in (transformers 5): the sample's must not become
    the validation set's, and one kept before must not replace the sample. Both put back as they were."""
    kept = getattr(trainer, "_eval_dataloaders", None)
    earlier = kept.pop("eval", None) if sampled and isinstance(kept, dict) else None
    try:
        yield
    finally:
        now = getattr(trainer, "_eval_dataloaders", None)
        if sampled and isinstance(now, dict):
            now.pop("eval", None)
            if earlier is not None:
                now["eval"] = earlier


def _subset(dataset, indices: list[int]):
    if hasattr(dataset, "select"):  # a datasets.Dataset: its own subset keeps its columns and format
        return dataset.select(indices)
    from torch.utils.data import Subset

    return Subset(dataset, indices)


def attach_evaluate_before(evaluate_before: bool | str, output_dir: str | Path, trainer, validation_rows: int, resuming: bool,
                           trained_rows: float | None = None, derive=lambda metrics: metrics) -> EvaluateBeforeTraining | None:
    """The callback when this run evaluates first (``evaluate_before``: the config's true/false/auto; attach it after the
    watchdog and the guards; ``derive``: the task's ``final_metrics``); None when it does not, saying why under
    ``auto``, and removing an earlier start's baseline_results.json from ``output_dir``, which is not this run's."""

    if resuming:  # the run evaluated when it first started: its file stays
        return None
    reason = why_not(evaluate_before, validation_rows, fsdp_requested() or bool(getattr(trainer, "is_deepspeed_enabled", False)),
                     trained_rows)
    if reason:
        if trainer.is_world_process_zero():
            (Path(output_dir) / BASELINE).unlink(missing_ok=True)
            if evaluate_before == "auto":
                print(f"hf_gpu_train: no evaluation before training: {reason} (evaluate_before=true to ask for it)", flush=True)
        return None
    callback = EvaluateBeforeTraining(trainer, output_dir, derive=derive)
    trainer.add_callback(callback)
    return callback


def read_baseline(output_dir: str | Path) -> dict | None:
    """What the run's evaluation before training scored (a resumed run evaluated when it first started)."""
    try:
        return json.loads((Path(output_dir) / BASELINE).read_text())
    except (OSError, ValueError):
        return None


def trained_rows(max_steps: int | None, num_train_epochs: float, train_rows: int, effective_batch: int) -> float:
    """The rows the training processes over the run: ``max_steps`` optimizer steps of the effective batch, else every
    epoch of the training set."""
    if max_steps and max_steps > 0:
        return float(max_steps * effective_batch)
    return float(train_rows * num_train_epochs)
