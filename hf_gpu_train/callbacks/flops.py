"""Model FLOPs and the throughput of a log window, for MFU.

Model FLOPs per training token or sample, for MFU.

Transformers (anything with ``config.num_hidden_layers`` / ``hidden_size``): FLOPs per token are
counted per matmul weight of N elements (``nn.Linear``, and transformers' GPT-2 ``Conv1D``), in module
order, which is forward order for these models:

- forward: 2N;
- gradient of the weight: 2N when the weight is trainable;
- gradient of the input: 2N when some parameter *before* it is trainable (the gradient has to flow
  through this matmul to reach it).

Full fine-tuning gives the familiar 6N per token (nanoGPT ``estimate_mfu``; Megatron-LM). LoRA, where
the big weights are frozen but adapters sit in every layer, gives about 6 x N_trainable + 4 x N_frozen:
frozen weights skip their weight gradient but still pass gradients down. A frozen backbone under a
trainable head costs 2 x N_frozen. The lm_head counts even when tied to the embeddings (it is a
matmul); embedding lookups, norms and biases are not counted (no matmul, or negligible).

Attention adds 4 x layers x hidden x T FLOPs per token in the forward pass (QK^T and AV over a
context of T), and twice that in the backward when gradients flow through the layers: 12 x L x H x T in
training, 4 x L x H x T when only the head trains. Recomputation under gradient checkpointing is not
model FLOPs and is not counted (that would be hardware FLOPs).

Other models (timm): forward FLOPs of one sample counted once with ``torch.utils.flop_counter`` on the
model's device, times 3 for forward + backward.

Samples/s, tokens/s, model FLOP/s and MFU of one log window: pure arithmetic, tested on numbers.

The denominator is the window's *training* time (step time + the gap before each step), never wall
time: an ``evaluate()`` or a checkpoint save inside the window would otherwise show up as a slower GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _matmul_numel(module: torch.nn.Module) -> int | None:
    """Elements of the weight of a matmul module (a 4-bit packed weight by its real shape), else None."""
    if not (isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"):
        return None
    weight = getattr(module, "weight", None)
    if weight is None:
        return None
    shape = getattr(getattr(weight, "quant_state", None), "shape", None) or weight.shape
    return math.prod(shape)


def dense_flops_per_token(model: torch.nn.Module) -> tuple[float, bool]:
    """(matmul FLOPs per training token, whether gradients flow back through the layers, i.e. into a
    matmul before the last one: then the attention between them runs its backward too)."""
    flops = 0.0
    trainable_before = False
    gradient_reaches: list[bool] = []  # per matmul, in order: does an input gradient pass through it?
    for module in model.modules():
        numel = _matmul_numel(module)
        own_trainable = any(p.requires_grad for p in module.parameters(recurse=False))
        if numel is not None:
            flops += 2.0 * numel * (1 + int(own_trainable) + int(trainable_before))
            gradient_reaches.append(trainable_before)
        trainable_before = trainable_before or own_trainable
    return flops, any(gradient_reaches[:-1])


def transformer_flops_per_token(model: torch.nn.Module, seq_len: float) -> float | None:
    """Training FLOPs per token at a context of ``seq_len`` tokens; None for models without a transformer config."""
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    hidden = getattr(config, "hidden_size", None)
    if not layers or not hidden:
        return None
    dense, through = dense_flops_per_token(model)
    return dense + attention_flops_per_token_per_position(layers, hidden, through) * seq_len


def attention_flops_per_token_per_position(layers: int, hidden: int, backward_through_layers: bool = True) -> float:
    return (12.0 if backward_through_layers else 4.0) * layers * hidden


def counted_flops_per_sample(model: torch.nn.Module, example: dict) -> float | None:
    """Forward + backward FLOPs of one sample, counted by torch on a copy of the inputs."""
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


@dataclass(frozen=True)
class ModelFlops:
    """Training FLOPs of the model: per token (transformers, plus the attention term per token of
    context) or per sample (anything else, counted once)."""

    per_token: float | None = None
    attention_per_token_per_position: float = 0.0  # 12 x layers x hidden: times the mean sequence length
    per_sample: float | None = None


def window_throughput(train_time_s: float | None, steps: float, samples_per_step: int, tokens: int, flops: ModelFlops,
                      peak_flops_per_gpu: float | None, world: int) -> dict[str, float]:
    """Metrics of a window: ``loop/samples_per_s``, ``loop/tokens``, ``loop/tokens_per_s``,
    ``loop/model_tflops_per_s``, ``loop/mfu_pct`` (each only when known). ``tokens`` is the count of all ranks."""
    out: dict[str, float] = {}
    if tokens:
        out["loop/tokens"] = float(tokens)
    if not train_time_s or not steps:
        return out
    samples_per_s = steps * samples_per_step / train_time_s
    out["loop/samples_per_s"] = samples_per_s
    tokens_per_s = tokens / train_time_s if tokens else None
    if tokens_per_s:
        out["loop/tokens_per_s"] = tokens_per_s
    flops_per_s = None
    if flops.per_token is not None and tokens_per_s:
        mean_seq = tokens_per_s / samples_per_s
        flops_per_s = tokens_per_s * (flops.per_token + flops.attention_per_token_per_position * mean_seq)
    elif flops.per_sample is not None:
        flops_per_s = samples_per_s * flops.per_sample
    if flops_per_s:
        out["loop/model_tflops_per_s"] = flops_per_s / 1e12
        value = mfu(flops_per_s / max(1, world), peak_flops_per_gpu)
        if value is not None:
            out["loop/mfu_pct"] = 100.0 * value
    return out
