"""Loss terms of the whole batch: the exact split of a mixture-of-experts router's load-balancing loss.

A loss that is a mean or a sum over labelled items splits into micro-batches by a weighting (``loss_scaling.py``). A
term computed over the whole batch does not: the load-balancing loss of a mixture-of-experts router (Mixtral, Qwen-MoE,
OLMoE, GPT-OSS, Jamba, DeepSeek, Granite-MoE, ...) is ``E * sum_e f_e * P_e``, ``f_e`` the share of the batch's tokens
routed to expert ``e`` and ``P_e`` their mean router probability: a product of two means over every token of the batch.
Computed per micro-batch and added up, it is counted once per micro-batch, each time from other statistics (measured:
a tiny Mixtral, 8 rows split into two micro-batches of 4, SGD, 3 steps: weights off by 2.4e-2 of the update at
``router_aux_loss_coef=0.02``; the issue's 1.0e-3 at Mixtral's default 0.001).

The exact split: the gradient that the whole batch's term sends to a micro-batch's rows is that term's gradient at
those rows. So before a split step runs, a forward without gradients over the step's samples (in micro-batches, its
logits kept for one position only) records the arguments the model passes to its module's
``load_balancing_loss_func`` (every layer's router logits and the attention mask). While a micro-batch runs, that
function is called on the whole batch's arguments with this micro-batch's rows replaced by its live ones: its value is
the whole batch's term, its gradient exactly the whole term's gradient at these rows. The micro-batch keeps its share
of the value (rows), so the micro-batches' losses add up to the whole batch's loss as well as its gradient. The
routing statistics of the step's other rows come from the recorded forward, so they are the whole batch's exactly
(a router with jitter noise or dropout draws the same numbers: the recording forks the random state).

Nothing of a family's formula is assumed here: whatever the model's module calls ``load_balancing_loss_func`` is called
as the model calls it. Whether the split holds is checked at the first training step (``loss_scaling.decomposes``: the
spliced losses of two samples alone against their loss together), before an OOM can use it; where it fails the
recovery says so with the measured deviation. Costs one forward without gradients of each split step, after an OOM
only. Not for preference batches (chosen and rejected halves: a sample is not a block of rows).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass

import torch

from .microbatch import is_oom_error

FUNCTION = "load_balancing_loss_func"


def _flatten(tree, out: list) -> object:
    """The tensors of ``tree`` (nested tuples, lists, dicts) into ``out``; returns the tree with their places marked."""
    if isinstance(tree, torch.Tensor):
        out.append(tree)
        return _Leaf(len(out) - 1)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_flatten(item, out) for item in tree)
    if isinstance(tree, dict):
        return {key: _flatten(value, out) for key, value in tree.items()}
    return tree


def _fill(shape, leaves: list):
    if isinstance(shape, _Leaf):
        return leaves[shape.index]
    if isinstance(shape, (tuple, list)):
        return type(shape)(_fill(item, leaves) for item in shape)
    if isinstance(shape, dict):
        return {key: _fill(value, leaves) for key, value in shape.items()}
    return shape


@dataclass(frozen=True)
class _Leaf:
    index: int


class NotSpliceable(ValueError):
    """The recorded arguments do not divide into blocks of rows per sample: the split cannot be exact this way."""


@dataclass
class _WholeCall:
    """One call of the function over the whole batch: its arguments' structure, each tensor joined over the recorded
    micro-batches, the rows each sample holds in it (None: a tensor without a batch dimension, passed as it is),
    and the value over the whole batch."""

    shape: object
    leaves: list
    rows_per_sample: list
    value: torch.Tensor | None = None


class RouterBalanceSplit:
    """The exact split of ``load_balancing_loss_func`` for one model: record a step's whole batch, then splice."""

    def __init__(self, module, coefficient: float = 0.0):
        self.module = module
        self.coefficient = coefficient  # what the model multiplies the function's value by before adding it to its loss
        self.original = getattr(module, FUNCTION)
        self._whole: dict[int, list[_WholeCall]] = {}  # id(the micro-step's inputs) -> the whole batch's calls
        self._inputs: dict[int, object] = {}  # keeps those inputs alive while their id is a key
        self._recording: list | None = None
        self._splicing: tuple | None = None  # (calls, start, stop, size, scale) while a micro-batch runs
        self.broken: str | None = None  # why a live micro-batch's arguments did not fit the recorded batch (then unsplit)

    @classmethod
    def find(cls, model) -> RouterBalanceSplit | None:
        """For a model whose forward adds a router's load-balancing loss (a module of it comes from a Python module that
        defines ``load_balancing_loss_func`` and its config asks for router logits with a non-zero coefficient)."""
        for part in model.modules():
            config = getattr(part, "config", None)
            if config is None or not getattr(config, "output_router_logits", False):
                continue
            if not getattr(part, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", 0.0)):
                continue
            module = sys.modules.get(type(part).__module__)
            if module is not None and callable(getattr(module, FUNCTION, None)):
                return cls(module, float(getattr(part, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", 0.0))))
        return None

    def forget(self, key=None) -> None:
        """The recorded batch of the inputs ``key`` (None: every one) is not needed any more: a micro-step is done (a
        replay of it records again). What a record holds: every layer's router logits of the micro-step, layers x rows x
        sequence x experts values (Mixtral 8x7B, 8 rows of 4,096 tokens: 32 x 32,768 x 8 in bf16, 16 MiB)."""
        if key is None:
            self._whole.clear()
            self._inputs.clear()
        else:
            self._whole.pop(id(key), None)
            self._inputs.pop(id(key), None)

    def term_value(self, key) -> float | None:
        """The whole batch's term as the model adds it to its loss (coefficient x the function's value), for the inputs
        ``key`` recorded (None: not recorded)."""
        calls = self._whole.get(id(key))
        if not calls or any(call.value is None for call in calls):
            return None
        return self.coefficient * float(sum(call.value.float().sum() for call in calls))

    def recorded(self, inputs) -> bool:
        return id(inputs) in self._whole

    # -- the recording forward ----------------------------------------------------------------------------------------
    def record(self, model, chunks: list, prepare, key) -> None:
        """Run ``model`` (unwrapped: no DDP hooks) without gradients over ``chunks`` (the micro-batches of the inputs
        ``key``, in order) and keep the function's arguments, joined along the batch."""
        per_chunk: list[list[tuple]] = []
        sizes = []
        forward = _forward_arguments(model)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices), self._patched():
            for chunk in chunks:
                prepared = prepare(chunk)
                self._recording = []
                try:
                    model(**forward(prepared))
                except Exception as error:  # an OOM is the step's; anything else: this model is not recorded this way
                    if is_oom_error(error):
                        raise
                    raise NotSpliceable(f"its forward without labels failed: {type(error).__name__}: "
                                        f"{str(error).splitlines()[0][:200] if str(error) else ''}") from None
                finally:
                    calls, self._recording = self._recording, None
                per_chunk.append(calls)
                sizes.append(_rows(prepared))
        self._whole[id(key)] = self._join(per_chunk, sizes)
        self._inputs[id(key)] = key

    def _join(self, per_chunk: list[list[tuple]], sizes: list[int]) -> list[_WholeCall]:
        if not per_chunk or not per_chunk[0] or any(len(calls) != len(per_chunk[0]) for calls in per_chunk):
            raise NotSpliceable("the model did not call its load-balancing function once per forward alike")
        whole = []
        for j in range(len(per_chunk[0])):
            shape, first = per_chunk[0][j]
            leaves, rows = [], []
            for i in range(len(first)):
                parts = [calls[j][1][i] for calls in per_chunk]
                per_sample = [p.shape[0] / n if p.dim() > 0 and n else None for p, n in zip(parts, sizes)]
                if all(p is not None and p == per_sample[0] and float(p).is_integer() and p > 0 for p in per_sample) \
                        and all(p.shape[1:] == parts[0].shape[1:] for p in parts):
                    leaves.append(torch.cat(parts) if len(parts) > 1 else parts[0])
                    rows.append(int(per_sample[0]))
                elif all(torch.equal(p, parts[0]) for p in parts):
                    leaves.append(parts[0])  # the same in every micro-batch: no batch dimension
                    rows.append(None)
                else:
                    raise NotSpliceable(f"argument {i} of {FUNCTION} has no batch dimension of whole rows")
            args, kwargs = _fill(shape, leaves)
            value = self.original(*args, **kwargs)
            whole.append(_WholeCall(shape, leaves, rows, value.detach() if isinstance(value, torch.Tensor) else None))
        return whole

    # -- the split micro-batch ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def splicing(self, key, start: int, stop: int, size: int, scale_of):
        """While samples ``start:stop`` of the inputs ``key`` (``size`` samples) run: the function gets the whole
        batch's arguments with these rows live. ``scale_of()``: the factor the recovery then multiplies this
        micro-batch's loss by (its share for a mean loss, 1 for a sum normalised by the step's item count)."""
        calls = self._whole.get(id(key))
        if calls is None:
            yield
            return
        self._splicing = (calls, start, stop, size, scale_of, [0])
        try:
            with self._patched():
                yield
        finally:
            self._splicing = None

    def _splice(self, args, kwargs):
        calls, start, stop, size, scale_of, count = self._splicing
        whole = calls[min(count[0], len(calls) - 1)]
        count[0] += 1
        live: list = []
        shape = _flatten((args, kwargs), live)
        leaves = []
        for tensor, joined, rows in zip(live, whole.leaves, whole.rows_per_sample):
            if rows is None or tensor.dim() == 0:
                leaves.append(tensor)
                continue
            if tensor.shape[0] != (stop - start) * rows or tensor.shape[1:] != joined.shape[1:]:
                # never an exception inside the model's forward: this micro-batch computes its own term, said after it
                self.broken = (f"a micro-batch's {FUNCTION} argument has shape {tuple(tensor.shape)}, not "
                               f"{((stop - start) * rows, *joined.shape[1:])}")
                return self.original(*args, **kwargs)
            joined = joined.to(device=tensor.device, dtype=tensor.dtype)
            leaves.append(torch.cat([joined[: start * rows], tensor, joined[stop * rows:]]))
        spliced_args, spliced_kwargs = _fill(shape, leaves)
        result = self.original(*spliced_args, **spliced_kwargs)
        if not isinstance(result, torch.Tensor) or whole.value is None:
            return result
        value = whole.value.to(device=result.device, dtype=result.dtype)
        # the value: this micro-batch's rows' share of the whole term; the gradient: the whole term's, at these rows;
        # divided by the factor the recovery multiplies the micro-batch's loss by
        return (result - value + value * ((stop - start) / size)) / scale_of()

    @contextlib.contextmanager
    def _patched(self):
        setattr(self.module, FUNCTION, self._call)
        try:
            yield
        finally:
            setattr(self.module, FUNCTION, self.original)

    def _call(self, *args, **kwargs):
        if self._recording is not None:
            leaves: list = []
            shape = _flatten((args, kwargs), leaves)
            self._recording.append((shape, [t.detach().clone() for t in leaves]))
            return self.original(*args, **kwargs)
        if self._splicing is not None:
            return self._splice(args, kwargs)
        return self.original(*args, **kwargs)


def _rows(inputs) -> int:
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise NotSpliceable("no tensor in the inputs")


def _forward_arguments(model):
    """What the recording forward passes: the inputs (no labels: the routing does not read them and the loss over the
    vocabulary is not needed), with the logits kept for one position where the model takes ``logits_to_keep``. A
    forward that takes ``**kwargs`` (a PEFT wrapper's) gets every input; one that names its parameters, those."""
    def parameters(module):
        return inspect.signature(module.forward).parameters

    own = parameters(model)
    passes_all = any(p.kind == p.VAR_KEYWORD for p in own.values())
    named = {name for name, p in own.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    keeps_one = "logits_to_keep" in (named if base is model else {*named, *parameters(base)})

    def arguments(inputs) -> dict:
        kept = {key: value for key, value in inputs.items() if (passes_all or key in named) and key != "labels"}
        if keeps_one:
            kept["logits_to_keep"] = 1
        return kept

    return arguments
