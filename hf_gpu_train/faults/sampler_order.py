"""The order a training sampler reads: a function of the seed and the epoch, or said where it is not.

transformers' ``LengthGroupedSampler`` (``train_sampling_strategy="group_by_length"``) draws each epoch's permutation
from the global torch generator when the epoch's iteration begins; a resumed run begins its epoch before the Trainer
restores the random state, so it reads other samples than the run it continues (``resume_epoch.py`` has the figures).
``EpochSeededLengthGroupedSampler`` draws it from ``seed + epoch``; ``seeded_samplers`` puts it in the Trainer's place
and checks whatever sampler the training loader ends up with (``order_moves_with_the_global_random_state``).
"""

from __future__ import annotations

import copy
import itertools
import logging
import random

import numpy as np
import torch
from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices

from .resume_epoch import CHAIN

log = logging.getLogger("hf_gpu_train.resume")
PROBED_INDICES = 64  # the first indices of an epoch's order compared under two global random states


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """transformers' length grouping, its permutation drawn from a generator seeded with ``seed + epoch`` (``set_epoch``;
    an iteration without one moves to the next epoch, as accelerate's ``SeedableRandomSampler``): the same order on
    every rank and after a resume."""

    def __init__(self, batch_size: int, lengths: list[int], seed: int):
        super().__init__(batch_size, lengths=lengths)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from get_length_grouped_indices(self.lengths, self.batch_size, generator=generator)
        self.epoch += 1  # a loop that never calls set_epoch still reads a new order each epoch


def data_seed(args) -> int:
    """The seed of the data order: ``data_seed`` where set, else ``seed`` (the Trainer's and accelerate's rule)."""
    return args.data_seed if args.data_seed is not None else args.seed


def seeded_samplers(trainer) -> None:
    """The Trainer's length-grouped sampler seeded by the epoch (``_get_train_sampler``, the Trainer's own place for the
    training sampler, wrapped on this instance); and the training loader's sampler checked when it is made: one whose
    order still moves with the global random state is said once, with the fix."""
    build = trainer._get_train_sampler

    def sampler(*args, **kwargs):
        chosen = build(*args, **kwargs)
        if type(chosen) is LengthGroupedSampler and chosen.generator is None:
            chosen = EpochSeededLengthGroupedSampler(chosen.batch_size, chosen.lengths, seed=data_seed(trainer.args))
        return chosen

    trainer._get_train_sampler = sampler
    make_loader = trainer.get_train_dataloader
    said = []

    def loader(*args, **kwargs):
        made = make_loader(*args, **kwargs)
        order = innermost_sampler(made)
        if not said and order is not None and order_moves_with_the_global_random_state(order):
            said.append(True)
            log.warning("hf_gpu_train: the training sampler %s draws each epoch's order from the global random state, "
                        "so a resumed run may read other samples than the run it continues (the Trainer restores that "
                        "state after the epoch's order is drawn). Seed its generator with the seed plus the epoch and "
                        "give it set_epoch(epoch), as accelerate's SeedableRandomSampler", type(order).__name__)
        return made

    trainer.get_train_dataloader = loader


def innermost_sampler(loader):
    """The sampler at the bottom of a loader's chain of batch samplers (None: an iterable dataset has none)."""
    node, seen = loader, set()
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        below = next((getattr(node, name) for name in CHAIN if getattr(node, name, None) is not None), None)
        if below is None:
            return node if node is not loader else None
        node = below
    return None


def order_moves_with_the_global_random_state(sampler) -> bool:
    """Whether the first indices ``sampler`` yields change with torch's, Python's and NumPy's global random states.
    Asked of shallow copies whose generators are copies too, under forked random states: the run draws nothing for it."""
    firsts = []
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            for seed in (1, 2):
                torch.manual_seed(seed)
                random.seed(seed)
                np.random.seed(seed)
                try:
                    firsts.append(list(itertools.islice(iter(_detached_copy(sampler)), PROBED_INDICES)))
                except Exception:  # a sampler that cannot be iterated here: nothing to say about it
                    return False
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    return firsts[0] != firsts[1]


def _detached_copy(sampler):
    """A shallow copy of ``sampler`` whose generators are copies: iterating it moves nothing of the original's."""
    probe = copy.copy(sampler)
    for name, value in list(vars(probe).items()):
        if isinstance(value, (list, dict, set)):  # a container the sampler may change as it iterates: its own copy
            setattr(probe, name, copy.copy(value))
        elif isinstance(value, torch.Generator):
            clone = torch.Generator(device=value.device)
            clone.set_state(value.get_state())
            setattr(probe, name, clone)
        elif isinstance(value, (np.random.Generator, np.random.RandomState, random.Random)):
            setattr(probe, name, copy.deepcopy(value))
    return probe
