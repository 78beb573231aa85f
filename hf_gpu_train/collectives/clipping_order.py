"""Gradient clipping under DeepSpeed and FSDP: summed in another order than DDP's, so not bit for bit DDP's clip; said
before training, with the size measured in one run.

DeepSpeed sums the squared gradient over each rank's flat partition and FSDP over each rank's shards, then
all-reduces; DDP's ``clip_grad_norm_`` (the Trainer's) takes each whole gradient's norm, then the norm of those. The
same numbers summed in another order: the clip factor agrees to about 1e-7 of itself, not bit for bit. How far that
moves a run depends on the run: the text runs of the test suite end within fp32 rounding of DDP's, and the one
BatchNorm run measured (issue 41, ``benchmarks/strategy_agreement.py``: the EfficientNet-Lite0 digits recipe, 2
processes of 8 images, 6 steps, every step clipped at 1.0) ends 6.8e-4 from DDP on a weight, while two DDP runs at
max_grad_norm 1.0 and 1.0000001 end 1.2e-3 apart; without clipping its weights equal DDP's bit for bit. Turning
clipping off (``max_grad_norm=0``) removes the difference. Other differences from DDP (ZeRO-Offload's one parameter
group) are said where they arise (docs/deepspeed.md)."""

from __future__ import annotations

from .engines import sharded_engine

MEASURED = ("in one BatchNorm run measured, every step clipped: 6.8e-4 on a weight after 6 steps, while two DDP runs whose "
            "max_grad_norm differs by 1e-7 end 1.2e-3 apart")


def clipping_order_line(trainer) -> list[str]:
    """The line to print before training where DeepSpeed or FSDP clips over several processes; nothing elsewhere."""
    engine = sharded_engine(trainer)
    if engine is None or trainer.args.world_size < 2:
        return []
    clip = float(trainer.args.max_grad_norm or 0)  # DeepSpeed's gradient_clipping: "auto" or the same (transformers refuses others)
    if clip <= 0:
        return []
    return [f"gradient clipping at {clip:g} under {engine}: the norm is summed over each rank's shard, in another order "
            "than DDP's clip_grad_norm_, so the clip factor matches DDP's to about 1e-7 of itself, not bit for bit; a run "
            f"that amplifies that ends measurably elsewhere ({MEASURED}); max_grad_norm=0 turns clipping off"]
