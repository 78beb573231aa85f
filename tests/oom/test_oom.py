import json
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from hf_gpu_train.oom import OOMFaultInjector, OutOfMemoryAtMicroBatchOne, enable_oom_recovery
from hf_gpu_train.oom.microbatch import is_oom_error, split_batch
from tests.callbacks.tiny import TokenDataset
from tests.launching import cpu_config, launch


def exact_bert():
    """No dropout: a split batch then draws no other random masks than the whole one."""
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=64, max_position_embeddings=32, num_labels=2,
                                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0))


def oom_args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=8, max_steps=6, learning_rate=1e-3, report_to="none", use_cpu=True,
                save_strategy="no", disable_tqdm=True, logging_steps=2, seed=0, data_seed=0, lr_scheduler_type="linear", warmup_steps=2)
    base.update(kw)
    return TrainingArguments(**base)


def train(tmp_path, name, injector=None, recover=True, mean_loss=False, **kw):
    model = exact_bert()
    if injector:
        injector.install(model)
    trainer = Trainer(model=model, args=oom_args(tmp_path / name, **kw), train_dataset=TokenDataset(n=96), eval_dataset=TokenDataset(n=16))
    if mean_loss:
        # transformers 5 takes BertForSequenceClassification's loss for sum/num_items-normalised (the model accepts
        # the argument) and skips the division by gradient_accumulation_steps: gradients come out doubled at GA=2.
        trainer.loss_is_scaled_for_ga = False
    recovery = enable_oom_recovery(trainer) if recover else None
    trainer.train()
    return trainer, model, recovery


def assert_same_weights(a, b, atol=2e-6):
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.allclose(x, y, atol=atol, rtol=1e-5), f"{name} differs by {(x - y).abs().max()}"


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_recovered_run_equals_no_oom_and_small_micro_batch_runs(tmp_path, phase):
    _, clean, _ = train(tmp_path, "clean")
    injector = OOMFaultInjector(max_batch=4, phase=phase)
    trainer, recovered, recovery = train(tmp_path, "recovered", injector=injector)
    _, small, _ = train(tmp_path, "small", mean_loss=True, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert injector.raised == 1 and recovery.micro_batch == 4
    assert trainer.state.global_step == 6  # no step redone, none skipped
    assert recovery.events[0]["from"] == 8 and recovery.events[0]["to"] == 4 and recovery.events[0]["step"] == 0
    assert_same_weights(recovered, clean)
    assert_same_weights(recovered, small)


def test_transformers_5_gradient_accumulation_needs_the_mean_loss_flag(tmp_path):
    """The upstream behaviour our finetune factory corrects (loss_is_scaled_for_ga=False)."""
    _, clean, _ = train(tmp_path, "clean", recover=False)
    _, unflagged, _ = train(tmp_path, "ga", recover=False, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    _, flagged, _ = train(tmp_path, "ga2", recover=False, mean_loss=True, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert_same_weights(flagged, clean)
    with pytest.raises(AssertionError):
        assert_same_weights(unflagged, clean)


def test_shrinks_repeatedly_until_it_fits(tmp_path):
    injector = OOMFaultInjector(max_batch=1)
    _, _, recovery = train(tmp_path, "deep", injector=injector, max_steps=2)
    assert recovery.micro_batch == 1 and [e["to"] for e in recovery.events] == [4, 2, 1]


def test_non_oom_errors_pass_through_untouched(tmp_path):
    model = exact_bert()

    def boom(module, args, kwargs):
        raise ValueError("a real bug, not memory")

    model.register_forward_pre_hook(boom, with_kwargs=True)
    trainer = Trainer(model=model, args=oom_args(tmp_path), train_dataset=TokenDataset(n=32))
    recovery = enable_oom_recovery(trainer)
    with pytest.raises(ValueError, match="a real bug, not memory"):
        trainer.train()
    assert recovery.events == []


def test_micro_batch_one_still_oom_lists_the_remedies(tmp_path):
    model = exact_bert()
    OOMFaultInjector(max_batch=0).install(model)
    trainer = Trainer(model=model, args=oom_args(tmp_path), train_dataset=TokenDataset(n=32))
    enable_oom_recovery(trainer)
    with pytest.raises(OutOfMemoryAtMicroBatchOne) as info:
        trainer.train()
    text = str(info.value)
    order = [text.index(s) for s in ("precision=bf16", "gradient_checkpointing=true", "max_length", "Adafactor", "--strategy fsdp")]
    assert order == sorted(order)
    assert "Memory planner:" in text and "GiB per GPU at micro-batch 1" in text


def test_eval_oom_shrinks_the_eval_batch_only(tmp_path):
    injector = OOMFaultInjector(max_batch=4, eval_too=True)
    trainer, _, recovery = train(tmp_path, "eval", injector=injector, per_device_train_batch_size=4, per_device_eval_batch_size=16,
                                 eval_strategy="steps", eval_steps=3)
    assert recovery.state.eval_micro_batch == 4 and recovery.micro_batch is None
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 2
    reference = Trainer(model=trainer.model, args=oom_args(tmp_path / "ref", per_device_eval_batch_size=16), eval_dataset=TokenDataset(n=16))
    injector.remove()
    assert abs(reference.evaluate()["eval_loss"] - trainer.evaluate()["eval_loss"]) < 1e-5


def train_with_checkpoints(out, max_batch: int = 4):
    """A recovered run (OOM above ``max_batch``) that saves a checkpoint every 3 steps."""
    model = exact_bert()
    OOMFaultInjector(max_batch=max_batch).install(model)
    trainer = Trainer(model=model, args=oom_args(out, save_strategy="steps", save_steps=3), train_dataset=TokenDataset(n=96))
    enable_oom_recovery(trainer)
    trainer.train()
    return trainer


def test_resume_starts_at_the_configured_micro_batch_and_says_so(tmp_path, caplog):
    """The checkpoint records the micro-batch an OOM forced, but a resumed run (perhaps on another machine, with more
    memory) starts at the configured batch: the next OOM recovers again, in place."""
    out = tmp_path / "resume"
    train_with_checkpoints(out)
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["OOMRecoveryState"]["attributes"]["micro_batch"] == 4
    fresh_model = exact_bert()
    counting = OOMFaultInjector(max_batch=4).install(fresh_model)
    resumed = Trainer(model=fresh_model, args=oom_args(out, save_strategy="steps", save_steps=3), train_dataset=TokenDataset(n=96))
    recovery = enable_oom_recovery(resumed)
    with caplog.at_level("WARNING", logger="hf_gpu_train.oom"):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    said = [r for r in caplog.records if "recorded micro-batch 4" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING" and "configured" in said[0].getMessage()
    assert counting.raised == 1 and recovery.events[0]["from"] == 8  # started whole, recovered once more
    assert recovery.micro_batch == 4


def test_helpers():
    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_oom_error(RuntimeError("CUDA error: out of memory"))
    assert is_oom_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    # a different bug (non-contiguous input, unsupported shape) that a smaller micro-batch would only hide
    assert not is_oom_error(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."))
    assert not is_oom_error(RuntimeError("shape mismatch"))
    chunks = split_batch({"input_ids": torch.zeros(5, 3), "labels": torch.arange(5), "flag": True}, 2)
    assert [c["labels"].tolist() for c in chunks] == [[0, 1], [2, 3], [4]] and chunks[2]["flag"] is True


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_two_gloo_processes_oom_on_rank_1_only(tmp_path, phase):
    run = launch(cpu_config(tmp_path), Path(__file__).with_name("oom_probe.py"), str(tmp_path), phase, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert r0["micro_batch"] == r1["micro_batch"] == 2  # rank 0 never failed, yet agreed
    assert r0["global_step"] == r1["global_step"] == 6
    for key in r0["params"]:
        assert torch.equal(r0["params"][key], r1["params"][key]), key


def test_the_micro_batch_grows_back_by_default_and_backs_off_when_it_fails_again(tmp_path, caplog):
    from hf_gpu_train.oom.policy import GROW_AFTER_STEPS

    _, clean, _ = train(tmp_path, "clean", max_steps=12)
    assert enable_oom_recovery(Trainer(model=exact_bert(), args=oom_args(tmp_path / "d"))).grow_after_steps == GROW_AFTER_STEPS
    # the memory came back after one OOM: one growth later, the whole batch again
    model = exact_bert()
    OOMFaultInjector(max_batch=4, times=1).install(model)
    trainer = Trainer(model=model, args=oom_args(tmp_path / "grow"), train_dataset=TokenDataset(n=96))
    growing = enable_oom_recovery(trainer, grow_after_steps=2)
    with caplog.at_level("WARNING", logger="hf_gpu_train.oom"):
        trainer.train()
    assert growing.micro_batch is None and len(growing.events) == 1
    assert any("trying micro-batch" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    # the memory never came back: each failed growth doubles the wait (2, then 4, then 8 clean steps), and the run stays
    # the clean run
    model = exact_bert()
    OOMFaultInjector(max_batch=4).install(model)
    trainer = Trainer(model=model, args=oom_args(tmp_path / "tight", max_steps=12), train_dataset=TokenDataset(n=96))
    tight = enable_oom_recovery(trainer, grow_after_steps=2)
    trainer.train()
    assert [e["step"] for e in tight.events] == [0, 2, 6] and tight.micro_batch == 4
    assert_same_weights(model, clean)
    off = enable_oom_recovery(Trainer(model=exact_bert(), args=oom_args(tmp_path / "off")), grow_after_steps=None)
    assert off.grow_after_steps is None


def test_allocator_retries_climbing_warn_before_the_crash(monkeypatch, caplog):
    from hf_gpu_train.oom.recovery import _RecoveryHooks

    retries = iter([0, 2, 5, 9, 14])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda *a, **k: {"num_alloc_retries": next(retries)})
    state = _RecoveryHooks(recovery=None)
    with caplog.at_level("WARNING", logger="hf_gpu_train.oom"):
        for _ in range(5):
            state._check_thrash()
    warnings = [r for r in caplog.records if "memory thrash" in r.getMessage()]
    assert len(warnings) == 1 and "expandable_segments:True" in warnings[0].getMessage()


def test_the_gradient_hooks_leave_the_parameters_at_train_end(tmp_path):
    model = exact_bert()
    trainer = Trainer(model=model, args=oom_args(tmp_path, max_steps=2), train_dataset=TokenDataset(n=32))
    recovery = enable_oom_recovery(trainer)
    trainer.train()
    assert recovery.reducer is None
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters() if p.requires_grad)


@pytest.mark.slow
def test_one_rank_that_cannot_fit_one_sample_stops_every_rank_together(tmp_path):
    """In a micro-step without sync the failing rank does not raise alone: it waits for the step's vote, where every
    rank learns it and raises; a collective after that still matches on both ranks."""
    run = launch(cpu_config(tmp_path), Path(__file__).with_name("fatal_probe.py"), str(tmp_path), timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results == [{"raised": True, "all_reduce_after": 2.0}] * 2


def test_restoring_callback_states_keeps_the_recovery_wired(tmp_path):
    """restore_callback_states_from_checkpoint=True makes the Trainer rebuild OOMRecoveryState from the checkpoint: the
    recovery must use the new object (starting at the configured batch, not the recorded micro-batch), and shrink it."""
    out = tmp_path / "restore"
    train_with_checkpoints(out)
    fresh = exact_bert()
    tighter = OOMFaultInjector(max_batch=2).install(fresh)  # less memory on the resumed run
    resumed = Trainer(model=fresh, args=oom_args(out, save_strategy="steps", save_steps=3, restore_callback_states_from_checkpoint=True),
                      train_dataset=TokenDataset(n=96))
    recovery = enable_oom_recovery(resumed)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    states = [c for c in resumed.callback_handler.callbacks if type(c).__name__ == "OOMRecoveryState"]
    assert len(states) == 1 and states[0] is recovery.state  # the rebuilt object, not the one enable_oom_recovery made
    assert recovery.micro_batch == 2 and tighter.raised == 2  # started at the configured 8, shrank to 4 and to 2
    assert [e["from"] for e in recovery.events] == [8, 4]
