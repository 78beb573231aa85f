"""``--config NAME_OR_PATH``: a recipe file, or the name of a recipe shipped in the package (``finetune/recipes/``).

A value that is an existing file is that file. Otherwise a bare name (``minilm_text_demo``, or ``minilm_text_demo.yaml``:
no path separator) is the shipped recipe of that name. Anything else is a usage error naming the value, the shipped
names and the nearest one. The shipped recipes' data files are written relative to the recipe itself (``data/...``);
the config loader reads them as absolute paths (``shipped_files``), so a shipped recipe trains from any working
directory after a ``pip install`` (a recipe of your own keeps its paths as written: relative to the working
directory); a run's record names them as a clone does (``portable``: ``recipes/data/...``).

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


def resolve_recipe(value: str, option: str = "--config") -> str:
    """The recipe file ``--config value`` means: ``value`` itself when it is a file, else the shipped recipe it names.
    ``option``: how the error names the value (``--config`` on the command line, ``config`` for ``load_config``)."""
    if Path(value).expanduser().is_file():
        return value
    name = value[: -len(SUFFIX)] if value.endswith(SUFFIX) else value
    bare = name and "/" not in value and "\\" not in value
    if bare and shipped_path(name).is_file():
        return str(shipped_path(name))
    names = shipped_names()
    nearest = difflib.get_close_matches(Path(name).name, names, n=1, cutoff=0.0)
    what = "does not exist" if not bare else "neither a file nor a shipped recipe"
    hint = f"; nearest: {nearest[0]}" if nearest else ""
    raise UsageError(f"{option} {value!r}: {what}; the shipped recipes: {', '.join(names)}{hint}")


def shipped_files(recipe: str | Path, values: dict) -> dict:
    """For a shipped recipe, each data file it names relative to itself as the absolute path beside it (what the config
    loader reads, from any working directory); {} for any other recipe, whose paths stay as written."""
    if not is_shipped(recipe):
        return {}
    found = {}
    for key in FILE_KEYS:
        value = values.get(key)
        if isinstance(value, str) and not Path(value).expanduser().is_absolute() and (RECIPES_DIR / value).exists():
            found[key] = str(RECIPES_DIR / value)
    return found


def portable(value: str) -> str:
    """A path inside the shipped recipes' folder as ``recipes/REL`` (how a clone names it), so a run's record does not
    depend on where the package is installed; any other value as it is."""
    try:
        return f"recipes/{Path(value).resolve().relative_to(RECIPES_DIR)}"
    except (ValueError, OSError):
        return value
