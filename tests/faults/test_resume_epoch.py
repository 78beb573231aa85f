"""A mid-epoch resume on several processes takes the epoch's sample order (faults/resume_epoch.py): the loader the
Trainer resumes with wraps its sampler three levels down, where neither accelerate's set_epoch nor the Trainer's
reaches. The 2-process resume that showed it: tests/faults/test_preemption_processes.py."""

from __future__ import annotations

import torch
from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, SkipBatchSampler
from torch.utils.data import BatchSampler

from hf_gpu_train.faults.resume_epoch import set_epoch_everywhere
from hf_gpu_train.finetune.sampling import GlobalLengthGroupedSampler


def resumed_loader(sampler) -> DataLoaderShard:
    """What ``skip_first_batches`` makes on rank 0 of 2, one batch skipped."""
    shard = BatchSamplerShard(BatchSampler(sampler, 4, drop_last=False), num_processes=2, process_index=0)
    return DataLoaderShard(torch.arange(32), batch_sampler=SkipBatchSampler(shard, 1))


def test_the_loaders_own_set_epoch_does_not_reach_the_sampler_and_ours_does():
    sampler = GlobalLengthGroupedSampler(8, lengths=list(range(32)), seed=0)
    loader = resumed_loader(sampler)
    loader.set_epoch(1)
    assert sampler.epoch == 0  # the upstream gap: a resumed epoch 1 would replay epoch 0's order
    assert set_epoch_everywhere(loader, 1) >= 1 and sampler.epoch == 1
    first = [batch.tolist() for batch in loader]
    sampler.set_epoch(0)
    assert first != [batch.tolist() for batch in loader]  # the epoch decides the order: the test can tell them apart
