"""The token-classification task's data and model: JSON-lines rows of words and tags, the tag set from the training
rows, each word's tag on its first sub-token, the encoder with a token-classification head."""

from __future__ import annotations

from dataclasses import dataclass

from datasets import load_dataset
from transformers import AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification

from hf_gpu_train.finetune.config import ConfigError
from hf_gpu_train.finetune.tasks import Prepared
from hf_gpu_train.finetune.tasks.model_dirs import resolve_model_path


@dataclass
class TaggedData:
    train: object
    validation: object
    label_names: list[str]
    notes: list[str]


def prepare_token_classification(cfg, runtime, say) -> Prepared:
    if not (cfg.train_file and cfg.validation_file):
        raise ConfigError("task=token-classification reads train_file= and validation_file= (JSON lines of words and tags)")
    raw = load_dataset("json", data_files={"train": cfg.train_file, "validation": cfg.validation_file})
    names = sorted({tag for row in raw["train"][cfg.tags_column] for tag in row})
    index = {name: i for i, name in enumerate(names)}
    path = resolve_model_path(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForTokenClassification.from_pretrained(path, num_labels=len(names), id2label=dict(enumerate(names)),
                                                            label2id=index)
    if cfg.learning_rate is None:
        cfg.learning_rate = 5e-5

    def encode(batch):
        encoded = tokenizer(batch[cfg.tokens_column], is_split_into_words=True, truncation=True, max_length=cfg.max_length)
        labels = []
        for row, tags in enumerate(batch[cfg.tags_column]):
            words, previous, row_labels = encoded.word_ids(row), None, []
            for word in words:
                row_labels.append(-100 if word is None or word == previous else index.get(tags[word], -100))
                previous = word
            labels.append(row_labels)
        encoded["labels"] = labels
        return encoded

    columns = raw["train"].column_names
    train = raw["train"].map(encode, batched=True, remove_columns=columns)
    validation = raw["validation"].map(encode, batched=True, remove_columns=columns)
    data = TaggedData(train, validation, names, [f"{len(train)} train / {len(validation)} validation sentences, tags {names}"])
    say(data.notes)
    return Prepared(model, train, validation, DataCollatorForTokenClassification(tokenizer), tokenizer, data)
