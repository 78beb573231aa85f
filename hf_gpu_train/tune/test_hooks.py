"""For tests and the CPU benchmark only: a memory limit and a slow data loader on a machine that has neither.

A CPU has no device memory to run out of, so the tests give the trial processes one through the environment of
`hf-gpu-train tune` (the launch passes it to every process):

- ``HF_GPU_TRAIN_TUNE_TEST_OOM_ABOVE=N``: the repository's ``OOMFaultInjector(max_batch=N)`` on the model: every
  training forward of more than N samples raises a real ``torch.OutOfMemoryError``, which the in-place OOM
  recovery handles as it handles a CUDA one.
- ``HF_GPU_TRAIN_TUNE_TEST_COLLATE_SLEEP_S=S``: the collate function sleeps S seconds per batch, so loading in the
  main process is measurably slower than loading in worker processes.

Both values are part of the measurement cache's key, so a test's measurements are never a user's. Not for users:
on a GPU the memory is real.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

OOM_ENV = "HF_GPU_TRAIN_TUNE_TEST_OOM_ABOVE"
SLOW_COLLATE_ENV = "HF_GPU_TRAIN_TUNE_TEST_COLLATE_SLEEP_S"
ENVIRONMENT = (OOM_ENV, SLOW_COLLATE_ENV)


def active(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: environ[k] for k in ENVIRONMENT if environ.get(k)}


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


def install(model, collator, environ: Mapping[str, str], collate_only: bool = False) -> tuple[object, list[str]]:
    """(the collator to use, what was installed) for the variables set in ``environ``; ``collate_only``: leave the
    model alone (it has its injector already)."""
    notes = []
    if environ.get(OOM_ENV) and not collate_only:
        from ..oom import OOMFaultInjector

        limit = int(environ[OOM_ENV])
        OOMFaultInjector(max_batch=limit).install(model)
        notes.append(f"test memory limit: a training forward of more than {limit} samples runs out of memory ({OOM_ENV})")
    if environ.get(SLOW_COLLATE_ENV):
        seconds = float(environ[SLOW_COLLATE_ENV])
        collator = SlowCollate(collator, seconds)
        notes.append(f"test data loader: collating a batch sleeps {seconds} s ({SLOW_COLLATE_ENV})")
    return collator, notes
