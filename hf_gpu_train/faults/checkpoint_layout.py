"""Which engine wrote a checkpoint, read from its files, against the engine about to resume from it: a resume the
Trainer would get wrong is refused before the first step, with the command that resumes it.

The Trainer resumes whatever it finds and fills in what it does not: a checkpoint DeepSpeed wrote (the optimizer's
state partitioned under ``global_stepN/``, no ``optimizer.pt``) resumed by a run without DeepSpeed loads the weights
and starts the optimizer afresh, silently (measured: the text case of the scaling tests, 2 processes under ZeRO-2,
resumed at step 4 on one process: weights 2.0e-3 from the run never interrupted, two AdamW steps' worth, and no
word). A checkpoint FSDP wrote resumed without FSDP fails inside ``train()`` after the model and data loaded, and a
plain one (``optimizer.pt``) resumed under DeepSpeed or FSDP fails in their loaders. Each is said here instead, at the
start of ``train()``, with the strategy that resumes it.

What does resume on another number of processes: DDP and one process (the optimizer's state is whole;
``finetune.run_record.keep_the_global_batch`` keeps the global batch), FSDP (``torch.distributed.checkpoint``
reshards the model's and the optimizer's shards on load), DeepSpeed ZeRO through its universal checkpoint (``deepspeed_resharding``)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..collectives.engines import DEEPSPEED, FSDP, sharded_engine
from ..errors import UsageError
from .deepspeed_resharding import latest_step_folder, load_universal

WHOLE = "DDP or one process"
_PARTITION = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


@dataclass(frozen=True)
class CheckpointLayout:
    """``engine``: DEEPSPEED, FSDP or WHOLE; ``partitions``: the DeepSpeed ranks whose optimizer partitions it holds
    (None for the others)."""

    engine: str
    partitions: int | None = None


def layout_of(checkpoint: str | Path) -> CheckpointLayout | None:
    """The layout a checkpoint folder's files show; None where it holds no optimizer state of any engine (a
    ``save_only_model`` checkpoint: ``checkpoint_marker.say_an_inexact_resume`` speaks of it)."""
    try:
        entries = list(Path(checkpoint).iterdir())
    except OSError:
        return None
    names = {p.name for p in entries}
    step = latest_step_folder(Path(checkpoint))
    if step is not None:
        ranks = {m.group(1) for f in step.iterdir() if (m := _PARTITION.match(f.name))}
        return CheckpointLayout(DEEPSPEED, len(ranks) or None)
    if any(name.startswith(("pytorch_model_fsdp", "optimizer_0")) for name in names):
        return CheckpointLayout(FSDP)
    if any(name.startswith("optimizer.") for name in names):
        return CheckpointLayout(WHOLE)
    return None


def _local_processes(trainer) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", trainer.args.world_size))


def engine_of(trainer) -> str:
    return sharded_engine(trainer) or WHOLE


_RESUMES_IT = {
    DEEPSPEED: "under DeepSpeed with the same ZeRO stage (hf-gpu-train config --strategy deepspeed-zero2 or -zero3)",
    FSDP: "under FSDP, on any number of processes (hf-gpu-train config --strategy fsdp: torch.distributed.checkpoint "
          "reshards it)",
    WHOLE: "under DDP or on one process, on any number of processes (hf-gpu-train config --strategy ddp, or a "
           "single-GPU config)",
}
_WOULD = {
    (DEEPSPEED, WHOLE): "would load the weights and start the optimizer afresh, without a word (its state is DeepSpeed's "
                        "partitions under global_step*/, no optimizer.pt)",
    (FSDP, WHOLE): "cannot load it (transformers stops inside train(): only supported when using PyTorch FSDP)",
}


def check_resume(trainer, checkpoint: str | Path | None, processes: int) -> None:
    """``UsageError`` where the engine about to resume from ``checkpoint`` would get it wrong; nothing where it resumes
    it (or there is nothing to resume). Every rank reads the same files and decides alike."""
    if not checkpoint or not isinstance(checkpoint, (str, Path)):
        return
    layout = layout_of(checkpoint)
    if layout is None:
        return
    now = engine_of(trainer)
    name = Path(checkpoint).name
    if layout.engine != now:
        would = _WOULD.get((layout.engine, now), f"cannot load it ({now}'s loader looks for its own files there)")
        raise UsageError(f"hf_gpu_train: {name} was written under {layout.engine} and this run is {now}, which {would}. "
                         f"Resume it {_RESUMES_IT[layout.engine]}; or start a new run from its weights (a new "
                         f"output_dir, the model from {checkpoint})")
    if now == DEEPSPEED and layout.partitions not in (None, processes):
        if getattr(trainer.args, "save_on_each_node", False) and trainer.args.world_size > max(1, _local_processes(trainer)):
            raise UsageError(f"hf_gpu_train: {name} holds DeepSpeed's optimizer state in {layout.partitions} partitions "
                             f"on this node's disk (save_on_each_node: each node keeps its own ranks' partitions) and this "
                             f"run has {processes} processes: resume it on {layout.partitions}, or keep checkpoints on "
                             "storage every node shares (save_on_each_node=false) to change the count")
        load_universal(trainer, checkpoint, layout.partitions, processes)
