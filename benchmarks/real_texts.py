"""The default run's real text as CSV files: sentences of Python's own reference manual labelled with their section
(``model=... dataset=builtin:python-docs`` reads the same split in process: hf_gpu_train/finetune/builtin.py). For the
plain-Trainer anchor of benchmarks/finetune_vs_reference.py, which reads CSV files.

    python benchmarks/real_texts.py OUT_DIR        # writes OUT_DIR/train.csv and OUT_DIR/validation.csv
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_gpu_train.finetune.builtin import PYTHON_DOCS_SECTIONS as SECTIONS  # noqa: E402,F401 (names other benchmarks read)
from hf_gpu_train.finetune.builtin import python_docs_sentences as sentences  # noqa: E402,F401
from hf_gpu_train.finetune.builtin import python_docs_split  # noqa: E402


def write(out: Path, seed: int = 0, validation_fraction: float = 0.2) -> tuple[Path, Path]:
    return write_split(out, *python_docs_split(seed, validation_fraction))


def write_split(out: Path, train: list[dict], validation: list[dict]) -> tuple[Path, Path]:
    """Rows {text, label} as OUT/train.csv and OUT/validation.csv, the files the plain-Trainer scripts read."""
    out.mkdir(parents=True, exist_ok=True)
    paths = (out / "train.csv", out / "validation.csv")
    for path, rows in zip(paths, (train, validation)):
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["text", "label"])
            writer.writeheader()
            writer.writerows(rows)
    return paths


if __name__ == "__main__":
    train_csv, validation_csv = write(Path(sys.argv[1]))
    print(train_csv, validation_csv)
