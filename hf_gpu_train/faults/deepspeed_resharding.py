"""A DeepSpeed ZeRO checkpoint resumed on another number of processes, through DeepSpeed's universal checkpoint.

DeepSpeed keeps the optimizer's state partitioned, one file per data-parallel rank, and refuses to load it on another
number of ranks ("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not currently
supported"). What it offers instead is its universal checkpoint: ``deepspeed.checkpoint.ds_to_universal`` merges the
partitions into one folder per parameter (fp32 weights, Adam's two moments), and an engine configured with
``checkpoint.load_universal`` slices them for its own ranks. Here the main process converts
``checkpoint-N/global_stepN`` into ``checkpoint-N/global_stepN_universal`` (once: a second resume finds it; written
beside, never over, the original), every rank waits for it, and the run's DeepSpeed config is told to load it.

DeepSpeed's ZeRO-3 loader gives every sub-group's Adam state one and the same ``step`` tensor, which the optimizer then
increments once per sub-group each step: the bias correction runs ahead (measured: the scaling tests' text run, ZeRO-3
on 2 processes resumed at step 4 on 1, every weight ~2e-5 from the run never interrupted after 2 steps, 6% of a step).
It also sets every parameter group's hyperparameters to the first group's, so the Trainer's group without weight
decay (biases, norms) is decayed from then on (5e-6 on a LayerNorm weight after 2 steps in the same run). Once the
checkpoint is loaded each sub-group gets its own step and each group its own weight decay back (``_as_built``): then
2 -> 1 and 1 -> 2 end within fp32 rounding of the uninterrupted run.

The conversion reads every partition on one process (host memory: the fp32 weights and both moments, 12 bytes a
parameter, about 96 GB for an 8B model) and takes its time (measured in the test's tiny model: seconds)."""

from __future__ import annotations

import logging
import shutil
from argparse import Namespace
from pathlib import Path

from ..collectives.cpu_votes import wait_for_every_rank

log = logging.getLogger("hf_gpu_train.faults")


def universal_folder(step_folder: Path) -> Path:
    return step_folder.with_name(f"{step_folder.name}_universal")


def convert(step_folder: Path) -> Path:
    """``global_stepN`` as DeepSpeed's universal checkpoint beside it (kept if a former resume wrote it whole)."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    target = universal_folder(step_folder)
    if target.is_dir() and (step_folder.parent / "latest_universal").read_text().strip() == target.name:
        return target
    partial = step_folder.with_name(f"{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    ds_to_universal(Namespace(input_folder=str(step_folder), output_folder=str(partial), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
    partial.rename(target)
    (step_folder.parent / "latest_universal").write_text(target.name)  # ds_to_universal named the partial folder
    return target


def load_universal(trainer, checkpoint: str | Path, partitions: int, processes: int) -> str:
    """Convert (main process; every rank waits) and configure the engine to load the universal checkpoint; the line
    to say."""
    steps = sorted(p for p in Path(checkpoint).iterdir() if p.is_dir() and p.name.startswith("global_step")
                   and not p.name.endswith(("_universal", ".partial")))
    if trainer.args.should_save:
        log.warning("hf_gpu_train: %s holds DeepSpeed's optimizer state in %d partitions and this run has %d processes: "
                    "converting it to DeepSpeed's universal checkpoint (%s), which every rank loads its own slice of",
                    Path(checkpoint).name, partitions, processes, universal_folder(steps[-1]).name)
        convert(steps[-1])
    wait_for_every_rank()
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    config.setdefault("checkpoint", {})["load_universal"] = True
    _as_built_after_loading()
    return universal_folder(steps[-1]).name


def _inner_optimizer(engine):
    return getattr(getattr(engine, "optimizer", None), "optimizer", None)


def _as_built(engine, weight_decays: list) -> None:
    """Every Adam state's ``step`` its own tensor, and every parameter group's weight decay as the Trainer built it
    (DeepSpeed's ZeRO-3 universal loader shares one step among sub-groups and copies the first group's decay)."""
    inner = _inner_optimizer(engine)
    for state in getattr(inner, "state", {}).values():
        step = state.get("step")
        if hasattr(step, "clone"):
            state["step"] = step.clone()
    for group, decay in zip(getattr(inner, "param_groups", []), weight_decays):
        if decay is not None:
            group["weight_decay"] = decay


def _as_built_after_loading() -> None:
    """The Trainer's next ``deepspeed_load_checkpoint`` (the one this resume makes) followed by ``_as_built``."""
    import transformers.trainer as trainer_module

    original = trainer_module.deepspeed_load_checkpoint

    def load_then_rebuild(engine, *args, **kwargs):
        trainer_module.deepspeed_load_checkpoint = original
        decays = [group.get("weight_decay") for group in getattr(_inner_optimizer(engine), "param_groups", [])]
        result = original(engine, *args, **kwargs)
        _as_built(engine, decays)
        return result

    trainer_module.deepspeed_load_checkpoint = load_then_rebuild
