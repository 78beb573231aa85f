"""``--config NAME_OR_PATH``: a recipe file, or the name of a recipe shipped in the package (``finetune/recipes/``).

A value that is an existing file is that file. Otherwise a bare name (``minilm_text_demo``, or ``minilm_text_demo.yaml``:
no path separator) is the shipped recipe of that name. Anything else is a usage error naming the value, the shipped
names and the nearest one. The shipped recipes' data files are written relative to the recipe itself (``data/...``);
``file_overrides`` turns them into absolute paths, so a shipped recipe trains from any working directory after a
``pip install`` (a recipe of your own keeps its paths as written: relative to the working directory).

No torch here: ``hf-gpu-train finetune --help`` lists the names.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from ..errors import UsageError

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
SUFFIX = ".yaml"
# FinetuneConfig keys that name a local file: in a shipped recipe, relative to the recipe
FILE_KEYS = ("train_file", "validation_file", "chat_template", "pretrained_weights")


def shipped_names() -> list[str]:
    """The shipped recipes' names, sorted (``minilm_text_demo``, ...)."""
    return sorted(p.name[: -len(SUFFIX)] for p in RECIPES_DIR.glob(f"*{SUFFIX}"))


def shipped_path(name: str) -> Path:
    return RECIPES_DIR / f"{name}{SUFFIX}"


def is_shipped(path: str | Path) -> bool:
    """True for a file of the shipped recipes' folder (however it was reached: a link to it too)."""
    try:
        return Path(path).expanduser().resolve().parent == RECIPES_DIR
    except OSError:
        return False


def resolve_recipe(value: str) -> str:
    """The recipe file ``--config value`` means: ``value`` itself when it is a file, else the shipped recipe it names."""
    if Path(value).expanduser().is_file():
        return value
    name = value[: -len(SUFFIX)] if value.endswith(SUFFIX) else value
    bare = name and "/" not in value and "\\" not in value
    if bare and shipped_path(name).is_file():
        return str(shipped_path(name))
    names = shipped_names()
    nearest = difflib.get_close_matches(Path(name).name, names, n=1, cutoff=0.0)
    what = "not a file" if not bare else "neither a file nor a shipped recipe"
    hint = f"; nearest: {nearest[0]}" if nearest else ""
    raise UsageError(f"--config {value!r}: {what}; the shipped recipes: {', '.join(names)}{hint}")


def file_overrides(recipe: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """``key=/absolute/path`` for each data file a shipped recipe names relative to itself (a key the command line
    sets is left to it); [] for any other recipe."""
    if recipe is None or not is_shipped(recipe):
        return []
    import yaml

    try:
        values = yaml.safe_load(Path(recipe).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []  # read again, and reported, by the config
    given = {item.partition("=")[0].strip().lstrip("-").replace("-", "_") for item in overrides}
    found = []
    for key in FILE_KEYS:
        value = values.get(key) if isinstance(values, dict) else None
        if isinstance(value, str) and key not in given and not Path(value).expanduser().is_absolute():
            beside = RECIPES_DIR / value
            if beside.exists():
                found.append(f"{key}={beside}")
    return found
