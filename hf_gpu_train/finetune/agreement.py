"""Every rank must train with the same batch, accumulation, precision and checkpointing. Each process resolves them
alone (from its recipe, the plan, this machine's detection), so nodes that differ (a plan that holds on some nodes
only, a model config one rank could not read) would train differently and hang in the first collective that no
longer matches. One gather of the resolved values before training turns that into an error naming the values per
rank, raised on every rank alike.
"""

from __future__ import annotations

import json

from .config import ConfigError

MUST_AGREE = ("per_device_train_batch_size", "gradient_accumulation_steps", "effective_batch", "precision",
              "gradient_checkpointing", "checkpoint_layers", "offload_activations", "optimizer_in_backward", "torch_compile",
              "packing", "method")


def _gather(values: dict) -> list[dict] | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return gathered


def check_ranks_agree(values: dict, gather=_gather) -> None:
    """Raise ConfigError on every rank when the ranks resolved different ``MUST_AGREE`` values."""
    gathered = gather({k: values.get(k) for k in MUST_AGREE})
    if not gathered:
        return
    differ = [k for k in MUST_AGREE if len({json.dumps(g.get(k), default=str) for g in gathered}) > 1]
    if not differ:
        return
    per_rank = "; ".join(f"{k}: " + ", ".join(f"rank {r}={g.get(k)}" for r, g in enumerate(gathered)) for k in differ)
    raise ConfigError(f"the ranks resolved different training values ({per_rank}): every rank must train the same "
                      "step. Each rank's first lines say which plan values it applied; a plan that holds on some nodes "
                      "only (other GPUs or cores) is the usual cause: give every node the same hardware, or set these "
                      "keys in the recipe")
