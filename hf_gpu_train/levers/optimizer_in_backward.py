"""The optimizer step inside the backward: each parameter is stepped, and its gradient freed, as soon as autograd has
accumulated it, so full fine-tuning holds about one layer's gradients instead of the whole model's (4 bytes per
parameter in fp32: 7 GiB for a 1.7B model). torchtune's ``optimizer_in_bwd``; the technique of LOMO (Lv et al. 2023).

How: one optimizer per parameter (the Trainer's class and settings, its weight-decay groups kept), stepped from
``Tensor.register_post_accumulate_grad_hook``. ``OptimizerInBackward`` stands where the Trainer expects its optimizer:
its ``param_groups`` are the per-parameter optimizers' own groups (the same dicts, read anew each time), so the learning-rate scheduler
drives them; its ``step`` and ``zero_grad`` do nothing, the work was done in the backward; its state dict holds every
per-parameter optimizer's, so checkpoints save and resume.

Exact (tests/levers/test_memory_levers.py: the same weights as the Trainer's own optimizer after several steps)
where it applies, and refused where it would not be:
- gradient accumulation: the first micro-batch's backward would step the parameters;
- several processes: DDP averages gradients after the hook would have used them (FSDP and DeepSpeed likewise shard
  and reduce in hooks of their own);
- gradient clipping: the global norm needs every gradient before the first step (``max_grad_norm`` is set to 0);
- fp16: the loss scaler must see every gradient to skip a step with infs.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from ..errors import UsageError


class OptimizerInBackward(torch.optim.Optimizer):
    """An optimizer per parameter, each stepped by its parameter's post-accumulate-grad hook."""

    def __init__(self, params, optimizer_class=torch.optim.AdamW, **settings):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**group, "params": [p for p in group["params"] if p.requires_grad]} for group in groups]
        trained = [p for group in groups for p in group["params"]]
        if not trained:
            raise ValueError("optimizer_in_backward: no parameter requires a gradient")
        self._per_parameter: dict[torch.nn.Parameter, torch.optim.Optimizer] = {}  # empty: the base's groups go nowhere
        super().__init__(trained, settings)
        for group in groups:
            group_settings = {**settings, **{k: v for k, v in group.items() if k != "params"}}
            for p in group["params"]:
                self._per_parameter[p] = optimizer_class([p], **group_settings)
        self._hooks: list = []
        self.add_hooks()
        self.parameter_steps = 0

    @property
    def param_groups(self) -> list[dict]:
        """The per-parameter optimizers' own groups, read anew each time: what the scheduler writes, they read (their
        ``load_state_dict``, which accelerate calls when it prepares the optimizer, replaces the group dicts)."""
        return [opt.param_groups[0] for opt in self._per_parameter.values()]

    @param_groups.setter
    def param_groups(self, _groups) -> None:
        """``Optimizer.__init__`` assigns its own groups: the per-parameter optimizers' stand instead."""

    def _step_parameter(self, param: torch.Tensor) -> None:
        optimizer = self._per_parameter[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.parameter_steps += 1

    def step(self, closure=None):
        """Nothing to do: every parameter was stepped in the backward."""
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._per_parameter:  # a gradient left by a backward the hooks did not see (none in training)
            p.grad = None

    def state_dict(self) -> dict:
        return {"per_parameter": [opt.state_dict() for opt in self._per_parameter.values()]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("per_parameter")
        if saved is None or len(saved) != len(self._per_parameter):
            raise ValueError("optimizer_in_backward: this optimizer state was saved by a different optimizer or model "
                             f"({0 if saved is None else len(saved)} parameter states, {len(self._per_parameter)} parameters)")
        for opt, state in zip(self._per_parameter.values(), saved):
            opt.load_state_dict(state)

    def add_hooks(self) -> None:
        if not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._step_parameter) for p in self._per_parameter]

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def attach(trainer, world_size: int, precision: str) -> str:
    """Make ``trainer`` build an ``OptimizerInBackward`` with its own optimizer class and settings; the line to print.
    Refuses (UsageError, exit 2) where the step would not be the Trainer's."""
    args = trainer.args
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        raise UsageError("optimizer_in_backward=true under FSDP or DeepSpeed: they shard the parameters and reduce the "
                         "gradients in their own hooks; launch without them (one process), or drop optimizer_in_backward")
    if world_size > 1:
        raise UsageError(f"optimizer_in_backward=true on {world_size} processes: the gradients are averaged across processes "
                         "after each parameter would have stepped; run one process, or drop optimizer_in_backward")
    if args.gradient_accumulation_steps > 1:
        raise UsageError(f"optimizer_in_backward=true with gradient accumulation {args.gradient_accumulation_steps}: the first "
                         "micro-batch's backward would step the parameters; set global_batch_size to the micro-batch "
                         "(per_device_train_batch_size), or drop optimizer_in_backward")
    if precision == "fp16":
        raise UsageError("optimizer_in_backward=true with fp16: the loss scaler must see every gradient before a step; "
                         "use precision=bf16 (or fp32), or drop optimizer_in_backward")
    if args.max_grad_norm:
        raise UsageError(f"optimizer_in_backward=true with max_grad_norm={args.max_grad_norm}: gradients cannot be clipped "
                         "before the global norm exists; set max_grad_norm to 0")
    optimizer_class, settings = type(trainer).get_optimizer_cls_and_kwargs(args, trainer.model)
    trainer.optimizer_cls_and_kwargs = (OptimizerInBackward, {"optimizer_class": optimizer_class, **settings})
    trainer.add_callback(_InBackwardGuard())
    inner = getattr(trainer.model, "get_base_model", lambda: trainer.model)()
    inner._hf_gpu_train_optimizer_in_backward = True  # for the planner's estimate in an OOM message (remedies.py)
    return (f"optimizer in backward: each parameter steps ({optimizer_class.__name__}) as its gradient is ready, gradients "
            "freed at once; gradient clipping off (the Trainer's default clips at max_grad_norm=1.0)")


def remove_hooks(optimizer) -> None:
    """Take an ``OptimizerInBackward``'s hooks off the parameters (a Trainer's optimizer, wrapped or not; anything
    else: nothing): for a train() that raised before its end (tune's trials share one model)."""
    inner = _unwrapped(optimizer)
    if isinstance(inner, OptimizerInBackward):
        inner.remove_hooks()


def _unwrapped(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


class _InBackwardGuard(TrainerCallback):
    """A subclass or a peer that builds its own optimizer (``create_optimizer``, ``optimizers=(...)``) would leave the
    parameters stepped by it, with clipping off: refused before the first step. The hooks live for a train() only, so
    a later backward (a user's, an evaluation with gradients) steps nothing, and another train() has them again."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        inner = _unwrapped(optimizer)
        if not isinstance(inner, OptimizerInBackward):
            raise UsageError(f"optimizer_in_backward=true, but the Trainer's optimizer is {type(inner).__name__}: its "
                             "create_optimizer (or optimizers=(...)) built another one; drop optimizer_in_backward, or let "
                             "the Trainer build its optimizer")
        inner.add_hooks()

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        inner = _unwrapped(optimizer)
        if isinstance(inner, OptimizerInBackward):
            inner.remove_hooks()
