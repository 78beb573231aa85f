"""A real (not generated) 5-class set of short texts that every Python ships: sentences of Python's own reference
manual (``pydoc_data.topics``, the text behind ``help("topics")``), labelled with the section they come from
(special method names, compound statements, the standard type hierarchy, the debugger, string methods).
About 1,000 sentences of 6 to 60 words; a seeded, stratified 80/20 split written as CSV.

    python benchmarks/real_texts.py OUT_DIR        # writes OUT_DIR/train.csv and OUT_DIR/validation.csv
"""

from __future__ import annotations

import csv
import random
import re
import sys
from pathlib import Path

SECTIONS = ("specialnames", "compound", "types", "debugger", "string-methods")


def sentences(section: str) -> list[str]:
    from pydoc_data.topics import topics

    text = re.sub(r"\s+", " ", topics[section])
    parts = [s.strip() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text)]
    return sorted({s for s in parts if 6 <= len(s.split()) <= 60 and not s.startswith(">>>")})


def write(out: Path, seed: int = 0, validation_fraction: float = 0.2) -> tuple[Path, Path]:
    rng = random.Random(seed)
    train, validation = [], []
    for section in SECTIONS:
        rows = [{"text": s, "label": section} for s in sentences(section)]
        rng.shuffle(rows)
        cut = round(len(rows) * validation_fraction)
        validation += rows[:cut]
        train += rows[cut:]
    rng.shuffle(train)
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
