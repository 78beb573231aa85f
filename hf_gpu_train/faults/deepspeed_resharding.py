"""A DeepSpeed ZeRO checkpoint resumed on another number of processes, through DeepSpeed's universal checkpoint.

DeepSpeed keeps the optimizer's state partitioned, one file per data-parallel rank, and refuses to load it on another
number of ranks ("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not currently
supported"). What it offers instead is its universal checkpoint: ``deepspeed.checkpoint.ds_to_universal`` merges the
partitions into one folder per parameter (fp32 weights, Adam's two moments), and an engine configured with
``checkpoint.load_universal`` slices them for its own ranks. Here global rank 0 converts the step ``latest`` names
(``checkpoint-N/global_stepN``) into ``checkpoint-N/global_stepN_universal`` (once: a later resume finds it; written
beside, never over, the original; a failed conversion stops every rank), and the run's engine loads it once.

What DeepSpeed's universal load leaves out or gets wrong is put right once the checkpoint is loaded (``_as_saved``):
- it loads no module state, so buffers (BatchNorm's running statistics) would keep the freshly built model's values:
  they are read from the checkpoint's own model-states file;
- ZeRO-3's loader gives every sub-group's Adam state one and the same ``step`` tensor, which the optimizer then
  increments once per sub-group each step, so the bias correction runs ahead (measured: the scaling tests' text run,
  ZeRO-3 on 2 processes resumed at step 4 on 1, every weight ~2e-5 from the run never interrupted after 2 steps);
- it copies the first parameter group's hyperparameters to every group, so the Trainer's group without weight decay
  (biases, norms) is decayed from then on (5e-6 on a LayerNorm weight after 2 steps, same run): every group's are
  restored from the checkpoint's ``optimizer_state.pt``;
- the engine would go on looking for universal checkpoints (``_load_best_model`` at the end): told not to.

Cost: the conversion reads one partition at a time on one process; its output stays beside the checkpoint, about 12
bytes a parameter on disk (fp32 weights and both moments: about 96 GB for an 8B model), plus a temporary folder while
it runs. Not for checkpoints on each node's own disk (``save_on_each_node`` over several nodes): each node holds only
its own ranks' partitions, so a count change is refused there (``checkpoint_layout``)."""

from __future__ import annotations

import logging
import shutil
from argparse import Namespace
from pathlib import Path

from ..collectives.cpu_votes import any_rank

log = logging.getLogger("hf_gpu_train.faults")


def latest_step_folder(checkpoint: Path) -> Path | None:
    """The ``global_step*`` folder DeepSpeed itself would load: the one its ``latest`` file names, else the highest."""
    latest = checkpoint / "latest"
    if latest.is_file() and (checkpoint / latest.read_text().strip()).is_dir():
        return checkpoint / latest.read_text().strip()
    steps = [p for p in checkpoint.glob("global_step*") if p.is_dir() and p.name[len("global_step"):].isdigit()]
    return max(steps, key=lambda p: int(p.name[len("global_step"):]), default=None)


def universal_folder(step_folder: Path) -> Path:
    return step_folder.with_name(f"{step_folder.name}_universal")


def convert(step_folder: Path) -> Path:
    """``global_stepN`` as DeepSpeed's universal checkpoint beside it (kept if a former resume wrote it whole)."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    target = universal_folder(step_folder)
    marker = step_folder.parent / "latest_universal"
    if target.is_dir() and marker.is_file() and marker.read_text().strip() == target.name:
        return target
    partial = step_folder.with_name(f"{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    ds_to_universal(Namespace(input_folder=str(step_folder), output_folder=str(partial), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
    partial.rename(target)
    marker.write_text(target.name)  # ds_to_universal named the partial folder
    return target


def load_universal(trainer, checkpoint: str | Path, partitions: int, processes: int) -> None:
    """Convert (global rank 0; every rank learns whether it worked) and have the engine load the universal checkpoint
    this once."""
    step_folder = latest_step_folder(Path(checkpoint))
    failed = False
    if trainer.args.process_index == 0:
        log.warning("hf_gpu_train: %s holds DeepSpeed's optimizer state in %d partitions and this run has %d processes: "
                    "converting it to DeepSpeed's universal checkpoint (%s), which every rank loads its own slice of",
                    Path(checkpoint).name, partitions, processes, universal_folder(step_folder).name)
        try:
            convert(step_folder)
        except Exception:
            log.exception("hf_gpu_train: converting %s to DeepSpeed's universal checkpoint failed", step_folder)
            failed = True
    if any_rank(failed):
        raise RuntimeError(f"hf_gpu_train: converting {step_folder} to DeepSpeed's universal checkpoint failed (the "
                           f"error is above, from rank 0); resume it on {partitions} processes, as it was written")
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    config.setdefault("checkpoint", {})["load_universal"] = True
    _as_saved_after_loading(step_folder, config)


def _inner_optimizer(engine):
    return getattr(getattr(engine, "optimizer", None), "optimizer", None)


def _as_saved(engine, step_folder: Path) -> None:
    """What DeepSpeed's universal load left out or got wrong, as the checkpoint has it (the module docstring)."""
    import torch

    states = sorted(step_folder.glob("*model_states.pt"))  # mp_rank_00_... (ZeRO-1/2), zero_pp_rank_0_mp_rank_00_... (3)
    if states:
        # mapped, not read: ZeRO-1/2's file holds the whole 16-bit model, of which only the buffers are wanted
        saved = torch.load(states[0], map_location="cpu", weights_only=False, mmap=True).get("module") or {}
        with torch.no_grad():
            for name, buffer in engine.module.named_buffers():
                if name in saved and saved[name].shape == buffer.shape:
                    buffer.copy_(saved[name].to(buffer.device, buffer.dtype))
    inner = _inner_optimizer(engine)
    for state in getattr(inner, "state", {}).values():
        step = state.get("step")
        if hasattr(step, "clone"):
            state["step"] = step.clone()
    optimizer_state = universal_folder(step_folder) / "zero" / "optimizer_state.pt"
    if optimizer_state.is_file() and inner is not None:
        # ZeRO-3's file (its loader copies the first group's to all); ZeRO-1/2's loader keeps each group's own
        groups = (torch.load(optimizer_state, map_location="cpu", weights_only=False).get("optimizer_state_dict") or {}).get(
            "param_groups") or []
        if len(groups) == len(inner.param_groups):
            for group, saved_group in zip(inner.param_groups, groups):
                group.update({k: v for k, v in saved_group.items() if k != "params"})
    engine._config.load_universal_checkpoint = False  # later loads (the best model at the end) are DeepSpeed's own


def _as_saved_after_loading(step_folder: Path, config: dict) -> None:
    """The Trainer's next ``deepspeed_load_checkpoint`` (the one this resume makes) followed by ``_as_saved``; the
    plugin's config back to DeepSpeed's own checkpoints after it."""
    import transformers.trainer as trainer_module

    original = trainer_module.deepspeed_load_checkpoint

    def load_then_put_right(engine, *args, **kwargs):
        trainer_module.deepspeed_load_checkpoint = original
        try:
            result = original(engine, *args, **kwargs)
        finally:
            config.get("checkpoint", {}).pop("load_universal", None)
        _as_saved(engine, step_folder)
        return result

    trainer_module.deepspeed_load_checkpoint = load_then_put_right
