"""Ranks that resolved different training values fail together, with the values per rank (review of issue 17)."""

import pytest

from hf_gpu_train.finetune.agreement import check_ranks_agree
from hf_gpu_train.finetune.config import ConfigError


def test_ranks_that_resolved_different_values_fail_together_naming_them():
    rank0 = {"per_device_train_batch_size": 32, "precision": "bf16", "effective_batch": 64}
    rank1 = {"per_device_train_batch_size": 16, "precision": "bf16", "effective_batch": 64}
    with pytest.raises(ConfigError, match=r"per_device_train_batch_size: rank 0=32, rank 1=16\)"):
        check_ranks_agree(rank0, gather=lambda mine: [mine, {**mine, **rank1}])
    check_ranks_agree(rank0, gather=lambda mine: [mine, dict(mine)])  # the same: nothing said
    check_ranks_agree(rank0, gather=lambda mine: None)  # one process
