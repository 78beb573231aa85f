"""The trial side in one process: every process's measurement combined, the trial's config, and a causal LM's two
packing layouts from one loaded model."""

from __future__ import annotations

import pytest

from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.tune.candidates import Candidate
from hf_gpu_train.tune.trials import LocalMeasurement, combine, trial_config

C = Candidate(micro_batch=4, accumulation=2, gradient_checkpointing=False, dataloader_num_workers=0, precision="fp32")


def test_processes_combine_into_global_throughput_the_fullest_memory_and_the_longest_wait():
    rank0 = LocalMeasurement("ok", measured_s=2.0, warmup_s=1.0, tokens=3000, step_times_s=(0.5, 0.5, 0.5, 0.5), data_wait_s=0.2,
                             peak_memory_bytes=10, device_memory_bytes=100, measured_steps=4)
    rank1 = LocalMeasurement("oom", "ran out at 4", measured_s=2.5, warmup_s=1.2, tokens=2000, step_times_s=(0.6,) * 4,
                             data_wait_s=0.5, peak_memory_bytes=30, device_memory_bytes=100, rescued_micro_batch=2,
                             failed_micro_batch=4, measured_steps=4)
    r = combine(C, [rank0, rank1], warmup_steps=2, seconds=7.0, world_size=2)
    assert (r.status, r.reason, r.rescued_micro_batch, r.failed_micro_batch) == ("oom", "ran out at 4", 2, 4)
    assert r.samples_per_s == 4 * 4 * 2 * 2 / 2.5  # 4 steps of 16 samples over 2 processes, in the slower one's time
    assert r.tokens_per_s == 5000 / 2.5 and r.peak_memory_bytes == 30 and r.data_wait_pct == 20.0
    assert r.step_times_s == (0.5, 0.5, 0.5, 0.5) and r.spread_pct == 0.0 and r.measured_steps == 4 and r.seconds == 7.0
    skipped = combine(C, [LocalMeasurement("skipped", "no checkpointing")] * 2, 2, 1.0, 2)
    assert (skipped.status, skipped.reason, skipped.samples_per_s) == ("skipped", "no checkpointing", None)


def test_a_trial_runs_the_candidates_values_with_nothing_inside_the_window():
    base = load_config(None, ["per_device_train_batch_size=32", "global_batch_size=64", "eval_strategy=steps", "eval_steps=5"])
    cfg = trial_config(base, C, world_size=8, warmup_steps=2, measure_steps=5, output_dir="/tmp/trials")
    assert (cfg.per_device_train_batch_size, cfg.global_batch_size, cfg.max_steps, cfg.logging_steps) == (4, 64, 7, 8)
    assert (cfg.eval_strategy, cfg.save_strategy, cfg.report_to, cfg.output_dir) == ("no", "no", "none", "/tmp/trials")
    assert trial_config(base, C, 8, 2, None, "/tmp/t").max_steps == 32  # the first trial decides: room for 30 measured


@pytest.mark.slow
def test_a_causal_lm_trains_both_packing_layouts_from_one_loaded_model(tmp_path):
    pytest.importorskip("hf_gpu_train.finetune.tasks.language_modeling.packing", reason="the causal-LM task is not in this tree")
    tiny = pytest.importorskip("tests.finetune.tasks.language_modeling.tiny")
    from hf_gpu_train.tune.trials import TrialSession

    chat_rows, save_tiny_model, write_jsonl = tiny.chat_rows, tiny.save_tiny_model, tiny.write_jsonl
    model = save_tiny_model(tmp_path / "model")
    cfg = load_config(None, [f"model={model}", f"train_file={write_jsonl(tmp_path / 'train.jsonl', chat_rows(64))}",
                             f"validation_file={write_jsonl(tmp_path / 'validation.jsonl', chat_rows(8, offset=100))}",
                             "task=causal-lm", "method=full", "max_length=256", "per_device_train_batch_size=4",
                             "global_batch_size=8", "generation_samples=0", f"output_dir={tmp_path / 'out'}"])
    session = TrialSession(cfg, str(tmp_path / "trials"), environ={})
    packed = Candidate(4, 2, False, 0, "fp32", packing="auto")
    padded = Candidate(4, 2, False, 0, "fp32", packing=False)
    results = {c.packing: combine(c, [session.run(c, 1, 3)], 1, 1.0, 1) for c in (packed, padded)}
    assert session.layout("auto").packed and not session.layout(False).packed
    assert session.layout(False) is session.layout(False)  # built once
    assert len(session.layout("auto").train) < len(session.layout(False).train) == 64  # rows hold several examples
    assert all(r.status == "ok" and r.tokens_per_s > 0 and r.measured_steps == 3 for r in results.values())


@pytest.mark.slow
def test_trials_share_one_model_and_leave_nothing_behind(tmp_path):
    """After a trial with checkpointing the model has it off again, no Trainer (and so no optimizer state) survives,
    and the gradient hooks the OOM recovery put on the shared parameters are gone."""
    import gc
    import warnings

    import torch
    from transformers import Trainer

    from hf_gpu_train.tune.trials import TrialSession
    from tests.scaling.finetune_cases import text_case

    cfg = load_config(None, [*text_case(tmp_path), "global_batch_size=16", f"output_dir={tmp_path / 'out'}"])
    session = TrialSession(cfg, str(tmp_path / "trials"), environ={})

    def hooks() -> int:  # post-accumulate-grad hooks on the shared parameters (the recovery's gradient reducer adds one each)
        counted = 0
        for p in session.model.parameters():
            p.grad = None
            counted += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
        return counted

    before = hooks()
    checkpointed = combine(C, [session.run(replace_ckpt(C), 1, 3)], 1, 1.0, 1)
    assert checkpointed.status == "ok" and not session.model.is_activation_checkpointing
    assert checkpointed.peak_memory_bytes and checkpointed.device_memory_bytes  # on the CPU: the peak resident memory
    from dataclasses import replace

    import transformers.modeling_utils as modeling_utils

    from hf_gpu_train.levers import selective_checkpoint

    enabled, selective_calls = [], []
    original, checkpoint = selective_checkpoint.enable, modeling_utils.checkpoint

    def counting_checkpoint(function, *args, **kwargs):  # what each checkpointed layer runs, with its policy
        selective_calls.append(kwargs.get("context_fn") is not None)
        return checkpoint(function, *args, **kwargs)

    selective_checkpoint.enable = lambda model, *policy: (enabled.append(model), original(model, *policy))[1]
    modeling_utils.checkpoint = counting_checkpoint
    try:
        selective = combine(C, [session.run(replace(C, gradient_checkpointing=True, checkpoint_layers="selective"), 1, 3)], 1, 1.0, 1)
    finally:
        selective_checkpoint.enable, modeling_utils.checkpoint = original, checkpoint
    assert selective.status == "ok" and enabled and not session.model.is_activation_checkpointing  # on for the trial only
    assert selective_calls and all(selective_calls)  # every layer ran under the selective policy during the trial
    plain = combine(C, [session.run(C, 1, 3)], 1, 1.0, 1)
    gc.collect()
    assert plain.status == "ok" and hooks() == before
    with warnings.catch_warnings():  # isinstance over every object touches torch's deprecated aliases
        warnings.simplefilter("ignore", FutureWarning)
        survivors = [o for o in gc.get_objects() if isinstance(o, (Trainer, torch.optim.Optimizer))]
    assert not survivors


def replace_ckpt(candidate: Candidate) -> Candidate:
    from dataclasses import replace

    return replace(candidate, gradient_checkpointing=True)
