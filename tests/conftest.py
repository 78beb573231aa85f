"""Shared fixtures: the shipped reference machines are the test fixtures."""

from __future__ import annotations

import pytest

from hf_gpu_train.hardware.snapshot import load_machine, reference_machine_names

REFERENCE_MACHINES = reference_machine_names()
# the slurm_cluster fixture: a real two-node SLURM cluster (issue 30); installed: the wheel in a fresh venv, once a session
pytest_plugins = ["tests.slurm_cluster", "tests.installed_wheel"]


def _has_nvidia_gpu() -> bool:
    from hf_gpu_train.hardware.detect import detect

    return bool(detect().gpus)


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords or "multi_gpu" in item.keywords for item in items) and not _has_nvidia_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
        for item in items:
            if "gpu" in item.keywords or "multi_gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def machine():
    """machine("8x-h100-sxm") -> HardwareProfile."""
    return load_machine


# Variables a test may set in this process only through monkeypatch: one that leaks reaches every later test's
# subprocesses (OMP_NUM_THREADS=7 from one test once ran every later gloo test with 7 threads a process on 2 cores).
_GUARDED_PREFIXES = ("OMP_", "MKL_", "HF_GPU_TRAIN_", "CUDA_", "ACCELERATE_", "NCCL_", "TORCH_NCCL_", "WORLD_SIZE", "RANK",
                     "LOCAL_RANK", "MASTER_")


def _guarded() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k.startswith(_GUARDED_PREFIXES)}


@pytest.fixture(autouse=True)
def _no_environment_leaks():
    before = _guarded()
    yield
    after = _guarded()
    leaked = {k: after.get(k) for k in set(before) | set(after) if before.get(k) != after.get(k)}
    if leaked:
        import os

        for key in leaked:  # put it back, so one leak fails one test, not every later one
            if key in before:
                os.environ[key] = before[key]
            else:
                os.environ.pop(key, None)
        pytest.fail(f"the test changed this process's environment outside monkeypatch: {leaked}")
