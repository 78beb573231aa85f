"""Samples/s, tokens/s, model FLOP/s and MFU of one log window: pure arithmetic, tested on numbers.

The denominator is the window's *training* time (step time + the gap before each step), never wall
time: an ``evaluate()`` or a checkpoint save inside the window would otherwise show up as a slower GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from .flops import mfu


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
