"""What the causal-LM checks that run the model share: whether this process can run it, and one verdict for all ranks.

Packing (``packing.packing_support``) and the chunked head (``lm_head_loss.head_probe``) are proven on the loaded
model, not assumed from its name, by a forward of a few tokens. A process cannot always run one: under FSDP's
rank-0-only loading the other ranks hold ``meta`` weights, under DeepSpeed ZeRO-3's ``zero.Init`` every rank holds
only its partition, and a model of billions of parameters still on the CPU takes minutes. Those processes say so,
and the verdict every rank acts on is agreed: any rank's refusal is everyone's, since ranks that pack (or chunk) while
others do not train different steps, or hang.
"""

from __future__ import annotations

PROBE_PARAMS_ON_CPU = 2_000_000_000  # above this, a model still on the CPU is not run for a probe (minutes in bf16)


def why_not_runnable(model) -> str | None:
    """None when this process can run ``model`` for a probe of a few tokens; else why not."""
    parameters = list(model.parameters())
    if not parameters:
        return "it has no parameters on this process"
    if any(p.device.type == "meta" for p in parameters):
        return "weights not loaded on this process"
    if any(hasattr(p, "ds_id") for p in parameters):  # DeepSpeed ZeRO-3 partitioned it as it loaded (zero.Init)
        return "weights partitioned by DeepSpeed ZeRO-3"
    if parameters[0].device.type == "cpu" and sum(p.numel() for p in parameters) > PROBE_PARAMS_ON_CPU:
        return "too large to run on the CPU for the check"
    return None


def probe_tokens(vocab: int, count: int, offset: int) -> list[int]:
    """``count`` token ids spread over the vocabulary (never only the first few, which are often special tokens)."""
    return [(7 * k + offset) % vocab for k in range(count)]


def agreed(supported: bool, reason: str, everyone: str) -> tuple[bool, str]:
    """(supported, reason) as every rank must act on it: a refusal on any rank is every rank's, named with the rank
    that found it and ``everyone`` (what all ranks then do). Without a process group: as given."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return supported, reason
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (supported, reason))
    refused = [(rank, why) for rank, (ok, why) in enumerate(seen) if not ok]
    if not refused:
        return supported, reason
    rank, why = refused[0]
    return False, why if rank == dist.get_rank() else f"{why} (found on rank {rank}: {everyone})"
