"""Offline ``evaluate`` metric modules shipped with the package."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

METRIC_DIR = Path(__file__).parent / "classification_metrics"


@lru_cache(maxsize=1)
def classification_metric():
    import evaluate

    return evaluate.load(str(METRIC_DIR))


def compute_classification_metrics(eval_prediction) -> dict[str, float]:
    """Trainer ``compute_metrics``: predictions are already class ids (argmax before gathering)."""
    predictions = eval_prediction.predictions
    if isinstance(predictions, tuple):
        predictions = predictions[0]
    predictions = np.asarray(predictions)
    if predictions.ndim > 1:  # logits slipped through: take the class
        predictions = predictions.argmax(-1)
    return classification_metric().compute(predictions=predictions.tolist(), references=np.asarray(eval_prediction.label_ids).tolist())


def logits_to_class_ids(logits, labels):
    """Trainer ``preprocess_logits_for_metrics``: gather class ids, not (batch x classes) logits, so
    evaluation memory does not grow with the number of classes."""
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)
