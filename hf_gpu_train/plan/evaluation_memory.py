"""An evaluation's own memory: the predictions the Trainer keeps until the end of the evaluation.

Users' most common evaluation OOM is not a batch too big but predictions piling up. With a ``compute_metrics``, the
Trainer's evaluation loop keeps every batch's logits (rows x sequence x vocabulary for a language model), on the GPU
until the end unless ``eval_accumulation_steps`` moves them to the host every few steps, then joins them (padded to
the longest batch) into one array for the metric: twice their size at that moment (transformers issues 8476, 12878).
Measured here (a Llama with a 32,000-token vocabulary, sequences of 64, fp32 logits): 16 rows raised the process's peak
memory by 262 MiB, 128 rows by 2,012 MiB; the loss alone, 136 MiB for either.

What avoids it: no logits when the metric is the loss (perplexity), logits reduced to what the metric reads
(``preprocess_logits_for_metrics``: a classifier's class ids), and ``eval_accumulation_steps`` (predictions on the
host, not the GPU). ``scripts/finetune.py`` does the first two by task; ``oom/evaluation_memory.py`` says it in
anyone's Trainer before the memory is spent. No torch here: the planner's figure comes from the model's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..textfmt import human

JOIN_FACTOR = 2  # the kept batches, and the array they are joined into for the metric, at the same moment


@dataclass(frozen=True)
class EvaluationMemory:
    """What an evaluation of ``rows`` keeps: with the logits (a Trainer's ``compute_metrics`` as given), and as kept."""

    rows: int
    logits_bytes: float  # rows x sequence x vocabulary (or classes) x bytes, joined: the peak of a Trainer keeping logits
    kept_bytes: float  # what the chosen evaluation keeps
    kept: str  # "the loss only", "class ids", "the logits"

    def reason(self) -> str:
        """One line for the plan's reasons."""
        if self.kept == "the logits":
            return (f"evaluation: the logits of {self.rows} rows kept for compute_metrics, {human(self.logits_bytes)} at the "
                    "end of each evaluation: preprocess_logits_for_metrics reducing them to what the metric reads, and "
                    "eval_accumulation_steps (on the host, not the GPU)")
        return (f"evaluation keeps {self.kept}, {human(self.kept_bytes)} for {self.rows} rows, instead of their logits "
                f"({human(self.logits_bytes)} with a compute_metrics reading them)")


def evaluation_memory(rows: int, seq_len: int, outputs_per_position: int, language_model: bool, kept: str,
                      bytes_per_value: int = 4) -> EvaluationMemory:
    """``outputs_per_position``: the vocabulary of a language model, the classes of a classifier (one position a row).
    ``kept``: what the evaluation keeps ("the loss only", "class ids", "the logits")."""
    positions = seq_len if language_model else 1
    logits = float(rows) * positions * outputs_per_position * bytes_per_value * JOIN_FACTOR
    kept_bytes = {"the loss only": 4.0 * rows, "class ids": 8.0 * rows * JOIN_FACTOR, "the logits": logits}[kept]
    return EvaluationMemory(rows=rows, logits_bytes=logits, kept_bytes=kept_bytes, kept=kept)
