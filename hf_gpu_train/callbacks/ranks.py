"""At log steps only: every rank's compact summary to all ranks, in one collective.

The summary carries what rank 0 needs to show each rank and name uneven memory, and this rank's token
count since the last log, so the run's tokens are summed here instead of in a collective per step. Which rank is slow
is not judged here: a rank's own step time cannot tell it (``arrivals.py`` does, by arrival at the collectives).
"""

from __future__ import annotations

import logging
import socket

import torch

log = logging.getLogger("hf_gpu_train.telemetry")
UNEVEN_MEMORY_FRACTION = 0.2


def world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def gather_ranks(metrics: dict[str, float], gpus: list[int], tokens: int, is_world_zero: bool) -> tuple[list[dict], int]:
    """(per-rank summaries, and an ``{"uneven_memory": True}`` entry when so; tokens of all ranks). One process:
    ([], tokens)."""
    world = world_size()
    if world < 2:
        return [], tokens
    steps = max(1.0, metrics.get("loop/steps", 1.0))
    own_time = metrics.get("loop/data_wait_s", 0.0) / steps + metrics.get("loop/forward_time_s", 0.0)
    mine = {"rank": torch.distributed.get_rank(), "host": socket.gethostname(), "gpus": gpus,
            "own_step_time_s": own_time, "step_time_s": metrics.get("loop/step_time_s"),
            "data_wait_pct": metrics.get("loop/data_wait_pct"), "tokens": tokens,
            "mem_used_gib": next((v for k, v in metrics.items() if k.endswith("/mem_used_gib")), None),
            "torch_mem_allocated_gib": metrics.get("torch/mem_allocated_gib")}
    gathered: list[dict] = [None] * world  # type: ignore[list-item]
    torch.distributed.all_gather_object(gathered, mine)
    memory = [r["mem_used_gib"] or r["torch_mem_allocated_gib"] for r in gathered]
    memory = [m for m in memory if m is not None]
    uneven = bool(memory) and max(memory) > 0 and (max(memory) - min(memory)) / max(memory) >= UNEVEN_MEMORY_FRACTION
    if is_world_zero and uneven:
        log.warning("telemetry: uneven memory across ranks: %s GiB", [round(m, 2) for m in memory])
    total_tokens = sum(int(r.get("tokens") or 0) for r in gathered)
    return gathered + ([{"uneven_memory": True}] if uneven else []), total_tokens
