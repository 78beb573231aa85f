"""BatchNorm's running statistics the same on every rank, whatever the strategy: the model the Trainer evaluates on
each rank is the model it saves.

The Trainer evaluates the unwrapped model (``_wrap_model(training=False)`` returns it),
each rank a share of the rows, and saves rank 0's. Under DDP (``broadcast_buffers=True``) rank 0's buffers reach the
others at the first forward of each optimizer step (the forwards under ``no_sync`` do not sync), and each rank then
moves them with its own micro-batches: rank 1 evaluates rank 0's statistics of the step before, moved by rank 1's
batches of the last step. DeepSpeed's engine and FSDP broadcast nothing: each rank keeps the statistics of its own
batches throughout. Either way the evaluation scores a mix of models, none of them the saved one, and the mix differs
by strategy. Measured (issue 41: the EfficientNet-Lite0 digits recipe, 2 processes of 8 images, 6 steps, no
clipping; ``benchmarks/strategy_agreement.py``): ZeRO-2's saved weights and statistics equal DDP's bit for bit, and
the evaluation said accuracy 0.1922 against DDP's 0.1838. Training is untouched (in training mode BatchNorm normalises with the batch's own statistics), so broadcasting rank
0's statistics after every optimizer step (every rank ends it together) makes every rank evaluate the saved model,
under every strategy alike.

Only modules with running statistics are broadcast (``_NormBase`` with ``track_running_stats``: BatchNorm,
SyncBatchNorm, timm's BatchNormAct2d, a tracking InstanceNorm), the buffers training changes in the models people
fine-tune; a custom module that rewrites another buffer in its forward is not kept equal here. A model without running
statistics, or one process, costs nothing."""

from __future__ import annotations

from transformers import TrainerCallback

from .wrappers import broadcast_from_rank_0


def running_statistics(model) -> list:
    """The buffers training changes: every module's running mean, variance and count, in the model's own order (the
    same on every rank)."""
    from torch.nn.modules.batchnorm import _NormBase

    found = []
    for module in model.modules():
        if isinstance(module, _NormBase) and module.track_running_stats:
            found += [b for b in (module.running_mean, module.running_var, module.num_batches_tracked) if b is not None]
    return found


class RunningStatisticsBroadcast(TrainerCallback):
    """After every optimizer step (every rank ends it together), rank 0's running statistics on every rank."""

    def __init__(self, model):
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        broadcast_from_rank_0(running_statistics(self.model))


def share_running_statistics(trainer) -> list[str]:
    """On a Trainer of several processes whose model has running statistics: ``RunningStatisticsBroadcast`` added,
    and its line to print before training. Nothing for one process or a model without them (the same model on every
    rank gives every rank the same answer, so every rank or none takes part in the broadcasts)."""
    if trainer.args.world_size < 2 or not running_statistics(trainer.model):
        return []
    trainer.add_callback(RunningStatisticsBroadcast(trainer.model))
    return ["BatchNorm running statistics: rank 0's on every rank after every optimizer step, so each rank evaluates "
            "the model that is saved (without it each rank's own batches would move its statistics)"]
