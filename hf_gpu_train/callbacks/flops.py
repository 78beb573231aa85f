"""Model FLOPs per training sample or token, for MFU.

Transformers: 6 x non-embedding parameters per token (forward + backward) plus the attention term
12 x layers x hidden x sequence length (nanoGPT ``estimate_mfu``; Megatron-LM). timm and other
models: forward FLOPs of one sample counted once with ``torch.utils.flop_counter`` on the CPU,
times 3 for forward + backward.
"""

from __future__ import annotations

import torch


def embedding_params(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))


def transformer_flops_per_token(model: torch.nn.Module, seq_len: float) -> float | None:
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    if not layers or not hidden:
        return None
    params = sum(p.numel() for p in model.parameters())
    dense = params - embedding_params(model)
    return 6.0 * dense + 12.0 * layers * hidden * seq_len


def counted_flops_per_sample(model: torch.nn.Module, example: dict) -> float | None:
    """Forward + backward FLOPs of one sample, counted by torch on a CPU copy of the inputs."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        device = next(model.parameters()).device
        inputs = {k: v[:1].to(device) for k, v in example.items() if isinstance(v, torch.Tensor) and k != "labels"}
        was_training = model.training
        model.eval()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(**inputs)
        model.train(was_training)
        return 3.0 * counter.get_total_flops()
    except (RuntimeError, TypeError, ValueError, StopIteration):
        return None


def mfu(flops_per_second: float | None, peak: float | None) -> float | None:
    if not flops_per_second or not peak:
        return None
    return flops_per_second / peak
