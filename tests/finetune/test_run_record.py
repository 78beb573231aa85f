"""The refusal to resume with another effective batch names keys that really give the earlier one back."""

from __future__ import annotations

import pytest

from hf_gpu_train.finetune.run_record import resume_batch_fix
from hf_gpu_train.finetune.trainer_factory import gradient_accumulation


class Cfg:
    def __init__(self, micro, global_batch):
        self.per_device_train_batch_size, self.global_batch_size = micro, global_batch


def keys_of(fix: str) -> dict:
    values = fix.split("set ", 1)[1].split(" to resume")[0].split()
    return {k: int(v) for k, v in (item.split("=") for item in values)}


@pytest.mark.parametrize("effective, micro, processes", [(48, 16, 2), (48, 16, 1), (64, 16, 4), (96, 32, 3), (30, 16, 2)])
def test_the_named_fix_gives_the_earlier_effective_batch(effective, micro, processes):
    """Issue 17, item 4: global_batch_size=48 at micro-batch 16 on 2 processes is 64 (accumulation rounds up), and the
    refusal used to say 'set global_batch_size=48', which was already set."""
    keys = keys_of(resume_batch_fix(effective, micro, processes))
    cfg = Cfg(keys.get("per_device_train_batch_size", micro), keys["global_batch_size"])
    assert gradient_accumulation(cfg, processes)[1] == effective


def test_an_effective_batch_no_process_count_divides_says_so():
    assert "cannot be split evenly over 2 processes" in resume_batch_fix(15, 8, 2)


def _identity_and_previous(effective_before: int, processes_before: int, **keys):
    from hf_gpu_train.finetune.config import FinetuneConfig
    from hf_gpu_train.finetune.run_record import Previous, RunIdentity

    cfg = FinetuneConfig(**{"task": "text-classification", "per_device_train_batch_size": 16, **keys})
    before = RunIdentity.of(cfg, "fp32", effective_before)
    record = {"training": before.training, "precision": "fp32", "effective_batch": effective_before,
              "processes": processes_before}
    return cfg, Previous(record=record, finished=False, results=None)


@pytest.mark.parametrize("before, processes_before, processes, expected", [
    (16, 1, 2, {"global_batch_size": 16, "per_device_train_batch_size": 8}),  # 16 x 2 would be 32
    (32, 2, 1, {"global_batch_size": 32}),  # 16 x 2 accumulation on one
    (48, 3, 2, {"global_batch_size": 48, "per_device_train_batch_size": 12}),  # 16 x 2 does not divide 48
])
def test_another_process_count_keeps_the_global_batch(before, processes_before, processes, expected):
    from hf_gpu_train.finetune.run_record import RunIdentity, keep_the_global_batch

    cfg, previous = _identity_and_previous(before, processes_before)
    _, effective = gradient_accumulation(cfg, processes)
    changes, line = keep_the_global_batch(cfg, RunIdentity.of(cfg, "fp32", effective), previous, processes)
    assert changes == expected and f"global batch of {before} kept" in line


@pytest.mark.parametrize("keys, processes_before, processes", [
    ({}, 2, 2),  # the same count: the batch changed on purpose, refused as before
    ({"global_batch_size": 64}, 1, 2),  # a global batch set to another value: on purpose
    ({"resume": "never"}, 1, 2),
    ({"learning_rate": 1e-3}, 1, 2),  # something else changed too
])
def test_nothing_is_adjusted_where_the_change_is_the_users(keys, processes_before, processes):
    from hf_gpu_train.finetune.run_record import RunIdentity, keep_the_global_batch

    cfg, previous = _identity_and_previous(16, processes_before)
    if "learning_rate" in keys:
        previous.record["training"]["learning_rate"] = 5e-5
    cfg = cfg.with_values(**keys)
    _, effective = gradient_accumulation(cfg, processes)
    assert keep_the_global_batch(cfg, RunIdentity.of(cfg, "fp32", effective), previous, processes) is None
