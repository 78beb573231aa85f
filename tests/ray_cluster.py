"""A real local Ray cluster for tests (issue 30): ``ray.init(num_cpus=2, include_dashboard=False)`` in the test process,
one per test module (its start costs seconds on two cores), shut down after it. Its workers import this repository's
tests (the probes the tests hand to the workers are pickled by reference) and print each line once
(``launch.ray_job.QUIET_PRINT``). Without ray installed the tests that need it skip with the reason."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest

from hf_gpu_train.launch.ray_job import QUIET_PRINT

REPO = Path(__file__).resolve().parents[1]
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed: pip install -e '.[dev]' (ray[train]) or '.[ray]'")


@contextlib.contextmanager
def local_ray(num_cpus: int = 2):
    """The cluster's GCS address (what RAY_ADDRESS names for a driver that joins it) while it runs."""
    import ray

    context = ray.init(num_cpus=num_cpus, include_dashboard=False,
                       runtime_env={"env_vars": {"PYTHONPATH": str(REPO), **QUIET_PRINT}})
    try:
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()
