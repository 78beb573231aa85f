"""Accuracy and macro F1 for the classification tasks, in numpy.

Why not an ``evaluate`` module: loading one costs ~0.8 s per process even with datasets and torch already imported
(the import of ``evaluate`` and scikit-learn, a copy of the module's script, an Arrow cache for its inputs), which
is more than the whole evaluation of a small validation set. Both figures are two lines of counting. The
definitions are scikit-learn's (``accuracy_score``; ``f1_score(average="macro")``: the mean over every class that
occurs in the labels or the predictions, a class never predicted correctly scoring 0), and the tests hold them
equal to scikit-learn's on random and degenerate inputs.
"""

from __future__ import annotations

import numpy as np


def accuracy_and_macro_f1(predictions, references) -> dict[str, float]:
    predicted, true = np.asarray(predictions).reshape(-1), np.asarray(references).reshape(-1)
    if predicted.shape != true.shape:
        raise ValueError(f"{predicted.size} predictions for {true.size} labels")
    if true.size == 0:
        return {"accuracy": 0.0, "f1": 0.0}
    classes, index = np.unique(np.concatenate([predicted, true]), return_inverse=True)  # every class either side names
    predicted_index, true_index = index[:predicted.size], index[predicted.size:]
    hit = predicted == true
    true_positive = np.bincount(true_index[hit], minlength=classes.size)
    counted = np.bincount(predicted_index, minlength=classes.size) + np.bincount(true_index, minlength=classes.size)
    f1 = 2.0 * true_positive / counted  # 2 tp / (2 tp + fp + fn); never 0/0: each class occurs on one side at least
    return {"accuracy": float(hit.mean()), "f1": float(f1.mean())}


def compute_classification_metrics(eval_prediction) -> dict[str, float]:
    """Trainer ``compute_metrics``: predictions are already class ids (argmax before gathering)."""
    predictions = eval_prediction.predictions
    if isinstance(predictions, tuple):
        predictions = predictions[0]
    predictions = np.asarray(predictions)
    if predictions.ndim > 1:  # logits slipped through: take the class
        predictions = predictions.argmax(-1)
    return accuracy_and_macro_f1(predictions, eval_prediction.label_ids)


def logits_to_class_ids(logits, labels):
    """Trainer ``preprocess_logits_for_metrics``: gather class ids, not (batch x classes) logits, so
    evaluation memory does not grow with the number of classes."""
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)
