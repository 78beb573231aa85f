"""Shared fixtures: the shipped reference machines are the test fixtures."""

from __future__ import annotations

import pytest

from hf_gpu_train.hardware.snapshot import load_machine, reference_machine_names

REFERENCE_MACHINES = reference_machine_names()


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
