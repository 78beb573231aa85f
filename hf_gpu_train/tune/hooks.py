"""An extension point of the trials: ``HF_GPU_TRAIN_TUNE_HOOKS=module:function`` names a function every trial process
calls once its model and data are loaded, to change what the trials run on.

``function(model, collator, environ) -> (collator, notes)``: ``model`` is the process's model (``None`` when only
another collator is being built: a causal LM's other packing layout), ``collator`` the data collator, ``environ`` the
process's environment; it returns the collator to use (the same one, or a wrapper) and lines saying what it changed,
which the trial log prints. The module is imported in the trial processes (``PYTHONPATH`` must reach it).

Measurements taken with a hook are never a run's without it: the measurement cache's key holds the hook's name and
every other ``HF_GPU_TRAIN_TUNE_*`` variable set, so a hook reads its settings from variables named so. The
repository's tests and CPU benchmark use one (``tests/tune/hooks.py``) to give a CPU a memory limit and a slow data
loader.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

HOOKS_ENV = "HF_GPU_TRAIN_TUNE_HOOKS"
SETTINGS_PREFIX = "HF_GPU_TRAIN_TUNE_"


def cache_key_part(environ: Mapping[str, str]) -> dict[str, str]:
    """What the hook adds to the measurement cache's key: nothing without one; with one, its name and every
    ``HF_GPU_TRAIN_TUNE_*`` variable set."""
    if not environ.get(HOOKS_ENV):
        return {}
    return {k: v for k, v in sorted(environ.items()) if k.startswith(SETTINGS_PREFIX) and v}


def problem(environ: Mapping[str, str]) -> str | None:
    """Why ``HF_GPU_TRAIN_TUNE_HOOKS`` cannot name a function (None: it is unset, or of the form module:function)."""
    spec = environ.get(HOOKS_ENV)
    if not spec:
        return None
    module, _, function = spec.partition(":")
    if not (module and function and all(part.isidentifier() for part in (*module.split("."), function))):
        return f"{HOOKS_ENV}={spec!r} is not module:function (for example mypackage.tune_hooks:install)"
    return None


def install(model, collator, environ: Mapping[str, str]) -> tuple[object, list[str]]:
    """(the collator to use, what the hook changed): the hook named in ``environ`` called, or ``collator`` as it is."""
    spec = environ.get(HOOKS_ENV)
    if not spec:
        return collator, []
    wrong = problem(environ)
    if wrong:
        raise ValueError(wrong)
    module, _, function = spec.partition(":")
    hook = getattr(importlib.import_module(module), function)
    collator, notes = hook(model, collator, environ)
    return collator, list(notes)
