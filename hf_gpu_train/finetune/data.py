"""Load, split, check and label-encode the data for classification, from any of the supported sources.

Sources: ``builtin:text`` / ``builtin:digits``; ``train_file`` / ``validation_file`` (csv, json,
jsonl, parquet); ``imagefolder:DIR`` (one sub-directory per class); anything else is passed to
``datasets.load_dataset`` (a hub id in a user's world, a local dataset directory here).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .builtin import BUILTIN_DATASETS
from .config import ConfigError, FinetuneConfig

FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
IMAGE_VERIFY_LIMIT = 50_000


@dataclass
class ClassificationData:
    train: object  # datasets.Dataset with a "labels" int column
    validation: object
    label_names: list[str]
    source: str


def _builder_for(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FILE_BUILDERS:
        raise ConfigError(f"{path}: unsupported file type {suffix or '(none)'}; use .csv, .json, .jsonl or .parquet")
    return FILE_BUILDERS[suffix]


def _load_raw(cfg: FinetuneConfig):
    import datasets

    if cfg.train_file:
        files = {"train": cfg.train_file}
        if cfg.validation_file:
            files["validation"] = cfg.validation_file
        for split, path in files.items():
            if not Path(path).is_file():
                raise ConfigError(f"{split}_file={path!r} does not exist")
        builders = {_builder_for(p) for p in files.values()}
        if len(builders) > 1:
            raise ConfigError(f"train_file and validation_file must be the same type, got {sorted(builders)}")
        kwargs = {"delimiter": "\t"} if Path(cfg.train_file).suffix.lower() == ".tsv" else {}
        try:
            return datasets.load_dataset(builders.pop(), data_files=files, **kwargs), cfg.train_file
        except Exception as error:  # pyarrow/pandas parse errors come in many classes
            raise ConfigError(f"cannot read {cfg.train_file}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None
    name = cfg.dataset
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
                                     cfg.dataset_config), name
    except FileNotFoundError as error:
        raise ConfigError(f"dataset={name!r}: not found ({str(error).splitlines()[0]}); offline, give a local directory or files") from None
    except (ValueError, ConnectionError, OSError) as error:
        raise ConfigError(f"dataset={name!r}: cannot load ({type(error).__name__}: {str(error).splitlines()[0]})") from None


def _split(raw, cfg: FinetuneConfig):
    splits = list(raw.keys())
    if cfg.train_split not in raw:
        raise ConfigError(f"train_split={cfg.train_split!r} not in the dataset; it has {splits}")
    train = raw[cfg.train_split]
    wanted = cfg.validation_split
    if wanted is not None:
        if wanted not in raw:
            raise ConfigError(f"validation_split={wanted!r} not in the dataset; it has {splits}")
        return train, raw[wanted], False
    for name in ("validation", "valid", "val", "test"):
        if name in raw and name != cfg.train_split:
            return train, raw[name], False
    return train, None, True


def _check_columns(ds, cfg: FinetuneConfig, split: str) -> None:
    needed = [cfg.label_column]
    if cfg.task == "text-classification":
        needed.append(cfg.text_column)
        if cfg.text_pair_column:
            needed.append(cfg.text_pair_column)
    else:
        needed.append(cfg.image_column)
    for column in needed:
        if column not in ds.column_names:
            key = {cfg.label_column: "label_column", cfg.text_column: "text_column", cfg.image_column: "image_column"}.get(
                column, "text_pair_column")
            raise ConfigError(f"{key}={column!r} is not a column of the {split} split; its columns are {ds.column_names}")
    if len(ds) == 0:
        raise ConfigError(f"the {split} split is empty")


def _label_names(train, column: str) -> list[str]:
    from datasets import ClassLabel

    feature = train.features[column]
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    values = set(train.unique(column))  # the classes are what training sees; validation must stay within them
    if None in values:
        raise ConfigError(f"label_column={column!r} has empty values in the train split: fill or drop those rows")
    if any(isinstance(v, float) and not float(v).is_integer() for v in values):
        raise ConfigError(f"label_column={column!r} holds non-integer numbers {sorted(values)[:5]}: classification needs classes")
    ints = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    ordered = sorted(values, key=(lambda v: int(v)) if ints else str)
    return [str(int(v)) if ints else str(v) for v in ordered]


def _encode_labels(ds, column: str, names: list[str], split: str):
    from datasets import ClassLabel

    if isinstance(ds.features[column], ClassLabel):
        return ds.rename_column(column, "labels") if column != "labels" else ds
    index = {name: i for i, name in enumerate(names)}

    def encode(batch):
        ids = []
        for value in batch[column]:
            key = str(int(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
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
    import io

    for i, item in enumerate(raw[column][:IMAGE_VERIFY_LIMIT]):
        where = item.get("path") or f"row {i}"
        try:
            with Image.open(io.BytesIO(item["bytes"]) if item.get("bytes") else item["path"]) as img:
                img.verify()
        except Exception as error:  # PIL raises many kinds for a bad file
            raise ConfigError(f"unreadable image in the {split} split: {where} ({type(error).__name__}: {error}); "
                              "remove or fix the file") from None


def load_classification_data(cfg: FinetuneConfig) -> ClassificationData:
    raw, source = _load_raw(cfg)
    train, validation, carve = _split(raw, cfg)
    _check_columns(train, cfg, "train")
    if validation is not None:
        _check_columns(validation, cfg, "validation")
    names = _label_names(train, cfg.label_column)
    if len(names) < 2:
        raise ConfigError(f"label_column={cfg.label_column!r} has a single class {names}: classification needs at least two")
    train = _encode_labels(train, cfg.label_column, names, "train")
    if carve:
        from datasets import ClassLabel

        train = train.cast_column("labels", ClassLabel(names=names)) if not isinstance(train.features["labels"], ClassLabel) else train
        parts = train.train_test_split(test_size=cfg.validation_fraction, seed=cfg.seed, stratify_by_column="labels")
        train, validation = parts["train"], parts["test"]
    else:
        validation = _encode_labels(validation, cfg.label_column, names, "validation")
    if cfg.max_train_samples:
        train = train.select(range(min(cfg.max_train_samples, len(train))))
    if cfg.max_eval_samples:
        validation = validation.select(range(min(cfg.max_eval_samples, len(validation))))
    if cfg.task == "image-classification":
        verify_images(train, cfg.image_column, "train")
        verify_images(validation, cfg.image_column, "validation")
    return ClassificationData(train=train, validation=validation, label_names=names, source=source)
