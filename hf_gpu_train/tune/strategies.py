"""Tune's strategy round: the distribution strategies a launch config of several processes may run, each measured as
a candidate in a launch of its own config. Pure: no torch, no files (``cli/tune.py`` renders the configs and launches).

Why a round of launches and not one more axis of the search: the search's trials share one loaded model in one launch
(``trials.py``), and a strategy is fixed when the processes start (accelerate reads it from the launch's environment;
DeepSpeed and FSDP wrap the model in place, ZeRO-3 partitions it as it loads). So each strategy gets a config of its own,
written as `hf-gpu-train config --strategy S` writes it (the config's own command with another ``--strategy``), and one
launch that measures one trial at the same values: the search's winner (micro-batch, accumulation, so the same effective
batch, checkpointing, workers, precision) over the same measured steps, by the same meter. What is searched under the
config's own strategy only: the micro-batch and the other axes.

The default is no round (``--strategies`` unset: the config's own strategy): every strategy costs a launch (its model
and data loaded again: seconds on the CPU, minutes for a large model on GPUs), and the planner already chose the
config's strategy by memory: DDP where a whole replica fits, which is the fastest where it fits (no gathering of
parameters or partitioned optimizer steps). The round answers the question when it is asked: ``--strategies all``.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from ..errors import UsageError
from ..plan.scope import planned_strategy
from ..plan.strategies import DEEPSPEED, FSDP, REPLICATED, family_of, replica_strategy, strategy_names

# what --strategies all measures beside the config's own, in this order: DDP, DeepSpeed's ZeRO stages, FSDP (where the
# planner allows it; the CPU's is a rehearsal of the GPU run, FSDP2 over gloo); the offload variants are last resorts,
# slower by design: measured only when named
ROUND = (replica_strategy(True), *strategy_names(lambda s: s.askable and s.family == DEEPSPEED and not s.offload),
         *strategy_names(lambda s: s.askable and s.family == FSDP))
BY_NAME = (*ROUND, *strategy_names(lambda s: s.askable and s.offload))
WORDS = ("all", "own")
FOLDER_SUFFIX = ".strategies"  # NAME.strategies/S.yaml (.env, .plan.json) beside NAME.yaml


def own_strategy(plan) -> str:
    """The strategy the config launches, in the planner's words (``ddp``, ``single``, ``fsdp``, ``deepspeed-zero2``)."""
    return planned_strategy(str(plan.strategy.value or "")) or replica_strategy(False)


def shards(strategy: str) -> bool:
    """Whether a strategy wraps the model (FSDP, DeepSpeed): such a launch measures one trial, never a search."""
    return family_of(strategy) != REPLICATED


def _same(asked: str, own: str) -> bool:
    """``--strategy fsdp`` lets the planner pick the FSDP variant: any FSDP config is the config's own FSDP."""
    return asked == own or (asked in strategy_names(lambda s: s.askable and s.family == FSDP) and family_of(own) == FSDP)


def parse_strategies(text: str | None, own: str, world_size: int, config_name: str) -> tuple[str, ...]:
    """The strategies to measure beside the config's own, in the order given, from ``--strategies``: names of
    ``BY_NAME``, ``all`` (``ROUND``) and ``own`` (the config's, always measured). UsageError for a name that is not a
    strategy, or for a config of one process (one process has one strategy)."""
    if text is None:
        return ()
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in (*BY_NAME, *WORDS)]
    if unknown or not names:
        bad = f"{unknown[0]!r} is not a strategy" if unknown else "no strategy named"
        raise UsageError(f"--strategies {text}: {bad}: use all, own or names from {', '.join(BY_NAME)} "
                         "(e.g. --strategies ddp,deepspeed-zero2)")
    others: list[str] = []
    for strategy in [n for name in names for n in (ROUND if name == "all" else (name,))]:
        if strategy != "own" and not _same(strategy, own) and strategy not in others:
            others.append(strategy)
    if others and world_size < 2:
        raise UsageError(f"--strategies {text}: {config_name} launches 1 process, and one process has one strategy: tune a "
                         "config of several (`hf-gpu-train config --num-processes 2` on a CPU, `--gpus N` on GPUs), or leave "
                         "--strategies out")
    return tuple(others)


def strategies_folder(config_file: Path) -> Path:
    """NAME.strategies beside NAME.yaml: the config of each strategy the round measured."""
    return config_file.with_name(config_file.stem + FOLDER_SUFFIX)


def strategy_config_argv(command: str | None, strategy: str, output: str | Path | None = None, machine: str | None = None,
                         force: bool = False) -> list[str]:
    """``hf-gpu-train config ...`` (the command that wrote the config, from its plan) with ``--strategy strategy`` (and
    ``--output``, ``--machine`` replaced when given, ``--force`` added): the arguments after ``hf-gpu-train``."""
    words = shlex.split(command or "")
    if words[:1] == ["hf-gpu-train"]:
        words = words[1:]
    if words[:1] != ["config"]:
        raise UsageError(f"the plan's command {command!r} is not an `hf-gpu-train config` line: regenerate the config with "
                         "`hf-gpu-train config --output ...` so tune can write one for each strategy")
    replaced = {"--strategy": strategy, **({"--output": str(output)} if output is not None else {}),
                **({"--machine": machine} if machine is not None else {})}
    kept: list[str] = []
    i = 1
    while i < len(words):
        name, eq, _ = words[i].partition("=")
        if name in replaced:
            i += 1 if eq else 2
            continue
        if name == "--force":
            i += 1
            continue
        kept.append(words[i])
        i += 1
    kept += [item for name, value in replaced.items() for item in (name, value)]
    return ["config", *kept, *(["--force"] if force else [])]


def command_text(argv: Sequence[str]) -> str:
    return "hf-gpu-train " + " ".join(shlex.quote(a) for a in argv)
