"""Selective activation checkpointing: keep what is expensive to recompute, recompute what is cheap.

Between "keep every activation" and "recompute every layer" (transformers' per-layer checkpointing): each
checkpointed layer keeps the outputs of its matmuls and of attention, and recomputes in the backward only the
elementwise work between them (norms, SiLU, the gate product, casts, rotary embeddings, residual adds). That is
torch's selective activation checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``, the
policy torchtitan calls "op-level SAC"): the recompute costs a few percent of the step, not the forward's third,
and the layer keeps about half of what it would without checkpointing (for a Llama layer the dropped part is the
norms' outputs and the MLP's SiLU and gate product, ``plan/activations.selective_layer_bytes_per_token``).

Exact: the recomputed ops are deterministic given their inputs, and the checkpoint restores the RNG state for
dropout, so losses and gradients equal those of a run without checkpointing (tests/levers/test_memory_levers.py).

Use it in any Trainer: ``enable(model)`` before ``trainer.train()``, with the Trainer's own
``activation_checkpointing`` left off (it would re-enable plain checkpointing over this).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..errors import UsageError
from ..plan.training_shape import ATTENTION_KEPT

_ATEN = torch.ops.aten


def _saved_ops() -> frozenset:
    """The matmuls (what ``F.linear`` and ``torch.matmul`` decompose to under autograd) and every SDPA kernel."""
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
             "_efficient_attention_forward")
    return frozenset(getattr(_ATEN, name).default for name in names if hasattr(_ATEN, name))


SAVED_OPS = _saved_ops()


def keep_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The policy: save the outputs of matmuls and attention, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


MATMULS = frozenset(getattr(_ATEN, name).default for name in ("mm", "addmm", "bmm", "baddbmm"))


def narrows(op, args) -> bool:
    """A matmul whose inner dimension exceeds its output's width: it reads more than it writes, so its output costs
    the most compute per byte kept (2k FLOPs an element, k > n)."""
    first, second = (args[1], args[2]) if op in (_ATEN.addmm.default, _ATEN.baddbmm.default) else (args[0], args[1])
    return first.shape[-1] > second.shape[-1]


def keep_attention_and_narrowing_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The lean policy: save attention's outputs and those of the matmuls that narrow the stream (the key and value
    projections under grouped attention, the MLP's down projection, LoRA's A), recompute the rest (the query, output,
    gate and up projections, and the elementwise work). About a quarter of what the matmul policy keeps, for
    recomputing the widening half of the forward's matmuls (plan/activations.lean_kept_bytes_per_token)."""
    if op in SAVED_OPS and (op not in MATMULS or narrows(op, args)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = {"selective": keep_matmuls_and_attention, "selective-lean": keep_attention_and_narrowing_matmuls}


def context_fn():
    """``torch.utils.checkpoint.checkpoint(..., context_fn=context_fn)``."""
    return create_selective_checkpoint_contexts(keep_matmuls_and_attention)


def checkpoint_kwargs(policy: str = "selective") -> dict:
    """The keyword arguments of ``activation_checkpointing_enable`` for selective checkpointing (non-reentrant:
    the only kind that takes a ``context_fn``)."""
    return {"use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, POLICIES[policy]),
            # the outputs it keeps go through the saved-tensor hooks around it, so activation offloading moves them too
            # (torch keeps them outside the hooks by default, for now)
            "respect_saved_tensors_hooks": True}


def enable(model, policy: str = "selective") -> None:
    """Selective checkpointing (``policy``: a key of ``POLICIES``) on every checkpointable layer of a transformers model
    (or a peft model around one); a UsageError naming the fix for a model it cannot serve."""

    target = model
    if not hasattr(target, "activation_checkpointing_enable") and hasattr(target, "get_base_model"):
        target = target.get_base_model()
    if not getattr(target, "supports_gradient_checkpointing", False):
        raise UsageError(f"checkpoint_layers={policy}: {type(target).__name__} does not support activation checkpointing; "
                         "drop gradient_checkpointing")
    attention = getattr(getattr(target, "config", None), "_attn_implementation", None) or "eager"
    if attention not in ATTENTION_KEPT:
        raise UsageError(f"checkpoint_layers={policy} with attn_implementation={attention!r}: the policy keeps the outputs of "
                         f"{' and '.join(ATTENTION_KEPT)} attention only, and would recompute this kernel; use "
                         f"attn_implementation=sdpa, or checkpoint_layers=all")
    target.activation_checkpointing_enable(checkpoint_kwargs(policy))
    target._hf_gpu_train_checkpoint_layers = policy  # for the planner's estimate in an OOM message (remedies.py)
