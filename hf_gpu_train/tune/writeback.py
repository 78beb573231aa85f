"""The winner into the launch config, so the next `hf-gpu-train launch` uses it: NAME.plan.json's values (each with
the reason "measured by hf-gpu-train tune: ...") and a block of comment lines in NAME.yaml's header with the
measured table. NAME.yaml's ``mixed_precision`` is never changed (it reaches every recipe launched with it): a tuned
precision lives in the plan, scoped to its recipe, and `hf-gpu-train launch` passes it as ``--mixed_precision`` to
that recipe's runs only. A timestamped copy of each file is made before it is changed.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..plan.run_plan_file import PlanValue, plan_path_for, recipe_identity, write_measured_values
from .candidates import Candidate, CandidateSpace
from .results import Choice, TrialResult

BLOCK_BEGIN = "# --- hf-gpu-train tune"
BLOCK_END = "# --- end of hf-gpu-train tune"
ACCELERATE_PRECISION = {"fp32": "'no'", "bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True)
class Written:
    plan: Path
    config: Path
    backups: tuple[Path, ...]
    keys: tuple[str, ...]  # the plan values replaced


def backup(path: Path, stamp: str) -> Path | None:
    """NAME.bak-STAMP beside the file (never over an earlier backup); None when there is no file."""
    if not path.exists():
        return None
    target = path.with_name(f"{path.name}.bak-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.bak-{stamp}-{n}")
        n += 1
    shutil.copy2(path, target)
    return target


def tuned_axes(space: CandidateSpace) -> dict[str, bool]:
    """Which axes had more than one option (what tune decided, and so what it may write)."""
    return {"micro_batch": len(space.micro_batches) > 1, "checkpointing": len(space.checkpointing) > 1 or len(space.policies) > 1,
            "offload": len(space.offload) > 1, "workers": len(space.workers) > 1, "precision": len(space.precisions) > 1,
            "compile": len(space.compile) > 1, "packing": len(space.packing) > 1}


def plan_values(winner: Candidate, space: CandidateSpace, reason: str, every_value: bool = False) -> dict[str, PlanValue]:
    """The plan values tune decided, in FinetuneConfig's words (gradient_accumulation_steps recorded with them);
    ``every_value``: every value of the candidate, tuned or not (a strategy's own config, whose plan was made for other
    values: its launch must run the values measured under it)."""
    axes = {axis: True for axis in tuned_axes(space)} if every_value else tuned_axes(space)
    found: dict[str, PlanValue] = {}
    world = space.world_size
    if axes["micro_batch"]:
        batch = f"micro-batch {winner.micro_batch} x accumulation {winner.accumulation} x {world} process(es)"
        found["per_device_train_batch_size"] = PlanValue(winner.micro_batch, reason)
        found["gradient_accumulation_steps"] = PlanValue(winner.accumulation, f"{batch}: {reason}")
        found["global_batch_size"] = PlanValue(space.effective_batch, f"{batch} = {space.effective_batch}, the run's effective "
                                               "batch, kept by every candidate")
    for axis, key, value in (("checkpointing", "gradient_checkpointing", winner.gradient_checkpointing),
                             ("checkpointing", "checkpoint_layers", winner.checkpoint_layers if winner.gradient_checkpointing else "all"),
                             ("offload", "offload_activations", winner.offload_activations),
                             ("workers", "dataloader_num_workers", winner.dataloader_num_workers),
                             ("precision", "precision", winner.precision), ("compile", "torch_compile", winner.torch_compile),
                             ("packing", "packing", winner.packing)):
        # every_value: no packing for a task that has none, no precision where the launch decides it ("auto")
        if axes[axis] and value is not None and not (key == "precision" and value == "auto"):
            found[key] = PlanValue(value, reason)
    return found


def header_block(choice: Choice, results: list[TrialResult], space: CandidateSpace, when: str, report_name: str,
                 notes: tuple[str, ...] = ()) -> list[str]:
    """Comment lines for NAME.yaml: the winner, why, ``notes`` (the strategy round's outcome), and every trial."""
    lines = [f"{BLOCK_BEGIN} ({when}): measured on this machine; the table and the plot: {report_name}"]
    if choice.winner is None:
        lines.append("#   no winner: nothing written to the plan")
    else:
        lines.append(f"#   winner: {choice.winner.candidate.describe()} (effective batch {space.effective_batch})")
    lines += [f"#   why: {reason}" for reason in choice.reasons]
    lines += [f"#   {note}" for note in notes]
    lines.append(f"#   trials ({space.metric} | samples/s | peak GiB | data wait | result):")
    for r in results:
        speed = r.throughput(space.metric)
        peak = "-" if r.peak_memory_bytes is None else f"{r.peak_memory_bytes / 2**30:.2f}"
        wait = "-" if r.data_wait_pct is None else f"{r.data_wait_pct:.0f}%"
        figures = f"{speed:,.1f} | {r.samples_per_s:,.1f} | {peak} | {wait}" if speed else "- | - | - | -"
        lines.append(f"#     {r.candidate.describe()}: {figures} | {r.verdict()}")
    lines.append(BLOCK_END)
    return [line.replace("\n", " ") for line in lines]


def yaml_with_block(text: str, block: list[str], precision: str | None) -> str:
    """NAME.yaml with ``block`` after its leading comment lines (an earlier tune block replaced) and, when
    ``precision`` is given, its ``mixed_precision`` line set to it."""
    lines = text.splitlines()
    if BLOCK_BEGIN in text:
        start = next(i for i, line in enumerate(lines) if line.startswith(BLOCK_BEGIN))
        end = next((i for i, line in enumerate(lines) if line.startswith(BLOCK_END)), start)
        del lines[start:end + 1]
    at = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    lines[at:at] = block
    out = "\n".join(lines) + "\n"
    if precision is not None:
        out = re.sub(r"^mixed_precision:.*$", f"mixed_precision: {ACCELERATE_PRECISION[precision]}", out, flags=re.MULTILINE)
    return out


def write_winner(config_file: Path, choice: Choice, results: list[TrialResult], space: CandidateSpace, stamp: str, when: str,
                 recipe: str | None, overrides: list[str], report_name: str, budget_s: float,
                 data: Mapping | None = None, notes: tuple[str, ...] = (), strategy_config: bool = False) -> Written:
    """Back up NAME.plan.json and NAME.yaml, then write the winner's values and the header block (``notes``: lines for
    it). ``strategy_config``: a config tune itself wrote for the winner's strategy (NAME.strategies/S.yaml, written
    again by every tune: no backup), which takes every value of the winner."""
    plan_path = plan_path_for(config_file)
    backups = () if strategy_config else tuple(b for b in (backup(plan_path, stamp), backup(config_file, stamp)) if b is not None)
    winner = choice.winner
    reason = f"measured by hf-gpu-train tune ({when}): {choice.reasons[0]}"
    values = plan_values(winner.candidate, space, reason, every_value=strategy_config) if winner else {}
    tuned = {"by": "hf-gpu-train tune", "when": when, "recipe": recipe_identity(recipe), "overrides": list(overrides),
             **({"data": dict(data)} if data is not None else {}),
             "keys": sorted(values), "metric": space.metric, "budget_s": budget_s, "effective_batch": space.effective_batch,
             "winner": winner.to_dict() if winner else None, "reasons": list(choice.reasons), "report": report_name,
             "trials": [r.to_dict() for r in results]}
    write_measured_values(plan_path, values, tuned)
    # the winner's precision stays in the plan, scoped to this recipe like every tuned value: NAME.yaml's
    # mixed_precision reaches every run launched with it, so `hf-gpu-train launch` passes --mixed_precision for this
    # recipe only (cli/launch.py)
    config_file.write_text(yaml_with_block(config_file.read_text(), header_block(choice, results, space, when, report_name, notes),
                                           None))
    return Written(plan_path, config_file, backups, tuple(sorted(values)))
