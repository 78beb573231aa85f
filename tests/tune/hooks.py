"""For tests and the CPU benchmark: a memory limit and a slow data loader on a machine that has neither, given to the
trial processes of `hf-gpu-train tune` through its extension point (``hf_gpu_train/tune/hooks.py``):
``HF_GPU_TRAIN_TUNE_HOOKS=tests.tune.hooks:install`` (``environment(...)`` below sets it, with the settings), and the
repository's root on ``PYTHONPATH``. A CPU has no device memory to run out of, so the tests give the trials one:

- ``HF_GPU_TRAIN_TUNE_TEST_OOM_ABOVE=N``: the repository's ``OOMFaultInjector(max_batch=N)`` on the model: every
  training forward of more than N samples raises a real ``torch.OutOfMemoryError``, which the in-place OOM
  recovery handles as it handles a CUDA one.
- ``HF_GPU_TRAIN_TUNE_TEST_COLLATE_SLEEP_S=S``: the collate function sleeps S seconds per batch, so loading in the
  main process is measurably slower than loading in worker processes.

Both values are part of the measurement cache's key (every ``HF_GPU_TRAIN_TUNE_*`` variable is, with a hook), so a
test's measurements are never a user's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from hf_gpu_train.tune.hooks import HOOKS_ENV

HOOK = "tests.tune.hooks:install"
OOM_ENV = "HF_GPU_TRAIN_TUNE_TEST_OOM_ABOVE"
SLOW_COLLATE_ENV = "HF_GPU_TRAIN_TUNE_TEST_COLLATE_SLEEP_S"


def environment(oom_above: int | None = None, collate_sleep_s: float | None = None) -> dict[str, str]:
    """The variables that install this hook with these settings, for a tune command's environment."""
    env = {HOOKS_ENV: HOOK}
    if oom_above is not None:
        env[OOM_ENV] = str(oom_above)
    if collate_sleep_s is not None:
        env[SLOW_COLLATE_ENV] = str(collate_sleep_s)
    return env


class SlowCollate:
    """A collate function that sleeps first (a module-level class: DataLoader workers may pickle it); the wrapped
    collator's attributes (``packs_examples``) show through."""

    def __init__(self, collate, seconds: float):
        self.collate = collate
        self.seconds = seconds

    def __call__(self, batch):
        time.sleep(self.seconds)
        return self.collate(batch)

    def __getattr__(self, name: str):
        if name == "collate":
            raise AttributeError(name)
        return getattr(self.collate, name)


def install(model, collator, environ: Mapping[str, str]) -> tuple[object, list[str]]:
    """(the collator to use, what was installed) for the variables set in ``environ``; ``model`` None: only a collator
    is being built (the model has its injector already)."""
    notes = []
    if environ.get(OOM_ENV) and model is not None:
        from hf_gpu_train.oom import OOMFaultInjector

        limit = int(environ[OOM_ENV])
        OOMFaultInjector(max_batch=limit).install(model)
        notes.append(f"test memory limit: a training forward of more than {limit} samples runs out of memory ({OOM_ENV})")
    if environ.get(SLOW_COLLATE_ENV):
        seconds = float(environ[SLOW_COLLATE_ENV])
        collator = SlowCollate(collator, seconds)
        notes.append(f"test data loader: collating a batch sleeps {seconds} s ({SLOW_COLLATE_ENV})")
    return collator, notes
