"""A resume reads the sample order the run it continues would have read: every epoch's order a function of the seed
and the epoch, and a resume in the middle of an epoch, on several processes, in that epoch's order.

Two ways a resumed run trains other samples than the run it continues, both silent:

1. **A sampler that draws its order from the global random state.** transformers' ``LengthGroupedSampler``
   (``train_sampling_strategy="group_by_length"``) draws each epoch's permutation from the global torch generator when
   the epoch's iteration begins. A resumed run begins its epoch before the Trainer restores the random state from the
   checkpoint (it restores it after skipping the trained batches), and the run it continues had drawn from a generator
   that had been through its earlier epochs: measured, a stop signal in the second epoch of the tiny Llama resumed to
   weights 1.1e-2 off the run never stopped (the random sampler, which accelerate seeds by the epoch: 0).
   ``sampler_order.seeded_samplers`` gives the Trainer's length-grouped sampler a generator seeded with ``data_seed`` (else ``seed``)
   plus the epoch, as accelerate's ``SeedableRandomSampler``; any other sampler whose order still moves with the global
   random state (a Trainer's own ``_get_train_sampler``) is found when the training loader is made, and said with the
   fix.
2. **A sampler whose epoch is never set.** The Trainer resumes mid-epoch by skipping the batches already trained
   (accelerate's ``skip_first_batches``), then sets the epoch on the loader it got. On several processes that loader's
   batch sampler is ``SkipBatchSampler(BatchSamplerShard(BatchSampler(sampler)))``, and neither accelerate's
   ``DataLoaderShard.set_epoch`` nor the Trainer's own reach into it (they look two levels down): a sampler seeded by
   its epoch keeps epoch 0's order, and the resumed run trains other samples (measured: 8e-4 apart after one epoch of
   the tiny BERT on 2 processes; one process, one level less, was exact). ``set_epoch_everywhere`` gives the epoch to
   every sampler down the chain; ``exact_mid_epoch_resume`` makes the loader the Trainer resumes with do that.
"""

from __future__ import annotations

CHAIN = ("batch_sampler", "sampler")  # where a loader or a batch sampler keeps what it wraps


def set_epoch_everywhere(loader, epoch: int) -> int:
    """``set_epoch(epoch)`` on every sampler and batch sampler below ``loader``; returns how many were set."""
    seen, stack, count = set(), [getattr(loader, name, None) for name in CHAIN], 0
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if callable(getattr(node, "set_epoch", None)):
            node.set_epoch(epoch)
            count += 1
        stack.extend(getattr(node, name, None) for name in CHAIN)
    return count


def exact_mid_epoch_resume(trainer) -> None:
    """``trainer.get_resumed_dataloader`` wrapped (transformers 5; older versions skip inside the training loop, where
    nothing is wrapped) so the loader it returns sets the epoch on every sampler below it."""
    original = getattr(trainer, "get_resumed_dataloader", None)
    if original is None:
        return

    def resumed(dataloader, num_batches):
        loader = original(dataloader, num_batches)
        set_epoch = getattr(loader, "set_epoch", None)

        def set_epoch_below(epoch: int) -> None:
            if set_epoch is not None:
                set_epoch(epoch)
            set_epoch_everywhere(loader, epoch)

        try:
            loader.set_epoch = set_epoch_below
        except AttributeError:  # a loader that takes no attributes: the Trainer's own set_epoch is all there is
            pass
        return loader

    trainer.get_resumed_dataloader = resumed
