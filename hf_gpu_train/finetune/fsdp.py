"""FSDP in scripts/finetune.py: accelerate's CPU trap worked around, and a final model anyone can load.

accelerate turns a launch config with ``distributed_type: FSDP`` into FSDP only for GPU-like devices
(``AcceleratorState`` promotes MULTI_GPU, MULTI_NPU, ... to FSDP, never MULTI_CPU): CPU processes silently train
with DDP (seen with accelerate 1.15: ``DistributedDataParallel`` around the model, full parameters on every rank).
torch's FSDP2 itself runs on CPU processes over gloo, so when the launcher asked for FSDP (``ACCELERATE_USE_FSDP``)
and the state came out without an FSDP plugin, the Trainer's state is given the plugin accelerate built from the
same environment: the model is then sharded by ``fully_shard`` as on GPUs. That makes an 8-GPU FSDP recipe
rehearsable, and testable, on a laptop.

Which modules become FSDP units: without ``fsdp_transformer_layer_cls_to_wrap``, accelerate 1.15 takes the model's
``_no_split_modules``, which for BERT include ``BertEmbeddings``; it then shards the word embeddings inside that
unit a second time (its "carve the input embeddings" step) and torch fails ("Invariant encountered: value was None").
The repeated blocks are the units that pay (one all-gather per layer), so they are named explicitly: the classes of
``_no_split_modules`` that occur more than once in the model (``BertLayer``, ``LlamaDecoderLayer``).

With ``SHARDED_STATE_DICT`` (the right choice for checkpoints: every rank writes its shard, nothing gathered) the
Trainer's ``save_model`` writes only shards; the final model is saved once as a full state dict (gathered), so
``from_pretrained`` loads it.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("hf_gpu_train.finetune")


def fsdp_requested(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return str(environ.get("ACCELERATE_USE_FSDP", "false")).lower() == "true"


def fsdp_checkpoints_activations(environ=None) -> bool:
    """The launch config's ``fsdp_activation_checkpointing`` (accelerate exports it as FSDP_ACTIVATION_CHECKPOINTING): FSDP
    then recomputes activations itself, and the Trainer refuses its own ``activation_checkpointing`` beside it."""
    environ = os.environ if environ is None else environ
    return fsdp_requested(environ) and str(environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false")).lower() == "true"


def shard_on_cpu_too(trainer, environ=None) -> bool:
    """Give the Trainer FSDP where accelerate dropped it (CPU processes); True when it did."""
    state = trainer.accelerator.state
    if not fsdp_requested(environ) or getattr(state, "fsdp_plugin", None) is not None:
        return False
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables, as accelerate builds it
    state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP  # an AcceleratorState made later copies the partial state's
    trainer.is_fsdp_enabled = True
    if trainer.is_world_process_zero():
        log.warning("hf_gpu_train: accelerate runs an FSDP launch config on CPU processes as DDP; sharding with FSDP%s over "
                    "gloo as the config asks", state.fsdp_plugin.fsdp_version)
    return True


def repeated_blocks(model) -> list[str]:
    """The classes of ``model._no_split_modules`` with two or more instances: the transformer layers."""
    names = list(getattr(model, "_no_split_modules", None) or [])
    counts: dict[str, int] = {}
    for module in model.modules():
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return [n for n in names if counts.get(n, 0) >= 2]


def wrap_repeated_blocks(trainer) -> None:
    """Name the transformer layers as FSDP units when the launch config did not (see the module docstring)."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if plugin is None or plugin.transformer_cls_names_to_wrap is not None:
        return
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = plugin.auto_wrap_policy
    if getattr(policy, "func", policy) is transformer_auto_wrap_policy or policy == "transformer_based_wrap":
        blocks = repeated_blocks(trainer.accelerator.unwrap_model(trainer.model))
        if blocks:
            plugin.transformer_cls_names_to_wrap = blocks


def is_sharded(trainer) -> bool:
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return bool(trainer.is_fsdp_enabled and plugin is not None)


def save_full_model(trainer) -> None:
    """``trainer.save_model()``, gathering the full weights once when checkpoints are sharded."""
    if not is_sharded(trainer):
        trainer.save_model()
        return
    plugin = trainer.accelerator.state.fsdp_plugin
    kept = plugin.state_dict_type
    plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        trainer.save_model()
    finally:
        plugin.set_state_dict_type(kept)
