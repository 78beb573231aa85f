"""Load, split, check and label-encode the data for classification, from any of the supported sources.

Sources: ``builtin:text`` / ``builtin:digits``; ``train_file`` / ``validation_file`` (csv, json,
jsonl, parquet); ``imagefolder:DIR`` (one sub-directory per class); anything else is passed to
``datasets.load_dataset`` (a hub id in a user's world, a local dataset directory here).

Two phases, so that a mistake costs seconds, not a pass over the data: ``open_classification_data`` loads
and checks what is cheap to check (files, splits, columns, labels, whether a validation carve is possible);
``process_classification_data`` does the passes over every row (label encoding, the carve, sampling,
opening every image). The entry point loads the model between the two.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .builtin import BUILTIN_DATASETS
from .carve import CarvePlan, carve, plan_carve
from .config import ConfigError, DataKeys

FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
IMAGE_VERIFY_LIMIT = 50_000


@dataclass
class ClassificationData:
    train: object  # datasets.Dataset with a "labels" int column
    validation: object
    label_names: list[str]
    source: str
    notes: list[str] = field(default_factory=list)  # what the user should be told before training (printed by the entry point)


@dataclass
class OpenedData:
    """The data after the cheap checks: loaded but not processed; columns and labels checked, the carve planned."""

    train: object  # datasets.Dataset, raw label column
    validation: object | None  # None: carved by ``carve_plan``
    label_names: list[str]
    source: str
    carve_plan: CarvePlan | None


def _builder_for(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FILE_BUILDERS:
        raise ConfigError(f"{path}: unsupported file type {suffix or '(none)'}; use .csv, .json, .jsonl or .parquet")
    return FILE_BUILDERS[suffix]


def load_raw(keys: DataKeys):
    import datasets

    if keys.train_file:
        files = {"train": keys.train_file}
        if keys.validation_file:
            files["validation"] = keys.validation_file
        for split, path in files.items():
            if not Path(path).is_file():
                raise ConfigError(f"{split}_file={path!r} does not exist")
        builders = {_builder_for(p) for p in files.values()}
        if len(builders) > 1:
            raise ConfigError(f"train_file and validation_file must be the same type, got {sorted(builders)}")
        kwargs = {"delimiter": "\t"} if Path(keys.train_file).suffix.lower() == ".tsv" else {}
        try:
            return datasets.load_dataset(builders.pop(), data_files=files, **kwargs), keys.train_file
        except Exception as error:  # pyarrow/pandas parse errors come in many classes
            raise ConfigError(f"cannot read {keys.train_file}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None
    name = keys.dataset
    if name in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[name](), name
    if name.startswith("imagefolder:"):
        folder = Path(name.split(":", 1)[1])
        if not folder.is_dir():
            raise ConfigError(f"dataset={name!r}: {folder} is not a directory")
        return datasets.load_dataset("imagefolder", data_dir=str(folder)), name
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().exists():
        raise ConfigError(f"dataset={name!r} does not exist")
    try:
        return datasets.load_dataset(str(Path(name).expanduser()) if Path(name).expanduser().exists() else name,
                                     keys.dataset_config), name
    except FileNotFoundError as error:
        raise ConfigError(f"dataset={name!r}: not found ({str(error).splitlines()[0]}); offline, give a local directory or files") from None
    except (ValueError, ConnectionError, OSError) as error:
        raise ConfigError(f"dataset={name!r}: cannot load ({type(error).__name__}: {str(error).splitlines()[0]})") from None


def find_splits(raw, keys: DataKeys):
    splits = list(raw.keys())
    if keys.train_split not in raw:
        raise ConfigError(f"train_split={keys.train_split!r} not in the dataset; it has {splits}")
    train = raw[keys.train_split]
    wanted = keys.validation_split
    if wanted is not None:
        if wanted not in raw:
            raise ConfigError(f"validation_split={wanted!r} not in the dataset; it has {splits}")
        return train, raw[wanted], False
    for name in ("validation", "valid", "val", "test"):
        if name in raw and name != keys.train_split:
            return train, raw[name], False
    return train, None, True


def _check_columns(ds, columns: dict[str, str], split: str) -> None:
    for column, key in columns.items():
        if column not in ds.column_names:
            raise ConfigError(f"{key}={column!r} is not a column of the {split} split; its columns are {ds.column_names}")
    if len(ds) == 0:
        raise ConfigError(f"the {split} split is empty")


def _label_key(value) -> str:
    return str(int(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _label_counts(train, column: str) -> dict[str, int]:
    """Class name -> rows in the train split, in label order. The classes are what training sees; validation must
    stay within them. A ClassLabel column keeps all its names, also those without rows."""
    from datasets import ClassLabel

    feature = train.features[column]
    counts = Counter(train[column])
    if isinstance(feature, ClassLabel):
        return {name: counts.get(i, 0) for i, name in enumerate(feature.names)}
    if None in counts:
        raise ConfigError(f"label_column={column!r} has empty values in the train split: fill or drop those rows")
    values = list(counts)
    if any(isinstance(v, float) and not float(v).is_integer() for v in values):
        raise ConfigError(f"label_column={column!r} holds non-integer numbers {sorted(values)[:5]}: classification needs classes")
    ints = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    merged: Counter = Counter()
    for value, n in counts.items():
        merged[_label_key(value)] += n
    return dict(sorted(merged.items(), key=lambda item: int(item[0]) if ints else item[0]))


def _encode_labels(ds, column: str, names: list[str], split: str):
    from datasets import ClassLabel

    if isinstance(ds.features[column], ClassLabel):
        return ds.rename_column(column, "labels") if column != "labels" else ds
    index = {name: i for i, name in enumerate(names)}

    def encode(batch):
        ids = []
        for value in batch[column]:
            key = _label_key(value)
            if key not in index:
                raise ConfigError(f"label {value!r} in the {split} split is not among the training labels {names}")
            ids.append(index[key])
        return {"labels": ids}

    encoded = ds.map(encode, batched=True, desc=f"encoding {split} labels")
    return encoded.remove_columns([column]) if column != "labels" else encoded


def verify_images(ds, column: str, split: str) -> None:
    """Open every image (up to IMAGE_VERIFY_LIMIT) now, so a broken file fails before training, by name."""
    from datasets import Image as ImageFeature
    from PIL import Image

    if not isinstance(ds.features[column], ImageFeature):
        raise ConfigError(f"image_column={column!r} in the {split} split does not hold images ({ds.features[column]})")
    raw = ds.cast_column(column, ImageFeature(decode=False))

    for i, item in enumerate(raw[column][:IMAGE_VERIFY_LIMIT]):
        where = item.get("path") or f"row {i}"
        try:
            with Image.open(io.BytesIO(item["bytes"]) if item.get("bytes") else item["path"]) as img:
                img.verify()
        except Exception as error:  # PIL raises many kinds for a bad file
            raise ConfigError(f"unreadable image in the {split} split: {where} ({type(error).__name__}: {error}); "
                              "remove or fix the file") from None


def open_classification_data(keys: DataKeys, columns: dict[str, str], label_column: str) -> OpenedData:
    """Load the data and run every check that needs no pass over the rows' contents. ``columns``: those every split
    must have, {column: the key that names it} (the task's ``data_columns``)."""
    raw, source = load_raw(keys)
    train, validation, needs_carve = find_splits(raw, keys)
    _check_columns(train, columns, "train")
    if validation is not None:
        _check_columns(validation, columns, "validation")
    counts = _label_counts(train, label_column)
    names = list(counts)
    if len(names) < 2:
        raise ConfigError(f"label_column={label_column!r} has a single class {names}: classification needs at least two")
    plan = plan_carve(counts, keys.validation_fraction, label_column) if needs_carve else None
    return OpenedData(train=train, validation=validation, label_names=names, source=source, carve_plan=plan)


def _sample(ds, limit: int | None, seed: int):
    """At most ``limit`` rows, drawn at random (seeded): files and image folders are often sorted by class, and their
    first rows would be a single class."""
    if not limit or limit >= len(ds):
        return ds
    return ds.shuffle(seed=seed).select(range(limit))


def process_classification_data(keys: DataKeys, label_column: str, opened: OpenedData,
                                check_rows: Callable[[object, str], None] = lambda ds, split: None) -> ClassificationData:
    """The passes over every row: label encoding, the validation carve, sampling, and ``check_rows(split, name)`` (the
    task's look at every row: the image task opens every image)."""
    names = opened.label_names
    notes = []
    train = _encode_labels(opened.train, label_column, names, "train")
    if opened.carve_plan is not None:
        train, validation = carve(train, opened.carve_plan, names, keys.seed)
        if opened.carve_plan.note:
            notes.append(opened.carve_plan.note)
    else:
        validation = _encode_labels(opened.validation, label_column, names, "validation")
    train = _sample(train, keys.max_train_samples, keys.seed)
    validation = _sample(validation, keys.max_eval_samples, keys.seed)
    check_rows(train, "train")
    check_rows(validation, "validation")
    return ClassificationData(train=train, validation=validation, label_names=names, source=opened.source, notes=notes)
