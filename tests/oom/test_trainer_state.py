"""The Trainer state a re-run restores is an explicit list (``hf_gpu_train/oom/trainer_state.py``), checked here against
the installed transformers and TRL: every attribute a training step changes is either put back (``TRAINER_STATE``) or
known not to matter (``NOT_RESTORED``, with its reason). When a new transformers or TRL adds a tally, the first test
fails and names it. A user's own subclass registers its tallies, and they are put back after an OOM."""

from __future__ import annotations

import collections
import inspect
import logging
from collections import defaultdict
from collections.abc import Mapping

import pytest
import torch
from transformers import Trainer

from hf_gpu_train.oom import OOMFaultInjector, enable_oom_recovery, register_trainer_state, trainer_state
from hf_gpu_train.oom.trainer_state import NOT_RESTORED, TRAINER_STATE, put_back, take
from tests.callbacks.tiny import TokenDataset
from tests.oom.test_oom import exact_bert, oom_args

PLAIN = (int, float, str, bool, bytes, type(None))


# -- (a) the list against the installed transformers and TRL --------------------------------------------------------
def _fingerprint(value, depth: int = 0):
    """What ``value`` holds, comparable after a step: plain data and tensors by value, containers item by item, any other
    object by identity (the model, the optimizer, the accelerator change inside, and are not tallies)."""
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", value.detach().cpu().clone())
    if depth > 6:
        return ("object", id(value))
    if isinstance(value, Mapping):
        return ("mapping", type(value), tuple((k, _fingerprint(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        return ("items", type(value), tuple(_fingerprint(v, depth + 1) for v in value))
    return ("object", id(value))


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _changed(before: dict, after: dict) -> set[str]:
    return {n for n in before.keys() | after.keys() if n not in before or n not in after or not _same(before[n], after[n])}


def changes_of_one_optimizer_step(trainer) -> tuple[set[str], set[str]]:
    """(the attributes ``training_step`` changed, the attributes the loop changed between two ``training_step`` calls of
    the same optimizer step), over one optimizer step of two accumulated micro-steps."""
    original = trainer.training_step
    inside, between, last = set(), set(), {}

    def training_step(*args, **kwargs):
        before = {n: _fingerprint(v) for n, v in vars(trainer).items()}
        if last and last["step"] == trainer.state.global_step:
            between.update(_changed(last["vars"], before))
        result = original(*args, **kwargs)
        after = {n: _fingerprint(v) for n, v in vars(trainer).items()}
        inside.update(_changed(before, after))
        last.update(step=trainer.state.global_step, vars=after)
        return result

    trainer.training_step = training_step
    trainer.args.max_steps = 1
    trainer.train()
    return inside - {"training_step"}, between - {"training_step"}


def kto(out: str, per_device: int, accumulation: int):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from tests.integrations.peers import common_args, llama, lora, preferences, tokenizer

    tok = tokenizer()
    rows = [{"prompt": r["prompt"], "completion": r["chosen"] if i % 2 else r["rejected"], "label": bool(i % 2)}
            for i, r in enumerate(preferences())]
    args = KTOConfig(**common_args(out, per_device, accumulation), max_length=32, gradient_checkpointing=False)
    return KTOTrainer(model=llama(tok), args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                      peft_config=lora())


def reward(out: str, per_device: int, accumulation: int):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from tests.integrations.peers import common_args, preferences, tokenizer

    tok = tokenizer()
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id, num_labels=1))
    rows = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in preferences()]
    args = RewardConfig(**common_args(out, per_device, accumulation), max_length=32, gradient_checkpointing=False)
    return RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)


def rloo(out: str, per_device: int, accumulation: int):
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    from tests.integrations.peers import common_args, llama, lora, prompt_completion, tokenizer

    def reward_length(completions, **kwargs):
        return [float(len(c.split())) for c in completions]

    tok = tokenizer()
    args = RLOOConfig(**common_args(out, per_device, accumulation), num_generations=2, max_completion_length=6,
                      gradient_checkpointing=False)
    return RLOOTrainer(model=llama(tok), args=args, reward_funcs=reward_length, processing_class=tok, peft_config=lora(),
                       train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in prompt_completion()]))


def build(kind: str, out: str):
    if kind != "Trainer":
        pytest.importorskip("trl")
        pytest.importorskip("peft")
    if kind in ("KTOTrainer", "RewardTrainer", "RLOOTrainer"):
        return {"KTOTrainer": kto, "RewardTrainer": reward, "RLOOTrainer": rloo}[kind](out, 4, 2)
    from tests.integrations.peers import build as peer

    return peer(kind, out, 4, accumulation=2)


# what the step of each trainer is known to tally (so the test sees a change when there is one)
TALLIES = {"Trainer": set(), "SFTTrainer": {"_metrics", "_total_train_tokens"}, "DPOTrainer": {"_metrics", "_total_train_tokens"},
           "KTOTrainer": {"_metrics", "_total_train_tokens"}, "RewardTrainer": {"_metrics", "_total_train_tokens"},
           "GRPOTrainer": {"_metrics"}, "RLOOTrainer": {"_metrics"}}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(TALLIES))
def test_every_attribute_a_training_step_changes_is_listed_as_restored_or_as_not_mattering(tmp_path, kind):
    trainer = build(kind, str(tmp_path / "out"))
    inside, between = changes_of_one_optimizer_step(trainer)
    unknown = sorted(inside - TRAINER_STATE.keys() - NOT_RESTORED.keys())
    assert not unknown, (f"{kind}.training_step changed {unknown}: add each to TRAINER_STATE (a tally a re-run must not "
                         "count twice) or to NOT_RESTORED (with the reason it must not be put back) in "
                         "hf_gpu_train/oom/trainer_state.py")
    assert TALLIES[kind] <= inside  # the step's tallies are seen, and listed
    assert TALLIES[kind] <= take(trainer).keys()
    # what is taken at an optimizer step's start is put back at a restart: the loop must not change it between the step's
    # micro-steps (it adds current_flos there, once per training_step call: why that one is not restored)
    assert not between & TRAINER_STATE.keys(), between
    assert "current_flos" in between or kind in ("GRPOTrainer", "RLOOTrainer")  # their flos count is 0


def test_the_lists_are_disjoint_and_every_entry_has_its_reason():
    assert not TRAINER_STATE.keys() & NOT_RESTORED.keys()
    assert all(isinstance(why, str) and len(why) > 20 for why in (*TRAINER_STATE.values(), *NOT_RESTORED.values()))
    assert "model_accepts_loss_kwargs" in NOT_RESTORED and "current_flos" in NOT_RESTORED


# -- (b) a user's own tallies, registered, put back after an injected OOM ----------------------------------------------
class CountingTrainer(Trainer):
    """Counts the samples its compute_loss sees three times: registered by the class attribute, registered with
    register_trainer_state, and not registered at all."""

    hf_gpu_train_state = ("samples_by_class_attribute",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.samples_by_class_attribute = 0
        self.samples_registered = {"train": []}
        self.samples_unregistered = 0
        self.nested_unregistered = {"train": defaultdict(list)}  # TRL's shape of a tally, nobody named it

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if model.training:
            n = len(inputs["labels"])
            self.samples_by_class_attribute += n
            self.samples_registered["train"].append(n)
            self.samples_unregistered += n
            self.nested_unregistered["train"]["samples"].append(n)
        return result


def counted(tmp_path, name: str, injector=None) -> CountingTrainer:
    model = exact_bert()
    if injector:
        injector.install(model)
    trainer = CountingTrainer(model=model, args=oom_args(tmp_path / name, max_steps=2), train_dataset=TokenDataset(n=32))
    enable_oom_recovery(trainer)
    trainer.train()
    return trainer


def test_a_registered_attribute_is_put_back_after_an_oom_in_backward(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_state, "_registered", {})
    register_trainer_state("samples_registered")
    clean = counted(tmp_path, "clean")
    assert clean.samples_by_class_attribute == clean.samples_unregistered == 16
    # backward fails after compute_loss counted the whole batch: the step runs again in micro-batches of 4
    injector = OOMFaultInjector(max_batch=4, phase="backward")
    recovered = counted(tmp_path, "recovered", injector)
    assert injector.raised == 1
    assert recovered.samples_by_class_attribute == 16
    assert recovered.samples_registered == {"train": [4, 4, 4, 4]}
    assert recovered.samples_unregistered == 24  # not named anywhere: counted twice, as the list is explicit


def test_an_unnamed_attribute_the_undone_work_changed_is_said_once_with_the_fix(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(trainer_state, "_registered", {})
    monkeypatch.setattr(trainer_state, "_warned", set())
    register_trainer_state("samples_registered")
    with caplog.at_level(logging.WARNING, logger="hf_gpu_train.oom"):
        counted(tmp_path, "recovered", OOMFaultInjector(max_batch=4, phase="backward"))
    said = [r.getMessage() for r in caplog.records if "changed in work that is done again" in r.getMessage()]
    assert len(said) == 2 and "CountingTrainer.samples_unregistered" in said[0]
    assert "CountingTrainer.nested_unregistered" in said[1]  # an append inside a nested container shows too
    assert "hf_gpu_train_state = ('samples_unregistered',)" in said[0]
    assert "register_trainer_state('samples_unregistered')" in said[0]
    caplog.clear()
    monkeypatch.setattr(trainer_state, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="hf_gpu_train.oom"):
        counted(tmp_path, "clean")  # no OOM: nothing is done again, nothing to say
    assert not [r for r in caplog.records if "changed in work that is done again" in r.getMessage()]


def test_register_trainer_state_refuses_the_loops_switches_and_non_names(monkeypatch):
    monkeypatch.setattr(trainer_state, "_registered", {})
    with pytest.raises(ValueError, match="hang"):
        register_trainer_state("model_accepts_loss_kwargs")
    with pytest.raises(ValueError, match="not an attribute name"):
        register_trainer_state("not a name")
    register_trainer_state("mine", "theirs")
    assert {"mine", "theirs"} <= trainer_state.names_for(object()).keys()


# -- (c) no guess: nothing is read from source files, and an attribute nobody named is not copied -----------------------
def test_nothing_is_guessed_from_source(monkeypatch):
    source = inspect.getsource(trainer_state)
    assert "getsource" not in source and "import re\n" not in source and not hasattr(trainer_state, "_assigned_by_library")

    def refuse(*args, **kwargs):
        raise AssertionError("take read a source file")

    class Mine:
        hf_gpu_train_state = ("mine",)

    obj = Mine()
    obj.mine, obj.unnamed, obj._metrics = 1, 2, {"train": defaultdict(list)}
    monkeypatch.setattr(inspect, "getsource", refuse)
    monkeypatch.setattr(inspect, "getsourcelines", refuse)
    monkeypatch.setattr("builtins.open", refuse)
    assert take(obj) == {"mine": 1, "_metrics": {"train": {}}}  # named by the class, named by the list; not "unnamed"


def test_copies_are_cheap_and_share_nothing(caplog):
    class Holder:
        hf_gpu_train_state = ("tally", "seen", "loss", "model")

    weight = torch.ones(2, requires_grad=True)
    holder = Holder()
    holder._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    holder.tally = (weight * 2).sum()  # part of a graph: detached and cloned
    holder.seen = {"losses": [weight * 3]}
    holder.loss, holder.model = 1.5, torch.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="hf_gpu_train.oom"):
        saved = take(holder)
    assert "model" not in saved and "Holder.model" in caplog.text  # named, but an object: left alone, said once
    holder._metrics["train"]["entropy"].append(1.0)
    holder.tally += 1
    holder.seen["losses"].append(torch.zeros(2))
    put_back(holder, saved)
    assert isinstance(holder._metrics["train"], defaultdict) and holder._metrics["train"] == {}
    assert float(holder.tally) == 4.0 and not holder.tally.requires_grad
    assert len(holder.seen["losses"]) == 1 and not holder.seen["losses"][0].requires_grad
    holder.tally.add_(5)  # put back a fresh copy each time: the saved one is untouched
    put_back(holder, saved)
    assert float(holder.tally) == 4.0
