"""The numpy accuracy and macro F1 against scikit-learn's definitions, and the Trainer hook around them."""

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, f1_score
from transformers import EvalPrediction

from hf_gpu_train.finetune.metrics import accuracy_and_macro_f1, compute_classification_metrics


def sklearn_figures(predictions, references):
    return {"accuracy": accuracy_score(references, predictions), "f1": f1_score(references, predictions, average="macro")}


@pytest.mark.parametrize("seed", range(6))
def test_random_predictions_score_what_scikit_learn_scores(seed):
    rng = np.random.default_rng(seed)
    classes = int(rng.integers(2, 9))
    references = rng.integers(0, classes, size=int(rng.integers(5, 300)))
    predictions = np.where(rng.random(references.size) < 0.6, references, rng.integers(0, classes + 1, references.size))
    ours, theirs = accuracy_and_macro_f1(predictions, references), sklearn_figures(predictions, references)
    assert ours == pytest.approx(theirs, abs=1e-12)


@pytest.mark.parametrize("predictions, references", [
    ([0, 0, 0, 0], [0, 1, 2, 1]),  # one class predicted: the others score 0
    ([3, 3, 1, 1], [0, 0, 0, 0]),  # classes that exist only among the predictions count too
    ([1, 0, 1, 0], [1, 0, 1, 0]),  # perfect
    ([7], [7]),
])
def test_degenerate_predictions_score_what_scikit_learn_scores(predictions, references):
    assert accuracy_and_macro_f1(predictions, references) == pytest.approx(sklearn_figures(predictions, references), abs=1e-12)


def test_the_trainer_hook_takes_class_ids_or_logits():
    references = np.array([0, 1, 2, 2, 1])
    class_ids = np.array([0, 2, 2, 2, 1])
    logits = np.eye(3)[class_ids] * 5.0
    expected = sklearn_figures(class_ids, references)
    assert compute_classification_metrics(EvalPrediction(predictions=class_ids, label_ids=references)) == pytest.approx(expected)
    assert compute_classification_metrics(EvalPrediction(predictions=(logits,), label_ids=references)) == pytest.approx(expected)


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError, match="3 predictions for 2 labels"):
        accuracy_and_macro_f1([0, 1, 1], [0, 1])
