"""Accuracy and macro F1 as an ``evaluate`` module that loads offline: the plain Trainer anchor's metrics.

HF's guides compute metrics with ``evaluate.load("accuracy")`` (and "f1"), which needs the hub;
``evaluate.load(<this directory>)`` is the same path offline.
One import per line: evaluate scans this file's imports and misreads combined ones.
"""

import datasets
import evaluate
from sklearn.metrics import accuracy_score
from sklearn.metrics import f1_score

_DESCRIPTION = "Accuracy and macro-averaged F1 for single-label classification."
_KWARGS = "predictions: list of int class ids; references: list of int class ids."


class ClassificationMetrics(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        return {
            "accuracy": float(accuracy_score(references, predictions)),
            "f1": float(f1_score(references, predictions, average="macro")),
        }
