"""The candidate space: micro-batches that keep the effective batch, the options of every axis, what the command
line fixes, and the planner's pruning, from a real plan."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from hf_gpu_train.cli import main
from hf_gpu_train.hardware.snapshot import load_machine
from hf_gpu_train.plan.resolution import check_memory
from hf_gpu_train.plan.run_plan_file import read_run_plan
from hf_gpu_train.tune.candidates import AXES, CPU_COMPILE_NOTE, Candidate, CandidateSpace
from hf_gpu_train.tune.job import load_job
from tests.tune.simulated import space


def test_micro_batches_divide_the_samples_per_process_and_the_accumulation_keeps_the_effective_batch():
    sp = space(per_process=24, world=2, start=16)
    assert sp.micro_batches == (1, 2, 3, 4, 6, 8, 12, 24)
    assert (sp.base.micro_batch, sp.base.accumulation) == (12, 2)  # the planner's 16 is not a divisor: the largest below
    assert sp.effective_batch == 48
    for micro in sp.micro_batches:
        c = sp.base.with_micro_batch(micro)
        assert c.micro_batch * c.accumulation * sp.world_size == 48
        assert c.config_values(2)["global_batch_size"] == 48


def test_without_a_global_batch_the_micro_batch_is_the_whole_step_and_the_note_says_how_to_go_larger():
    sp = space(per_process=16, global_batch_size=None)
    assert sp.micro_batches == (1, 2, 4, 8, 16) and sp.base.accumulation == 1
    assert any("at most 16 (no global_batch_size" in note for note in sp.notes)


def test_axis_options_start_with_the_runs_own_setting():
    gpu = space(per_process=16, workers=8, precision="bf16", on_cuda=True)
    assert gpu.workers == (8, 16, 0) and gpu.precisions == ("bf16", "fp16") and gpu.compile == (False, True)
    assert gpu.checkpointing == (False, True) and gpu.packing == (None,) and gpu.metric == "tokens/s"
    cpu = space(per_process=16, workers=0)
    assert cpu.workers == (0, 2) and cpu.precisions == ("fp32",) and cpu.compile == (False,)
    assert f"compile: {CPU_COMPILE_NOTE}" in cpu.notes
    t4 = space(per_process=16, precision="fp16", on_cuda=True)
    assert t4.precisions == ("fp16",) and "precision: fp16 is the only fast one here" in t4.notes
    lm = space(per_process=16, task="causal-lm", packing="auto", axes=AXES)  # packing only when --axes names it
    assert lm.packing == ("auto", False) and lm.base.describe().endswith("packing auto")
    assert space(per_process=16, task="causal-lm", packing=False, axes=AXES).packing == (False, "auto")
    default = space(per_process=16, task="causal-lm", packing="auto")
    assert default.packing == ("auto",) and any(n.startswith("packing: kept at the run's own (auto)") for n in default.notes)
    assert space(per_process=16, packing="auto").packing == (None,)  # classifiers have no packing


def test_keys_set_on_the_command_line_are_not_tuned():
    sp = space(per_process=32, start=8, fixed=frozenset({"per_device_train_batch_size", "dataloader_num_workers"}))
    assert sp.micro_batches == (8,) and (sp.base.micro_batch, sp.base.accumulation) == (8, 4)
    assert sp.workers == (0,)
    assert "micro_batch: kept at per_device_train_batch_size=8 (set on the command line)" in sp.notes
    narrowed = space(per_process=32, axes=("micro_batch",))
    assert narrowed.checkpointing == (False,) and "checkpointing: not tuned (--axes)" in narrowed.notes


def test_the_space_travels_as_json():
    sp = space(per_process=24, world=2, workers=4, precision="bf16", on_cuda=True, task="causal-lm", packing=False)
    again = CandidateSpace.from_dict(json.loads(json.dumps(sp.to_dict())))
    assert again == sp
    c = sp.base.with_micro_batch(6)
    assert Candidate.from_dict(json.loads(json.dumps(c.to_dict()))) == c and c.key == "mb6xga4|ckpt0|w4|bf16|compile0|packfalse"


def planned_t4(tmp_path: Path) -> Path:
    """A T4 plan for a BERT-large-shaped model (a config on disk: `config --model DIR`); runs name it with
    ``t4_model(tmp_path)``, so the plan's memory values are made for what they train."""
    from transformers import BertConfig

    BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
               vocab_size=30522).save_pretrained(tmp_path / "bert-large")
    assert main(["config", "--machine", "1x-t4", "--model", str(tmp_path / "bert-large"), "--seq-len", "512",
                 "--global-batch", "64", "--output", str(tmp_path / "t4")]) == 0
    return tmp_path / "t4.yaml"


def t4_model(tmp_path: Path) -> str:
    return f"model={tmp_path / 'bert-large'}"


def test_the_planner_prunes_exactly_what_it_says_does_not_fit(tmp_path):
    config = planned_t4(tmp_path)
    job = load_job(str(config), "scripts/finetune.py", [t4_model(tmp_path), "max_length=512", "global_batch_size=64"], {},
                   profile=load_machine("1x-t4"))
    plan = read_run_plan(tmp_path / "t4.plan.json", "test")
    verdicts = {v.lookup: v for v in job.space.verdicts}
    checkpointing = [False, "all", "selective", "every-2", "selective-lean"]  # off, then each policy (a transformers model)
    assert set(verdicts) == {(m, c, o, "fp16") for m in job.space.micro_batches for c in checkpointing for o in (False, True)}
    for (micro, policy, offloaded, _), v in verdicts.items():
        values = {"per_device_train_batch_size": micro, "gradient_checkpointing": bool(policy), "precision": "fp16"}
        levers = {"chunked_loss": False, "checkpoint_layers": policy or "all", "offload_activations": offloaded,
                  "optimizer_in_backward": False}
        check = check_memory(plan, values, world_size=1, seq_len=512, levers=levers)
        assert (v.fits, v.estimate_bytes) == (check.fits, check.estimate_bytes)
    largest = check_memory(plan, {"per_device_train_batch_size": 1, "gradient_checkpointing": False, "precision": "fp16"},
                           world_size=1, seq_len=512).largest_micro_batch
    assert [m for m in job.space.micro_batches if verdicts[(m, False, False, "fp16")].fits] == [m for m in job.space.micro_batches
                                                                                                 if m <= largest]
    assert any(not v.fits for v in verdicts.values()) and any(v.fits for v in verdicts.values())
    # each lever lets the planner allow more: selective above off, every layer above selective, offloading above each
    allowed = {c: max((m for (m, p, o, _), v in verdicts.items() if p == c and not o and v.fits), default=0) for c in checkpointing}
    assert allowed[False] < allowed["all"] and allowed[False] <= allowed["selective"] <= allowed["selective-lean"] <= allowed["all"]
    offloaded = max((m for (m, p, o, _), v in verdicts.items() if p == "all" and o and v.fits), default=0)
    assert offloaded >= allowed["all"]  # offloading keeps two layers' activations on the GPU: never less room


def test_tune_refuses_a_sharded_launch_config(tmp_path):
    import subprocess
    import sys

    import pytest

    from hf_gpu_train.tune.job import TuneError, load_job

    made = subprocess.run([sys.executable, "-m", "hf_gpu_train", "config", "--machine", "cpu-only", "--num-processes", "2",
                           "--strategy", "fsdp", "--output", str(tmp_path / "fsdp")], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    with pytest.raises(TuneError, match=r"shards the model \(cpu-fsdp\).*--strategy ddp"):
        load_job(str(tmp_path / "fsdp.yaml"), "scripts/finetune.py", [], {})


def test_a_run_that_steps_in_the_backward_gets_no_candidate_it_would_refuse():
    """optimizer_in_backward=true (the run's own, not an axis) refuses accumulation, torch.compile and fp16: those
    candidates are never tried (they ended as a failed trial), and the space keeps it through its JSON."""
    sp = space(per_process=16, start=16, optimizer_in_backward=True, on_cuda=True, precision="bf16")
    allowed = [c for micro in sp.micro_batches for c in (sp.base.with_micro_batch(micro),) if sp.planner_allows(c)]
    assert [(c.micro_batch, c.accumulation) for c in allowed] == [(16, 1)]
    assert not sp.planner_allows(replace(sp.base, torch_compile=True))
    assert not sp.planner_allows(replace(sp.base, precision="fp16"))
    assert CandidateSpace.from_dict(json.loads(json.dumps(sp.to_dict()))).optimizer_in_backward
    plain = space(per_process=16, start=16)
    assert all(plain.planner_allows(plain.base.with_micro_batch(m)) for m in plain.micro_batches)
