"""One prepared check for a real GPU machine: run it there, read the figures it prints.

    python scripts/gpu_check.py

1. ``hf-gpu-train detect`` against ``nvidia-smi --query-gpu`` and ``nvidia-smi topo -m``: every mismatch.
2. ``hf-gpu-train doctor`` (live, with the small win on each GPU): every check.
3. A 100-step fine-tune of the text recipe on each visible GPU (bf16 where supported), samples/s.
4. Telemetry on the real GPU: the verdict, MFU, and the overhead ratio (with / without callbacks).
5. A real OOM (a batch 4x what the memory planner says fits) recovered in place: the micro-batch chosen
   and the time the recovery took.
Exit 0 when detection agrees with nvidia-smi and the doctor found no FAIL.
"""

from __future__ import annotations

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
            cmd = [sys.executable, str(root / "scripts/finetune.py"), "--config", str(root / "recipes/minilm_text_demo.yaml"),
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
    plain, telemetry, callback = measure(rounds=3, steps=60, logging_steps=10)
    ratio = statistics.median(telemetry) / statistics.median(plain)
    print(f"steps/s without {statistics.median(plain):.2f}, with {statistics.median(telemetry):.2f}: overhead ratio {ratio:.3f}")
    if callback is not None and callback.last_verdict is not None:
        last = callback.records[-2]["metrics"] if len(callback.records) > 1 else callback.records[-1]["metrics"]
        print(f"verdict: {callback.last_verdict.line()}")
        print("MFU: " + (f"{last['train/mfu_pct']:.1f}%" if "train/mfu_pct" in last else "n/a")
              + ", " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(last.items()) if k.startswith(("gpu", "torch/"))))
    return ratio >= 0.97


def check_real_oom(precision: str = "bf16") -> bool:
    import torch
    from transformers import AutoModelForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

    from hf_gpu_train.finetune.builtin import minilm_path
    from hf_gpu_train.launch.memory import TrainingShape, largest_micro_batch
    from hf_gpu_train.launch.model_spec import from_hf_config
    from hf_gpu_train.training import enable_oom_recovery

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


def main() -> int:
    results = {"detection": check_detection(), "doctor": check_doctor(), "finetune": check_finetune_per_gpu(),
               "telemetry": check_telemetry(), "oom": check_real_oom("bf16"), "oom_fp16": check_real_oom("fp16")}
    section("summary")
    for name, ok in results.items():
        print(f"{name}: {'OK' if ok else 'FAILED'}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
