"""The memory levers of a fine-tune, from the config to the Trainer: which layers checkpointing covers and what they
keep (``checkpoint_layers``), saved activations in pinned host memory (``offload_activations``) and the optimizer
step inside the backward (``optimizer_in_backward``). The chunked LM head (``chunked_lm_loss``) is the causal-LM
branch's (tasks/language_modeling/lm_head_loss.py).

Each lever is exact (tests/levers/test_memory_levers.py: the same losses and weights as without it), so none
changes what a run learns, only what it keeps in GPU memory and how long a step takes. The planner counts each
(``launch.training_shape.TrainingShape``: ``shape_levers`` gives its fields from a config).

This module imports no torch at the top: ``check_levers`` runs in config validation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import ConfigError, UsageError
from ..plan.training_shape import ATTENTION_KEPT, SELECTIVE_POLICIES, checkpoint_every
from .release_memory import release_on_cuda


@dataclass(frozen=True)
class LeverKeys:
    """What the levers read of a run (``FinetuneConfig.lever_keys``): its checkpointing, offloading, optimizer-step,
    compilation and allocator keys, and the method and the clipping they are checked against. Given this, not the whole
    config: the levers read nothing else."""

    gradient_checkpointing: bool = False
    checkpoint_layers: str = "all"
    offload_activations: bool = False
    optimizer_in_backward: bool = False
    torch_compile: bool = False
    release_memory: bool = False
    method: str = "full"
    max_grad_norm: object = None  # the run's own, from its extra TrainingArguments (None: the Trainer's default)


def check_levers(levers: LeverKeys, layered: bool, attention: str | None = None) -> None:
    """The config's levers against each other and the task's model (``layered``: a stack of transformer layers, whose
    checkpointing policies choose what each layer keeps; a timm model checkpoints every block; ``attention``: the
    kernel its attention runs); what needs the runtime (precision, processes, accumulation) is checked by
    ``apply_levers``. The task asks (``Task.resolve``)."""

    try:
        checkpoint_every(levers.checkpoint_layers)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if levers.checkpoint_layers != "all":
        if not levers.gradient_checkpointing:
            raise ConfigError(f"checkpoint_layers={levers.checkpoint_layers!r} chooses what gradient checkpointing keeps: add "
                              "gradient_checkpointing=true (or drop checkpoint_layers)")
        if not layered:
            raise ConfigError(f"checkpoint_layers={levers.checkpoint_layers!r} is for transformers models; timm models checkpoint "
                              "every block (checkpoint_layers=all)")
        if levers.checkpoint_layers in SELECTIVE_POLICIES and levers.method == "qlora":
            raise ConfigError(f"checkpoint_layers={levers.checkpoint_layers!r} with method=qlora: bitsandbytes' 4-bit matmul is not "
                              "covered by the selective policies; use checkpoint_layers=all or every-N")
        if levers.checkpoint_layers in SELECTIVE_POLICIES and attention not in (None, *ATTENTION_KEPT):
            raise ConfigError(f"checkpoint_layers={levers.checkpoint_layers!r} with attn_implementation={attention}: "
                              "the selective policies keep the outputs of SDPA's and eager attention only and would recompute "
                              "this kernel; use attn_implementation=sdpa, or checkpoint_layers=all or every-N")
    if levers.offload_activations and levers.torch_compile:
        raise ConfigError("offload_activations=true with torch_compile=true: the saved-tensor hooks would sit inside the "
                          "compiled forward; choose one (drop torch_compile, or offload_activations)")
    if levers.optimizer_in_backward:
        if levers.torch_compile:
            raise ConfigError("optimizer_in_backward=true with torch_compile=true: a compiled backward makes every gradient "
                              "at once, so nothing is freed early; choose one")
        if levers.method != "full":
            raise ConfigError(f"optimizer_in_backward=true with method={levers.method}: it saves the gradients of full fine-tuning "
                              "(an adapter's are small already); use method=full or drop optimizer_in_backward")
        clip = levers.max_grad_norm
        if clip not in (None, 0, 0.0):
            raise ConfigError(f"optimizer_in_backward=true with max_grad_norm={clip}: each parameter steps before the global "
                              "gradient norm exists, so gradients cannot be clipped; drop max_grad_norm or optimizer_in_backward")


def shape_levers(values: Mapping) -> dict:
    """The levers as ``TrainingShape`` fields, as the planner counts them, from a run's keys (``FinetuneConfig.values``:
    a task without a chunked head has no ``chunked_lm_loss``). ``chunked_lm_loss=auto`` may step aside for a model, so
    only ``true`` (or a fused kernel: no full logits either) is counted as chunked (the full logits otherwise:
    conservative)."""
    return {"chunked_loss": values.get("chunked_lm_loss") in (True, "liger", "cce"),
            "checkpoint_layers": values.get("checkpoint_layers", "all"),
            "offload_activations": bool(values.get("offload_activations")),
            "optimizer_in_backward": bool(values.get("optimizer_in_backward"))}


def training_arguments(levers: LeverKeys, fsdp_checkpoints: bool) -> dict:
    """The TrainingArguments for checkpointing: the Trainer enables "all" and "every-N" itself (JSON-able keyword
    arguments), selective checkpointing is enabled on the model (``apply_levers``) since its policy is a function;
    optimizer_in_backward turns gradient clipping off (``check_levers`` refused an explicit one): the Trainer's default
    clips at 1.0, so that lever is exact against a run without clipping, and says so when it starts."""

    if fsdp_checkpoints and levers.checkpoint_layers != "all":
        raise ConfigError(f"checkpoint_layers={levers.checkpoint_layers!r} with the launch config's fsdp_activation_checkpointing: "
                          "FSDP checkpoints every layer itself; set fsdp_activation_checkpointing: false in the launch config")
    kwargs: dict = {"activation_checkpointing": levers.gradient_checkpointing and not fsdp_checkpoints
                    and levers.checkpoint_layers not in SELECTIVE_POLICIES}
    every = checkpoint_every(levers.checkpoint_layers)
    if kwargs["activation_checkpointing"] and every > 1:
        kwargs["activation_checkpointing_kwargs"] = {"use_reentrant": False, "every_n_layers": every}
    if levers.optimizer_in_backward:
        kwargs["max_grad_norm"] = 0.0
    return kwargs


class CudaRelease(NamedTuple):
    line: str  # what was done, to print on CUDA
    ours: bool  # whether this run set PYTORCH_CUDA_ALLOC_CONF (not the user's own)


def release_memory_before_cuda(levers: LeverKeys, environ=None) -> CudaRelease | None:
    """``release_memory`` on CUDA: the allocator setting goes into the environment before anything asks torch about
    CUDA (resolving the runtime does: torch reads the setting once, when CUDA starts). None without release_memory."""

    if not levers.release_memory:
        return None

    environ = os.environ if environ is None else environ
    ours = not environ.get("PYTORCH_CUDA_ALLOC_CONF")
    return CudaRelease(release_on_cuda(environ), ours)


def release_memory(levers: LeverKeys, runtime, cuda: CudaRelease | None, environ=None) -> list[str]:
    """``release_memory``: the allocator gives freed memory back at once (levers/release_memory.py); before the model
    loads. ``cuda``: what ``release_memory_before_cuda`` did; on the CPU a setting it made is taken back (nothing reads
    it) and glibc's thresholds are fixed instead. The lines to print."""

    if not levers.release_memory:
        return []
    from .release_memory import release_on_the_cpu  # lazy: looked up when called, so a replacement (a test's) is seen

    if runtime.on_cuda:
        return [cuda.line] if cuda else []
    environ = os.environ if environ is None else environ
    if cuda is not None and cuda.ours:
        environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    return [release_on_the_cpu()]


def apply_levers(trainer, levers: LeverKeys, runtime) -> list[str]:
    """The levers on a built Trainer; the lines to print (what each does here, or why it stepped aside)."""


    lines = []
    if levers.gradient_checkpointing and levers.checkpoint_layers in SELECTIVE_POLICIES:
        from . import selective_checkpoint

        selective_checkpoint.enable(trainer.model, levers.checkpoint_layers)
        lines.append("checkpointing: selective (each layer keeps its matmuls' and attention's outputs, recomputes the rest)"
                     if levers.checkpoint_layers == "selective" else
                     "checkpointing: selective-lean (each layer keeps attention's and its narrowing projections' outputs, "
                     "recomputes the query, output, gate and up projections and the elementwise work)")
    elif levers.gradient_checkpointing and levers.checkpoint_layers != "all":
        lines.append(f"checkpointing: {levers.checkpoint_layers} (one layer in {checkpoint_every(levers.checkpoint_layers)} checkpointed, the others "
                     "keep their activations)")
    if levers.offload_activations:
        from . import activation_offload

        if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
            raise UsageError("offload_activations=true under FSDP or DeepSpeed: the hooks would copy the parameters they "
                             "gather too; use FSDP's own offloading (hf-gpu-train config --strategy fsdp-offload), or drop "
                             "offload_activations")
        test_min_bytes = os.environ.get(activation_offload.TEST_CPU_MIN_BYTES_ENV)  # tests: the copy path on the CPU
        lines.append(activation_offload.attach(trainer.model, on_cuda=runtime.on_cuda, offload_cpu_tensors=bool(test_min_bytes),
                                               **({"min_bytes": int(test_min_bytes)} if test_min_bytes else {})))
    if levers.optimizer_in_backward:
        from . import optimizer_in_backward

        lines.append(optimizer_in_backward.attach(trainer, world_size=runtime.world_size, precision=runtime.precision))
    return lines


def planned_levers_that_hold(values: dict, from_plan: set, levers: LeverKeys, world_size: int,
                             attention: str | None = None) -> list[tuple[str, object, str]]:
    """Drop, from ``values`` (the run's values with the plan's applied), the plan's levers that this run's own choices
    rule out, instead of failing on them: selective or one-in-N checkpointing with checkpointing off, offloading or
    the optimizer in the backward beside torch_compile, the optimizer in the backward with accumulation, several
    processes, clipping or adapters. ``from_plan``: the keys whose value came from the plan; ``attention``: the
    model's attention kernel (the task's ``attention``). Returns (key, the plan's value, why) for each one dropped;
    ``values`` is changed in place."""
    dropped = []

    def drop(key: str, default: object, why: str) -> None:
        dropped.append((key, values[key], why))
        values[key] = default

    if "checkpoint_layers" in from_plan and values.get("checkpoint_layers") not in (None, "all") and not values.get(
            "gradient_checkpointing"):
        drop("checkpoint_layers", "all", "gradient checkpointing is off in this run")
    elif "checkpoint_layers" in from_plan and values.get("checkpoint_layers") in SELECTIVE_POLICIES and levers.method == "qlora":
        drop("checkpoint_layers", "all", "this run trains method=qlora (bitsandbytes' 4-bit matmul is not covered)")
    elif ("checkpoint_layers" in from_plan and values.get("checkpoint_layers") in SELECTIVE_POLICIES
          and attention not in (None, *ATTENTION_KEPT)):
        drop("checkpoint_layers", "all", f"this run uses attn_implementation={attention} (the selective policies "
                                         "keep SDPA's and eager attention's outputs only)")
    if "chunked_lm_loss" in from_plan and values.get("chunked_lm_loss") is True and values.get("precision") == "fp16":
        drop("chunked_lm_loss", "auto", "this run trains in fp16 (the loss scale would reach the gradients after they are made)")
    compiled = bool(values.get("torch_compile"))
    if "offload_activations" in from_plan and values.get("offload_activations") and compiled:
        drop("offload_activations", False, "this run compiles the model (torch_compile)")
    if "optimizer_in_backward" in from_plan and values.get("optimizer_in_backward"):
        micro = int(values.get("per_device_train_batch_size") or 1)
        global_batch = values.get("global_batch_size")
        accumulates = bool(global_batch) and -(-int(global_batch) // max(1, world_size)) > micro
        clip = levers.max_grad_norm
        why = ("this run compiles the model (torch_compile)" if compiled else
               f"this run trains method={levers.method}" if levers.method != "full" else
               f"this run has {world_size} processes" if world_size > 1 else
               "this run accumulates micro-batches" if accumulates else
               f"this run clips gradients (max_grad_norm={clip})" if clip not in (None, 0, 0.0) else None)
        if why:
            drop("optimizer_in_backward", False, why)
    return dropped
