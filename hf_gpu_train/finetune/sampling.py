"""Length grouping that gives every number of processes the same optimizer steps.

transformers' ``LengthGroupedSampler`` sorts mega-batches of ``per-device batch x accumulation`` samples and draws
its permutation from the global RNG each epoch. With 2 processes of 8 the mega-batches are half the size of one
process of 16, and the global RNG has been through other dropout draws: the global batches differ, so 2 processes
do not train the model 1 process trains, and a resume with another number of processes lands on other samples.

Here the groups are built over the *global* batch (per-device x accumulation x processes: accelerate hands
consecutive per-device batches to the ranks in turn, so each optimizer step takes exactly one group), and the
permutation of epoch ``e`` comes from a generator seeded with ``seed + e`` (``set_epoch``, which accelerate's data
loader calls), so it is the same on every rank, for every world size, and after a resume.
"""

from __future__ import annotations

from torch.utils.data import SequentialSampler
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.trainer_utils import has_length

from ..faults.sampler_order import EpochSeededLengthGroupedSampler, data_seed


def group_by_length_over_the_global_batch(trainer) -> None:
    """Replace the Trainer's length-grouped sampler by one grouped over the global batch, seeded by the epoch
    (``faults.sampler_order.EpochSeededLengthGroupedSampler``); other samplers stay.

    ``_get_train_sampler`` is the Trainer's own place for the training sampler (there is no public argument), so
    it is wrapped on this instance, the way OOM recovery wraps ``training_step``."""
    build = trainer._get_train_sampler

    def sampler(train_dataset=None):
        chosen = build(train_dataset)
        if isinstance(chosen, LengthGroupedSampler):  # transformers' own, or already seeded by the epoch (guard_saves)
            args = trainer.args
            global_batch = args.train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
            return EpochSeededLengthGroupedSampler(global_batch, chosen.lengths, seed=data_seed(args))
        return chosen

    trainer._get_train_sampler = sampler


def evaluate_in_dataset_order(trainer) -> None:
    """Evaluate in the eval dataset's own order, which the entry point made longest first (``text.longest_first``).

    With ``train_sampling_strategy="group_by_length"`` transformers 5 groups the *evaluation* too: a
    ``LengthGroupedSampler`` that shuffles first and sorts within mega-batches of 4 eval batches or more, so on a
    validation set of a few eval batches every batch is a random draw, padded to its longest. Read in order, the
    batches hold neighbours in length. One process: sequential; several: no sampler, so accelerate hands out
    consecutive batches (the Trainer's own choice without grouping)."""

    def sampler(eval_dataset):
        if eval_dataset is None or not has_length(eval_dataset):  # the Trainer's own test
            return None
        return SequentialSampler(eval_dataset) if trainer.args.world_size <= 1 else None

    trainer._get_eval_sampler = sampler
