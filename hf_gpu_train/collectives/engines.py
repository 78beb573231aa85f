"""Which engine shards a Trainer's model, read from the Trainer's own flags: DeepSpeed, FSDP, or neither (DDP or one
process). One reading for the pieces that say or do something different under each (the clipping line, a resume's
checkpoint layout)."""

from __future__ import annotations

DEEPSPEED, FSDP = "DeepSpeed", "FSDP"


def sharded_engine(trainer) -> str | None:
    if getattr(trainer, "is_deepspeed_enabled", False):
        return DEEPSPEED
    if getattr(trainer, "is_fsdp_enabled", False):
        return FSDP
    return None
