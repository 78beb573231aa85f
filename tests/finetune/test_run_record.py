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
