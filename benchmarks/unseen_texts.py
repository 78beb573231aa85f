"""A text set the project was never tuned on, for benchmarks/phases.py's unseen-data shape: sentences of the
docstrings of five packages of Python's standard library (asyncio, email, http, logging, xml), labelled with their
package; a sentence that names its own package is left out (the answer would be in it). 5 classes, at most 250
sentences each, split 80/20 per class with a seeded shuffle. Nothing is downloaded: the standard library is the source.

    python benchmarks/unseen_texts.py OUT_DIR        # writes OUT_DIR/train.csv and OUT_DIR/validation.csv
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_texts import write_split  # noqa: E402

PACKAGES = ("asyncio", "email", "http", "logging", "xml")  # pure Python, in every CPython on Linux (tkinter is not)
PER_CLASS = 250


def _modules(package: str) -> list:
    root = importlib.import_module(package)
    found = [root]
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if "test" in info.name or info.name.endswith("__main__"):
            continue
        try:
            found.append(importlib.import_module(info.name))
        except Exception:  # noqa: BLE001 - a module of another platform (or without its C library) is not a source
            continue
    return found


def sentences(package: str) -> list[str]:
    """The distinct sentences of 6 to 60 words in the docstrings of ``package``'s own functions, classes and methods."""
    found: set[str] = set()
    for module in _modules(package):
        for value in vars(module).values():
            members = [value, *vars(value).values()] if inspect.isclass(value) else [value]
            for member in members:
                if not (inspect.isfunction(member) or inspect.isclass(member)):
                    continue
                if getattr(member, "__module__", None) != module.__name__ or not inspect.getdoc(member):
                    continue
                for sentence in re.split(r"(?<=[.!?])\s+", " ".join(inspect.getdoc(member).split())):
                    if 6 <= len(sentence.split()) <= 60 and not re.search(package, sentence, re.IGNORECASE):
                        found.add(sentence)
    return sorted(found)


def write(out: Path, seed: int = 0, validation_fraction: float = 0.2) -> tuple[Path, Path]:
    rng = random.Random(seed)
    train, validation = [], []
    for package in PACKAGES:
        rows = [{"text": s, "label": package} for s in sentences(package)]
        rng.shuffle(rows)
        rows = rows[:PER_CLASS]
        cut = round(len(rows) * validation_fraction)
        validation += rows[:cut]
        train += rows[cut:]
    rng.shuffle(train)
    return write_split(out, train, validation)


if __name__ == "__main__":
    for path in write(Path(sys.argv[1])):
        print(path, sum(1 for _ in open(path)) - 1, "rows")
