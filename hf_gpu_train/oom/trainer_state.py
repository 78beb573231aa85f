"""Take and put back the Trainer attributes a re-run of its own code would count twice: an explicit list, no guess.

When this package runs someone's ``compute_loss`` for a reason of its own (the loss-scaling probe) or runs a step
again (OOM recovery replaying micro-steps, every rank restarting a step), the tallies that ``training_step`` and
``compute_loss`` keep in attributes of the Trainer would count the extra calls. ``take`` copies the attributes
named here, ``put_back`` restores them. The names are known, not guessed:

- ``TRAINER_STATE``: every attribute that the installed transformers' and TRL's ``training_step`` and
  ``compute_loss`` (and what they call) change, each with its reason. transformers' ``Trainer`` itself has none: its
  tallies (``current_flos``, ``_tr_loss``, ``_total_loss_scalar``) are counted by the training loop, around the
  ``training_step`` call, once per call (see ``NOT_RESTORED``).
- ``NOT_RESTORED``: attributes a training step changes that must *not* be put back, with the reason (the loop's
  state and switches: ``model_accepts_loss_kwargs``, which the loss guard sets part-way through the first step, put
  back on one rank only made that rank gather item counts the others did not: a hang).
- A Trainer subclass's own tallies, which no list can know: name them in a class attribute,
  ``hf_gpu_train_state = ("my_counter", ...)`` (read over the class's MRO), or register them once for every Trainer,
  ``hf_gpu_train.oom.register_trainer_state("my_counter", ...)``. An attribute nobody named that the undone work
  changed (a number, a string, a container's leaves or the sum of its numbers) is not put back, and a warning names
  it with that fix.

``tests/oom/test_trainer_state.py`` runs a training step of the plain Trainer and of TRL's trainers and fails, naming
it, on any attribute the step changed that is in neither list: a tally a new transformers or TRL adds is added here,
with its reason, before it can be counted twice.

Only attributes the trainer has are copied, cheaply: numbers and strings as they are, containers of them (and of
tensors) deep-copied, tensors detached and cloned; anything else (a module, a dataset, a larger container than a
tally's) is left alone, once said.
"""

from __future__ import annotations

import collections
import copy
import inspect
import logging
from collections.abc import Mapping

import torch

log = logging.getLogger("hf_gpu_train.oom")

PLAIN = (int, float, str, bool, bytes, type(None))
MAX_ITEMS = 100_000  # a tally, not a dataset: larger containers are not copied
CLASS_ATTRIBUTE = "hf_gpu_train_state"  # a Trainer subclass's own names: hf_gpu_train_state = ("my_counter", ...)

# name -> why a re-run of training_step / compute_loss changes it and the recovery must put it back
TRAINER_STATE: dict[str, str] = {
    "_metrics": "TRL (SFT, DPO, KTO, Reward, GRPO, RLOO, Distillation): every compute_loss call appends its entropy, token "
                "accuracy, rewards, logps... under 'train' or 'eval'; log() averages them",
    "_total_train_tokens": "TRL (SFT, DPO, KTO, Reward): every training compute_loss adds its batch's tokens, logged as "
                           "num_tokens",
    "_stored_metrics": "TRL's CPO and ORPO (trl.experimental): store_metrics at every compute_loss call, averaged by log()",
    "entropy_coef": "TRL's GRPO with use_adaptive_entropy: compute_loss moves the entropy coefficient towards its target",
    "_last_world_entropy": "TRL's GRPO with use_adaptive_entropy: the entropy compute_loss last measured",
    "_entropy_window_stats": "TRL's GRPO with use_adaptive_entropy: the entropy statistics compute_loss accumulates over a "
                             "window of calls",
}

# name -> why a training step changes it and it must not be put back
NOT_RESTORED: dict[str, str] = {
    "model_accepts_loss_kwargs": "a switch, not a tally: the loss guard turns it off part-way through the first step; "
                                 "put back on one rank only, that rank gathered item counts the others did not (a hang)",
    "current_flos": "transformers' loop adds each micro-step's flos after its training_step call, once per call (a "
                    "recovered step is one call); put back to a step's start it would lose its earlier micro-steps'",
    "_tr_loss": "transformers' loop adds each training_step's returned loss after the call, once per call",
    "_total_loss_scalar": "transformers' loop sums the logged losses at logging time, outside training_step",
    "_globalstep_last_logged": "transformers' loop state, set at logging time",
    "_step": "GRPO, RLOO, Distillation: counts training_step calls to pick buffered generations; these trainers prepare "
             "their own batches, so the recovery never runs their steps again (recovery.step_aside_reason), and the "
             "loss probe calls compute_loss only",
    "_current_train_step_time": "GRPO, RLOO, Distillation: the wall time of training_step calls (those trainers: see _step)",
    "_buffered_inputs": "GRPO, RLOO, Distillation: the generated batches _prepare_inputs keeps for the next micro-steps "
                        "(tensors of a whole generation batch, not a tally; those trainers: see _step)",
    "_last_loaded_step": "GRPO, RLOO, Distillation: when the weights last went to vLLM (generation state; see _step)",
    "_logs": "GRPO, RLOO: the completions generation logs for a table (generation state; see _step)",
    "_pending_metrics": "GRPO, RLOO: metrics reward functions filed during generation, emptied by the same call",
    "_pending_extra_logs": "GRPO, RLOO: columns reward functions filed during generation, emptied by the same call",
    "environments": "GRPO: the environments of the current generation batch (objects; see _step)",
    "_batch_environments": "GRPO: the environment names of the current generation batch (see _step)",
    "_sync_tool_dicts": "GRPO: the tools of the current generation batch (functions; see _step)",
    "_async_tool_dicts": "GRPO: the tools of the current generation batch (functions; see _step)",
}

_registered: dict[str, str] = {}  # register_trainer_state: name -> reason
_warned: set[tuple[type, str]] = set()


def register_trainer_state(*names: str, reason: str = "registered with register_trainer_state") -> None:
    """Name attributes of your Trainer (subclass) that its ``training_step`` or ``compute_loss`` changes and that a
    re-run must not count twice (a counter, a list of metrics): the OOM recovery and the loss probe put them back as
    they were. For every Trainer that has them; ``hf_gpu_train_state = ("my_counter", ...)`` on the subclass names
    them for that class alone."""
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"register_trainer_state: {name!r} is not an attribute name")
        if name in NOT_RESTORED:
            raise ValueError(f"register_trainer_state: {name} must not be put back: {NOT_RESTORED[name]}")
        _registered[name] = reason


def names_for(obj) -> dict[str, str]:
    """The attribute names ``take`` copies for ``obj`` (whether it has them or not), each with its reason."""
    names = {**TRAINER_STATE, **_registered}
    for cls in reversed(type(obj).__mro__):
        own = cls.__dict__.get(CLASS_ATTRIBUTE, ())
        names.update((name, f"{cls.__name__}.{CLASS_ATTRIBUTE}") for name in ((own,) if isinstance(own, str) else own))
    return names


def _copyable(value, budget: list[int]) -> bool:
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if isinstance(value, (*PLAIN, torch.Tensor)):
        return True
    if isinstance(value, Mapping):
        return all(_copyable(k, budget) and _copyable(v, budget) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        return all(_copyable(v, budget) for v in value)
    return False


def _tensors(value, found: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _tensors(v, found)
    elif isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        for v in value:
            _tensors(v, found)
    return found


def _copy(value):
    """A copy that shares nothing mutable with ``value``: tensors detached and cloned (deepcopy refuses a tensor that
    is part of a graph), containers deep-copied (a defaultdict stays one)."""
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    memo = {id(t): t.detach().clone() for t in _tensors(value, [])}
    return copy.deepcopy(value, memo)


class Saved(dict):
    """What ``take`` copied, by name, and a cheap look at every attribute nobody named (``unnamed``: a number or a
    string by its value, a container by its length), for ``put_back`` to say which of them a re-run changed."""

    unnamed: dict


def _glance(value):
    """What a change of ``value`` would show: a number or a string itself; a container (nested ones too: TRL's
    ``{"train": defaultdict(list)}``, a Counter) by its type, its count of leaves and the sum of its numbers, so an
    append and an increment both show; None for anything else, or a container larger than a tally's."""
    if isinstance(value, PLAIN):
        return value
    if not isinstance(value, (Mapping, list, tuple, set, frozenset, collections.deque)):
        return None
    leaves = [0, 0.0]
    budget = [MAX_ITEMS]

    def walk(item) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return False
        if isinstance(item, Mapping):
            return all(walk(v) for v in item.values())
        if isinstance(item, (list, tuple, set, frozenset, collections.deque)):
            return all(walk(v) for v in item)
        leaves[0] += 1
        if isinstance(item, (int, float)) and item == item:  # NaN would never equal itself
            leaves[1] += float(item)
        return True

    return (type(value).__name__, *leaves) if walk(value) else None


def _unnamed(obj, named) -> dict:
    found = {}
    for name, value in vars(obj).items() if hasattr(obj, "__dict__") else ():
        if name in named or name in NOT_RESTORED or name.startswith("_hf_gpu_train"):
            continue
        glance = _glance(value)
        if glance is not None:
            found[name] = glance
    return found


def take(obj) -> Saved:
    """A copy of each attribute of ``obj`` named by ``names_for(obj)`` that ``obj`` has."""
    saved = Saved()
    named = names_for(obj)
    for name in named:
        try:
            value = inspect.getattr_static(obj, name)  # no property or other descriptor is run
        except AttributeError:
            continue
        if _copyable(value, [MAX_ITEMS]):
            saved[name] = _copy(value)
        elif (type(obj), name) not in _warned:
            _warned.add((type(obj), name))
            log.warning("hf_gpu_train: %s.%s is named as Trainer state to put back after a re-run, but holds a %s, which "
                        "is not copied (numbers, strings, tensors and containers of them are)", type(obj).__name__, name,
                        type(value).__name__)
    saved.unnamed = _unnamed(obj, named)
    return saved


def _say_what_changed_unnamed(obj, before: dict) -> None:
    """One warning per attribute nobody named that the work being undone changed: it is not put back (a switch must
    not be, and no list can tell a tally from a switch), so a tally of a Trainer subclass would count that work twice,
    and the warning says how to name it."""
    for name, glance in _unnamed(obj, names_for(obj)).items():
        if name in before and before[name] != glance and (type(obj), name) not in _warned:
            _warned.add((type(obj), name))
            log.warning("hf_gpu_train: %s.%s changed in work that is done again (a step restarted after an out-of-memory "
                        "error, or the loss probe) and is not put back: if it is a tally, it counts that work twice. Name it "
                        "as Trainer state: %s = (%r,) on the class, or hf_gpu_train.oom.register_trainer_state(%r)",
                        type(obj).__name__, name, CLASS_ATTRIBUTE, name, name)


def put_back(obj, saved: dict) -> None:
    """Every attribute ``take`` copied gets its copied value again (a fresh copy, so ``saved`` can be reused); an
    attribute nobody named that changed since is said, once."""
    for name, value in saved.items():
        setattr(obj, name, _copy(value))
    unnamed = getattr(saved, "unnamed", None)
    if unnamed:
        _say_what_changed_unnamed(obj, unnamed)
