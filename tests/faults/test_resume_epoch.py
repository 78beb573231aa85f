"""A mid-epoch resume on several processes takes the epoch's sample order (faults/resume_epoch.py): the loader the
Trainer resumes with wraps its sampler three levels down, where neither accelerate's set_epoch nor the Trainer's
reaches. The 2-process resume that showed it: tests/faults/test_preemption_processes.py."""

from __future__ import annotations

import torch
from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, SkipBatchSampler
from torch.utils.data import BatchSampler

from hf_gpu_train.faults.resume_epoch import set_epoch_everywhere
from hf_gpu_train.faults.sampler_order import EpochSeededLengthGroupedSampler


def resumed_loader(sampler) -> DataLoaderShard:
    """What ``skip_first_batches`` makes on rank 0 of 2, one batch skipped."""
    shard = BatchSamplerShard(BatchSampler(sampler, 4, drop_last=False), num_processes=2, process_index=0)
    return DataLoaderShard(torch.arange(32), batch_sampler=SkipBatchSampler(shard, 1))


def test_the_loaders_own_set_epoch_does_not_reach_the_sampler_and_ours_does():
    sampler = EpochSeededLengthGroupedSampler(8, lengths=list(range(32)), seed=0)
    loader = resumed_loader(sampler)
    loader.set_epoch(1)
    assert sampler.epoch == 0  # the upstream gap: a resumed epoch 1 would replay epoch 0's order
    assert set_epoch_everywhere(loader, 1) >= 1 and sampler.epoch == 1
    first = [batch.tolist() for batch in loader]
    sampler.set_epoch(0)
    assert first != [batch.tolist() for batch in loader]  # the epoch decides the order: the test can tell them apart


class ShuffledEachEpoch(torch.utils.data.Sampler):
    """A sampler of someone's own that draws its order from the global generator (as transformers' length grouping did)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


def test_a_sampler_whose_order_moves_with_the_global_random_state_is_found_and_nothing_is_drawn():
    from accelerate.data_loader import SeedableRandomSampler
    from torch.utils.data import RandomSampler, SequentialSampler

    from hf_gpu_train.faults.sampler_order import order_moves_with_the_global_random_state

    before = torch.random.get_rng_state()
    assert order_moves_with_the_global_random_state(ShuffledEachEpoch(100))
    assert order_moves_with_the_global_random_state(RandomSampler(range(100)))  # without accelerate's seeding
    assert not order_moves_with_the_global_random_state(SeedableRandomSampler(range(100), data_seed=1))
    assert not order_moves_with_the_global_random_state(EpochSeededLengthGroupedSampler(8, list(range(100)), seed=1))
    assert not order_moves_with_the_global_random_state(SequentialSampler(range(100)))
    generator = torch.Generator().manual_seed(5)
    own = RandomSampler(range(100), generator=generator)
    state = generator.get_state()
    assert not order_moves_with_the_global_random_state(own)  # its own generator: the global state does not move it
    assert torch.equal(generator.get_state(), state) and torch.equal(torch.random.get_rng_state(), before)


def test_the_trainers_own_sampler_that_draws_from_the_global_state_is_said_with_the_fix(tmp_path, caplog):
    from transformers import Trainer, TrainingArguments

    from hf_gpu_train.faults.disk_full import guard_saves
    from tests.callbacks.tiny import TokenDataset, tiny_bert

    class OwnSampler(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return ShuffledEachEpoch(len(self.train_dataset))

    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to="none", use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    trainer = OwnSampler(model=tiny_bert(), args=args, train_dataset=TokenDataset(n=16))
    guard_saves(trainer)
    with caplog.at_level("WARNING", logger="hf_gpu_train.resume"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "draws each epoch's order from the global random state" in r.getMessage()]
    assert len(said) == 1 and "ShuffledEachEpoch" in said[0] and "set_epoch" in said[0]
