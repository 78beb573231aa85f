"""What a plan's values were made for, against what this run trains: a value planned or measured for one thing is
applied to nothing else without the run saying so.

`hf-gpu-train config --model X` plans the micro-batch, the global batch and checkpointing for X at X's sequence
length (or image size) and method. A launch config serves many recipes, so a run often trains something else: then
those values are not applied (the recipe's own are kept), the run says which and why in one line, and the memory
check speaks about the model this run trains, not the plan's. Machine-derived values (precision, NCCL, threads)
still apply: they belong to the machine, not the model.
"""

from __future__ import annotations

import dataclasses

from ..plan.model_spec import model_fingerprint as fingerprint
from .config import FinetuneConfig
from .tasks.base import task_for

# the values a memory plan (or tune) decides for one model, sequence length and method
MEMORY_KEYS = ("per_device_train_batch_size", "global_batch_size", "gradient_checkpointing", "torch_compile", "packing",
               "chunked_lm_loss", "checkpoint_layers", "offload_activations", "optimizer_in_backward")


def _count(value) -> str:
    if isinstance(value, int) and value >= 10**9:
        return f"{value / 1e9:.1f}B"
    if isinstance(value, int) and value >= 10**6:
        return f"{value / 1e6:.1f}M"
    return str(value)


def canonical_name(name: str) -> str:
    """One name per model: the builtin names as the planner resolves them, timm names with their prefix, local
    directories as absolute paths."""
    from pathlib import Path

    from ..plan.model_spec import BUILTIN_MODELS

    if name == "builtin:minilm":
        from .builtin import minilm_path

        name = minilm_path()
    name = BUILTIN_MODELS.get(name, name)
    if Path(name).exists():
        return str(Path(name).resolve())
    return name


def run_model_spec(cfg: FinetuneConfig):
    """The planner's spec of the model this run trains (its config on the meta device; timm's census), or None with
    the reason when it cannot be read here. Best effort: whatever goes wrong reading it is said, never raised."""
    from ..plan.model_spec import resolve_model

    name = cfg.model
    if name == "builtin:smollm2":
        from .causal_lm.smollm2 import converted_dir, is_converted

        if not is_converted():
            return None, "builtin:smollm2 is not converted yet"
        name = str(converted_dir())
    try:
        return resolve_model(name, cfg.image_size), None
    except Exception as error:  # noqa: BLE001 (any model's own code runs here; the run must not die of a check)
        return None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _method(cfg: FinetuneConfig) -> str:
    return cfg.method if cfg.method in task_for(cfg.task).methods else "full"


def differences(plan, cfg: FinetuneConfig, spec) -> list[str]:
    """Where this run needs more than the plan's memory values were made for ([] when they still hold). A run that
    needs less (a shorter sequence, a smaller image, LoRA where the plan was for full fine-tuning) keeps them: the
    plan's micro-batch is a bound that still fits."""
    m = plan.memory
    found = []
    if spec is not None and fingerprint(m.model) != fingerprint(spec):
        ours, theirs = fingerprint(spec), fingerprint(m.model)
        detail = ", ".join(f"{k} {_count(theirs[k])} -> {_count(ours[k])}" for k in ours if ours[k] != theirs[k])
        found.append(f"model {m.model.name} -> {cfg.model} ({detail})")
    vision = task_for(cfg.task).images
    if vision and cfg.image_size and m.image_size and cfg.image_size > m.image_size:
        found.append(f"image size {m.image_size} -> {cfg.image_size}")
    if not vision and cfg.max_length and m.seq_len and cfg.max_length > m.seq_len:
        found.append(f"sequence length {m.seq_len} -> {cfg.max_length}")
    heavier = {"qlora": 0, "lora": 1, "full": 2}
    if heavier.get(_method(cfg), 2) > heavier.get(m.method, 2):
        found.append(f"method {m.method} -> {_method(cfg)}")
    if m.optimizer != "adamw":  # scripts/finetune.py trains with AdamW (two fp32 moments per parameter)
        found.append(f"optimizer {m.optimizer} -> adamw")
    if cfg.precision == "fp32" and m.precision in ("bf16", "fp16"):  # activations at twice the bytes
        found.append(f"precision {m.precision} -> fp32")
    return found


def strategy_difference(plan, launched: str | None) -> tuple[str, str] | None:
    """(planned, launched) when this run was launched with another strategy than its plan's memory values were sized
    for (launch/launched_strategy.py); None when they hold."""
    from ..launch.launched_strategy import planned_strategy, same_strategy

    planned = plan.memory.strategy if plan.memory is not None else plan.strategy.value
    if launched is None or planned is None or same_strategy(planned, launched):
        return None
    return planned_strategy(planned), launched


def scope_to_this_run(plan, cfg: FinetuneConfig, tuned: frozenset = frozenset(), launched: str | None = None):
    """(plan, lines): the plan as this run may apply it. When its memory plan was made for another model, or for a
    shorter sequence, a smaller image or a lighter method than this run's, its memory-derived values are dropped (the
    recipe's own apply) and its memory plan is re-pointed at this run's model and shape, so the memory check
    estimates what really trains. Values `hf-gpu-train tune` measured for this very recipe (``tuned``) were measured on
    what it trains, and stay; the memory check still speaks of this run's model. A run ``launched`` with another
    strategy than the plan's (``launch.launched_strategy``) applies none of them, tuned ones included (tune measured
    under the plan's strategy), and the memory check estimates the strategy that runs."""
    strategy = strategy_difference(plan, launched)
    if strategy is not None:
        tuned = frozenset()
    if plan.memory is None:
        return (plan, []) if strategy is None else _without_memory_values(plan, None, [], strategy=strategy)
    if plan.document is not None and not (plan.document.get("memory") or {}).get("planned_for", {}).get("fingerprint"):
        return _without_memory_values(plan, None, [f"{plan.path.name} records no fingerprint of the model they were made for "
                                                   f"(an older hf-gpu-train): regenerate it with `{plan.command}`"], tuned,
                                      strategy)
    same_name = canonical_name(plan.memory.model.name) == canonical_name(cfg.model)
    spec, why_not = (None, None) if same_name else run_model_spec(cfg)
    found = differences(plan, cfg, spec)
    if not same_name and spec is None:
        found.insert(0, f"model {plan.memory.model.name} -> {cfg.model} (its config cannot be read here: {why_not})")
    if not found and strategy is None:
        return plan, []
    memory = plan.memory
    if found:
        vision = task_for(cfg.task).images
        image_size = (cfg.image_size or plan.memory.image_size) if vision else plan.memory.image_size
        if vision and spec is None and same_name and image_size != plan.memory.image_size:
            spec, _ = run_model_spec(cfg)  # timm's activations were measured at the plan's image size: measure this one's
        memory = None
        if spec is not None or (same_name and image_size == plan.memory.image_size):
            memory = dataclasses.replace(
                plan.memory, model=spec or plan.memory.model, method=_method(cfg), global_batch_target=None,
                seq_len=plan.memory.seq_len if vision else (cfg.max_length or plan.memory.seq_len), image_size=image_size)
    if strategy is not None and memory is not None:
        from ..plan.memory import STRATEGIES

        launched_strategy = strategy[1]
        memory = dataclasses.replace(memory, strategy=launched_strategy) if launched_strategy in (*STRATEGIES, "single") else None
    return _without_memory_values(plan, memory, found, tuned, strategy)


def _without_memory_values(plan, memory, why: list[str], keep: frozenset = frozenset(),
                           strategy: tuple[str, str] | None = None):
    """The plan without its memory-derived values (but ``keep``: measured for this run), ``memory`` as its memory
    plan, and the line that says so (``strategy``: (planned, launched) when the run was launched with another)."""
    dropped = [k for k in MEMORY_KEYS if plan.value(k) is not None and k not in keep]
    checked = "" if memory is not None else "; memory not checked"
    if strategy is not None:
        from ..launch.launched_strategy import why_launched

        planned, launched = strategy
        if plan.value("gradient_accumulation_steps") is not None:
            dropped.append("gradient_accumulation_steps")
        shown = ", ".join(f"{k}={plan.value(k)}" for k in dropped) or "none decided"
        yaml = plan.config_file or "NAME.yaml"
        line = (f"plan made for {planned} but this run is {launched} ({why_launched(launched, planned)}): its memory values "
                f"are not applied ({shown}){'; it was also made for another run: ' + '; '.join(why) if why else ''}; the "
                f"recipe's values apply{checked}. To run the plan's strategy, launch with `hf-gpu-train launch --config-file "
                f"{yaml} SCRIPT`, `accelerate launch --config_file {yaml} SCRIPT`, or the torchrun line `hf-gpu-train config` "
                "prints (it carries accelerate's strategy variables)")
    elif not dropped and keep:
        line = (f"the plan's memory plan was made for another run ({'; '.join(why)}): the values hf-gpu-train tune measured "
                f"for this recipe apply{checked or ', and the memory check estimates what this run trains'}")
    else:
        shown = ", ".join(f"{k}={plan.value(k)}" for k in dropped) or "none decided"
        line = f"plan values made for another run not applied ({shown}): {'; '.join(why)}; the recipe's values apply{checked}"
    values = {k: v for k, v in plan.values.items() if k not in dropped}
    return dataclasses.replace(plan, values=values, memory=memory), [line]
