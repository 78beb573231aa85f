"""Build hf_gpu_train/finetune/recipes/data/python_docs_chat/{train,validation}.jsonl: chat examples whose answers
are real text (the data of the shipped recipe smollm2_lora_demo).

Each example asks what a function of Python's standard library does; the answer is the first paragraph of that
function's own docstring (CPython, PSF license), so the assistant's words are real documentation written by people,
not generated. The question wording rotates through a few phrasings. The files are committed: docstrings change
between Python versions, and the demo must train on the same rows everywhere. Regenerate (and commit) with:

    python scripts/make_python_docs_chat.py
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
from pathlib import Path

MODULES = ["textwrap", "json", "os.path", "shutil", "itertools", "functools", "statistics", "string", "random", "re", "heapq",
           "bisect", "copy", "glob", "fnmatch", "difflib", "base64", "zlib", "gzip", "csv", "uuid", "calendar", "secrets",
           "urllib.parse", "html", "shlex", "tempfile", "zipfile", "tarfile", "os", "math", "operator", "pprint", "keyword",
           "linecache", "filecmp", "ipaddress", "mimetypes", "platform", "quopri", "colorsys", "wave", "pickle", "struct"]
QUESTIONS = ["What does `{name}` do in Python?", "Explain `{name}` from the Python standard library.",
             "In Python, what is `{name}` for?", "Briefly, what does the function `{name}` do?"]
TYPES = [str, bytes, list, dict, set, int, float, tuple]  # methods of the built-in types: str.split, dict.get, ...
VALIDATION_SHARE = 0.15
SEED = 20240611


def first_paragraph(doc: str) -> str:
    paragraph = doc.strip().split("\n\n")[0]
    return re.sub(r"\s+", " ", paragraph).strip()


def documented(name: str, item) -> tuple[str, str] | None:
    doc = inspect.getdoc(item)
    answer = first_paragraph(doc) if doc else ""
    short = name.rsplit(".", 1)[-1]
    if not 40 <= len(answer) <= 400 or answer.startswith((short + "(", "S." + short, "D." + short, "L." + short)):
        return None
    return name, answer


def examples() -> list[dict]:
    rows = []
    import builtins

    for name, item in sorted(vars(builtins).items()):
        if not name.startswith("_") and inspect.isbuiltin(item):
            rows.append(documented(name, item))
    for kind in TYPES:
        for name, item in sorted(vars(kind).items()):
            if not name.startswith("_") and callable(item):
                rows.append(documented(f"{kind.__name__}.{name}", item))
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, item in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isfunction(item) or inspect.isbuiltin(item)):
                continue
            if getattr(item, "__module__", None) not in (module_name, module.__name__):
                continue
            rows.append(documented(f"{module_name}.{name}", item))
    rows = [row for row in rows if row is not None]
    rng = random.Random(SEED)
    rng.shuffle(rows)
    return [{"messages": [{"role": "user", "content": rng.choice(QUESTIONS).format(name=name)},
                          {"role": "assistant", "content": answer}]} for name, answer in rows]


def main() -> None:
    rows = examples()
    cut = round(len(rows) * (1 - VALIDATION_SHARE))
    out = Path(__file__).resolve().parents[1] / "hf_gpu_train/finetune/recipes/data/python_docs_chat"
    out.mkdir(exist_ok=True)
    for split, part in (("train", rows[:cut]), ("validation", rows[cut:])):
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part))
        print(f"{split}: {len(part)} conversations")


if __name__ == "__main__":
    main()
