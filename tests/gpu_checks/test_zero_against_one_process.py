"""scripts/gpu_check.py's `zero` section (scripts/gpu_checks/zero_against_one_process.py) on the CPU: what it reads from a run's files,
the comparisons and their verdict lines with synthetic inputs, the peak file a training process writes, `--only zero`
skipping with its reason where there is no GPU, and (slow) the whole section rehearsed on CPU processes."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from hf_gpu_train.cli import main as cli
from hf_gpu_train.plan.resolution import check_memory, plan_record, resolve_with_plan
from hf_gpu_train.plan.run_plan_file import read_run_plan
from scripts.gpu_checks import zero_against_one_process as zero
from scripts.gpu_checks.zero_against_one_process import (
    PEAKS_ENV,
    TOLERANCES,
    Peak,
    RunRecord,
    compare_runs,
    compare_weights,
    equality_line,
    memory_lines,
    memory_verdict,
    read_run,
    series_diff,
)

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


def record(name="deepspeed-zero3", losses=(1.6, 1.5, 1.4), norms=(2.0, 1.8, 1.7), precision="bf16", planner=None, peaks=None):
    return RunRecord(name, tuple(losses), tuple(norms), precision, planner, "deepspeed-zero3, micro-batch 8, seq 512, bf16",
                     peaks or {})


def weights(seed: int, scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": scale * torch.randn(64, 32, generator=g), "a.bias": scale * torch.randn(64, generator=g)}


# --- the per-step series ---------------------------------------------------------------------------------------------


def test_series_diff_finds_the_largest_relative_difference_and_its_step():
    d = series_diff([1.0, 2.02, 3.0], [1.0, 2.0, 3.0])
    assert d.same_length and d.steps == 3 and d.worst_step == 2
    assert d.max_abs == pytest.approx(0.02) and d.max_rel == pytest.approx(0.01)
    assert series_diff([1.0, math.nan], [1.0, 1.0]).max_rel == math.inf  # a NaN loss is never close
    assert not series_diff([1.0], [1.0, 1.0]).same_length
    assert not series_diff([], []).same_length  # nothing logged is nothing compared


def test_a_bf16_run_within_its_tolerance_is_ok_and_the_line_says_how_far():
    plain = record("single", precision="bf16")
    got = record(losses=(1.6 * 1.001, 1.5 * 0.995, 1.4 * 1.01), norms=(2.0 * 1.02, 1.8, 1.7))
    c = compare_runs(got, plain, compare_weights(weights(1), weights(1), weights(2)))
    assert c.ok and c.tolerance is TOLERANCES["bf16"]
    line = equality_line(c)
    assert line.startswith("deepspeed-zero3 vs single (3 steps): loss max |diff| 1.40e-02 (1.00%), grad norm max |diff| "
                           "4.00e-02 (2.00%), weights max |diff| 0.00e+00")
    assert line.endswith(": OK")


def test_each_kind_of_difference_fails_with_its_reason():
    plain = record("single")
    far = compare_runs(record(losses=(1.6, 1.5, 1.5)), plain, compare_weights(weights(1), weights(1), weights(2)))
    assert not far.ok and far.problems == ("loss 7.14% apart at step 3 (tolerance 2.00%)",)
    assert equality_line(far).endswith("FAILED: loss 7.14% apart at step 3 (tolerance 2.00%)")
    norm = compare_runs(record(norms=(4.0, 1.8, 1.7)), plain, compare_weights(weights(1), weights(1), weights(2)))
    assert norm.problems == ("gradient norm 100.00% apart at step 1 (tolerance 5.00%)",)
    short = compare_runs(record(losses=(1.6, 1.5), norms=(2.0, 1.8)), plain, compare_weights(weights(1), weights(1)))
    assert short.problems == ("2 logged step(s) against the plain run's 3",)
    assert compare_runs(record(), plain, None).problems == ("no saved weights to compare",)


def test_fp32_is_held_to_the_summation_order_tolerance():
    plain = record("single", precision="fp32")
    same = compare_runs(record(losses=(1.6, 1.5 + 1e-7, 1.4), precision="fp32"), plain,
                        compare_weights(weights(1), weights(1), weights(2)))
    assert same.ok and "loss max |diff| 1.00e-07 (6.7e-08)" in equality_line(same)
    off = compare_runs(record(losses=(1.6, 1.5 * 1.001, 1.4), precision="fp32"), plain,
                       compare_weights(weights(1), weights(1), weights(2)))
    assert off.problems == ("loss 0.10% apart at step 2 (tolerance 0.01%)",)
    assert zero.tolerance_for(None) is TOLERANCES["fp32"]  # a CPU run without a plan record


# --- the weights -----------------------------------------------------------------------------------------------------


def test_a_16_bit_copy_of_the_same_weights_is_only_its_rounding_apart():
    """ZeRO saves its bf16 module weights: the plain run's fp32 weights rounded once are no difference of training, but
    the raw max |diff| still shows the rounding."""
    initial, trained = weights(2), weights(1)
    rounded = {k: v.to(torch.bfloat16) for k, v in trained.items()}
    w = compare_weights(rounded, trained, initial)
    assert w.rounding == "bfloat16" and w.fraction_of_movement == 0.0 and w.compared == 2
    assert 0 < w.max_abs <= torch.finfo(torch.bfloat16).eps / 2 * max(v.abs().max().item() for v in trained.values())


def test_weights_that_did_not_train_or_trained_twice_as_far_are_a_whole_movement_apart():
    initial = weights(2)
    trained = {k: v + 0.01 * torch.sign(weights(3)[k]) for k, v in initial.items()}
    twice = {k: v + 0.02 * torch.sign(weights(3)[k]) for k, v in initial.items()}
    assert compare_weights(initial, trained, initial).fraction_of_movement == pytest.approx(1.0, rel=1e-4)
    assert compare_weights(twice, trained, initial).fraction_of_movement == pytest.approx(1.0, rel=1e-4)
    near = {k: v + 1e-4 * torch.sign(weights(4)[k]) for k, v in trained.items()}
    assert compare_weights(near, trained, initial).fraction_of_movement == pytest.approx(0.01, rel=1e-2)
    c = compare_runs(record(), record("single"), compare_weights(initial, trained, initial))
    assert c.problems == ("weights apart by 100.00% of the training's movement (tolerance 25.00%)",)
    assert compare_weights(initial, trained).fraction_of_movement is None  # without the start, the max |diff| only


def test_zero3s_legacy_layernorm_names_and_a_tied_head_are_the_same_model():
    """Under ZeRO-3 transformers saves BERT's LayerNorm weights as gamma/beta; a tied output head is saved once."""
    t = torch.ones(4)
    got = {"bert.embeddings.LayerNorm.gamma": t, "bert.embeddings.LayerNorm.beta": t, "model.embed_tokens.weight": t}
    expected = {"bert.embeddings.LayerNorm.weight": t, "bert.embeddings.LayerNorm.bias": t, "model.embed_tokens.weight": t,
                "lm_head.weight": t}
    w = compare_weights(got, expected)
    assert w.missing == () and w.compared == 3 and w.max_abs == 0.0
    other = compare_weights({"x.weight": torch.ones(3)}, {"x.weight": torch.ones(4), "y.bias": t})
    assert other.missing == ("y.bias", "x.weight (shape (3,) against (4,))")
    c = compare_runs(record(), record("single"), other)
    assert "tensors in one model only: y.bias, x.weight (shape (3,) against (4,))" in c.problems


# --- memory ----------------------------------------------------------------------------------------------------------


def test_the_planner_must_cover_each_ranks_allocated_peak():
    assert memory_verdict(3 * GIB, 4 * GIB) == ("covered (measured -25.0% against the planner)", True)
    assert memory_verdict(5 * GIB, 4 * GIB) == ("UNDER-COUNTED: measured +25.0% over the planner", False)
    assert memory_verdict(None, 4 * GIB) == ("no CUDA peak (a CPU run)", True)
    assert memory_verdict(GIB, None) == ("no planner figure (the run had no memory plan)", False)
    run = record(planner=4 * GIB, peaks={0: Peak(3 * GIB, int(3.5 * GIB)), 1: Peak(int(4.5 * GIB), 5 * GIB)})
    lines, ok = memory_lines(run)
    assert not ok
    assert lines == [
        "deepspeed-zero3 rank 0: max_memory_allocated 3.00 GiB (reserved 3.50 GiB); planner 4.00 GiB (deepspeed-zero3, "
        "micro-batch 8, seq 512, bf16): covered (measured -25.0% against the planner)",
        "deepspeed-zero3 rank 1: max_memory_allocated 4.50 GiB (reserved 5.00 GiB); planner 4.00 GiB (deepspeed-zero3, "
        "micro-batch 8, seq 512, bf16): UNDER-COUNTED: measured +12.5% over the planner"]
    assert memory_lines(record(planner=GIB)) == (["deepspeed-zero3: no peak file (the run did not finish); planner 1.00 GiB "
                                                  "(deepspeed-zero3, micro-batch 8, seq 512, bf16)"], False)


def test_a_runs_files_are_read_as_the_run_wrote_them(tmp_path):
    """The plan record is the real one (plan_record of a ZeRO-3 plan for an H200 and a BERT-shaped model), the log
    history and run record as the Trainer and the run write them, the peak files as the training process writes them."""
    from transformers import BertConfig

    BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536).save_pretrained(tmp_path / "m")
    assert cli(["config", "--machine", "1x-h200", "--gpus", "1", "--strategy", "deepspeed-zero3", "--model", str(tmp_path / "m"),
                "--seq-len", "128", "--global-batch", "32", "--output", str(tmp_path / "z3")]) == 0
    plan = read_run_plan(tmp_path / "z3.plan.json", "test", environ={})
    resolution = resolve_with_plan(plan, {"precision": "auto", "per_device_train_batch_size": 32}, {"per_device_train_batch_size"})
    memory = check_memory(plan, resolution.values, seq_len=128)
    out = tmp_path / "out"
    out.mkdir()
    (out / "run_summary.json").write_text(json.dumps({"global_step": 2, "plan": plan_record(plan, resolution, memory, 2 * GIB, "x")}))
    (out / "trainer_state.json").write_text(json.dumps({"log_history": [
        {"loss": 1.61, "grad_norm": 3.2, "learning_rate": 1e-4, "epoch": 0.1, "step": 1},
        {"loss": 1.52, "grad_norm": 2.9, "learning_rate": 9e-5, "epoch": 0.2, "step": 2},
        {"train_runtime": 1.0, "train_loss": 1.56, "epoch": 0.2, "step": 2}, {"eval_loss": 1.5, "epoch": 0.2, "step": 2}]}))
    (out / "hf_gpu_train_run.json").write_text(json.dumps({"precision": "bf16", "processes": 1}))
    (out / "model.safetensors").write_bytes(b"")
    peaks = tmp_path / "peaks"
    peaks.mkdir()
    (peaks / "peak_rank0.json").write_text(json.dumps({"rank": 0, "device": "cuda:0", "max_memory_allocated_bytes": GIB,
                                                       "max_memory_reserved_bytes": 2 * GIB}))
    run = read_run("deepspeed-zero3", out, peaks)
    assert run.losses == (1.61, 1.52) and run.grad_norms == (3.2, 2.9) and run.precision == "bf16"
    assert run.planner_bytes == memory.estimate_bytes > GIB
    assert run.planned_for == "deepspeed-zero3, micro-batch 32, seq 128, bf16, 1 process(es)"
    assert run.peaks == {0: Peak(GIB, 2 * GIB)} and run.weights == out / "model.safetensors"


# --- the training process's side ------------------------------------------------------------------------------------


def test_the_probe_runs_the_entry_point_and_then_writes_this_processs_peak(tmp_path, monkeypatch):
    import hf_gpu_train.finetune.run as run

    seen = []
    monkeypatch.setattr(run, "main", lambda argv: seen.append(argv) or 0)
    assert zero.probe_main(["--config", "x", "max_steps=1"], {PEAKS_ENV: str(tmp_path / "p"), "RANK": "1"}) == 0
    assert seen == [["--config", "x", "max_steps=1"]]
    written = json.loads((tmp_path / "p" / "peak_rank1.json").read_text())
    if not torch.cuda.is_available():
        assert written == {"rank": 1, "device": "cpu", "max_memory_allocated_bytes": None, "max_memory_reserved_bytes": None}
    assert zero.read_peaks(tmp_path / "p") == {1: Peak(written["max_memory_allocated_bytes"], written["max_memory_reserved_bytes"])}
    monkeypatch.setattr(run, "main", lambda argv: 2)  # a failed run writes nothing: its peak would mean nothing
    assert zero.probe_main([], {PEAKS_ENV: str(tmp_path / "q")}) == 2 and not (tmp_path / "q").exists()


def test_dropout_is_turned_off_in_the_starting_model():
    from transformers import BertConfig, LlamaConfig

    config = BertConfig(classifier_dropout=None)
    assert zero.without_dropout(config) == ["attention_probs_dropout_prob", "hidden_dropout_prob"]
    assert config.hidden_dropout_prob == 0.0 and config.attention_probs_dropout_prob == 0.0 and config.classifier_dropout is None
    assert zero.without_dropout(LlamaConfig()) == []  # attention_dropout 0.0 already


def test_world_size_and_the_reasons_to_skip():
    assert zero.world_size_for(1)[0] == 1 and "two NCCL ranks cannot share a GPU" in zero.world_size_for(1)[1]
    assert zero.world_size_for(8)[0] == 2
    assert zero.skip_reason(False, True).startswith("no CUDA device: skipped")
    assert zero.skip_reason(True, False).startswith("deepspeed is not installed: skipped")
    assert zero.skip_reason(True, True) is None


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_zero_is_a_section_and_skips_with_its_reason_without_a_gpu(monkeypatch, capsys):
    check = gpu_check()
    assert "zero" in check.CHECKS and "zero:" in check.__doc__
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check.main(["--only", "zero"]) == 0
    printed = capsys.readouterr().out
    assert "=== DeepSpeed ZeRO-2 / ZeRO-3 against one process" in printed
    assert "no CUDA device: skipped (the memory per rank needs a GPU" in printed
    assert printed.rstrip().endswith("zero: OK")


# --- the whole section, on CPU processes ----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_section_rehearsed_on_cpu_processes_finds_zero_equal_to_one_process(tmp_path, capsys):
    """The GPU's path but the device: `config --strategy deepspeed-zero2/3` for 2 CPU processes, `launch -m
    scripts.gpu_checks.zero_against_one_process`, the files read back and compared (fp32: within the summation-order tolerance)."""
    from tests.scaling.finetune_cases import text_case

    args = text_case(tmp_path)
    case = zero.ZeroCase("tiny-text", "minilm_text_demo", (*args, "learning_rate=1e-3", "warmup_ratio=0",
                                                           "extra={adam_epsilon: 1.0e-6}"), global_batch=16, steps=3)
    assert zero.rehearse_on_cpu(ROOT, [case], processes=2, timeout_s=900)
    printed = capsys.readouterr().out
    for strategy in ("deepspeed-zero2", "deepspeed-zero3"):
        assert f"{strategy} vs single (3 steps): loss max |diff|" in printed and printed.count(f"{strategy} rank ") == 2
    assert printed.count(": OK") == 2 and "no CUDA peak (a CPU run)" in printed
