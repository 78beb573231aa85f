"""Gradient clipping under DeepSpeed and FSDP: the one difference from DDP's steps that no setting removes, said
before training with its measured size.

DeepSpeed sums the squared gradient over each rank's flat partition and FSDP over each rank's shards, then
all-reduces; DDP's ``clip_grad_norm_`` (the Trainer's) takes each whole gradient's norm, then the norm of those. The
same numbers summed in another order: the clip factor agrees to about 1e-7 of itself, not bit for bit. Most runs end
within fp32 rounding of DDP's; a run whose steps amplify small differences does not, and the difference is then no
larger than DDP's own sensitivity to max_grad_norm's 7th digit (measured, issue 41: EfficientNet-Lite0 on the digits,
2 processes, 6 steps, every step clipped at 1.0: ZeRO-2 ends 6.8e-4 from DDP on a weight, two DDP runs at max_grad_norm
1.0 and 1.0000001 end 1.2e-3 apart; without clipping ZeRO-2's weights equal DDP's bit for bit)."""

from __future__ import annotations

MEASURED = ("the BatchNorm digits recipe, every step clipped: 6.8e-4 on a weight after 6 steps, while two DDP runs whose "
            "max_grad_norm differs by 1e-7 end 1.2e-3 apart")


def _sharded_engine(trainer) -> str | None:
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed"
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP"
    return None


def clip_value(trainer, engine: str) -> float:
    """What clips: DeepSpeed's own ``gradient_clipping`` where its config sets a number, else ``max_grad_norm``."""
    if engine == "DeepSpeed":
        plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
        configured = (getattr(plugin, "deepspeed_config", None) or {}).get("gradient_clipping")
        if isinstance(configured, (int, float)):
            return float(configured)
    return float(trainer.args.max_grad_norm or 0)


def clipping_order_line(trainer) -> list[str]:
    """The line to print before training where DeepSpeed or FSDP clips over several processes; nothing elsewhere."""
    engine = _sharded_engine(trainer)
    if engine is None or trainer.args.world_size < 2:
        return []
    clip = clip_value(trainer, engine)
    if clip <= 0:
        return []
    return [f"gradient clipping at {clip:g} under {engine}: the norm is summed over each rank's shard, in another order "
            "than DDP's clip_grad_norm_, so the clip factor matches DDP's to about 1e-7 of itself, not bit for bit; a run "
            f"that amplifies that ends measurably elsewhere ({MEASURED}); max_grad_norm=0 turns clipping off"]
