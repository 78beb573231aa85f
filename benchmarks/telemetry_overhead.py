"""Telemetry as shipped vs no telemetry: the same ``scripts/finetune.py`` run, alternating, side by side.

Both arms run the real ``hf_gpu_train.finetune.run.finetune`` with every default (MiniLM on builtin:text, pinned as when its figures
were measured, OOM recovery on, the Trainer arguments the factory sets when telemetry is on); the only
difference is ``telemetry=true`` / ``telemetry=false``. On a machine without a GPU the telemetry
samples a fake NVML GPU (``FakeNvmlBackend`` from the shipped ``1x-h200`` snapshot) every second, so
the sampler thread and its per-log work are measured too; on a GPU it samples the real one.

Prints steps/s of each run (the Trainer's own ``train_steps_per_second``, which excludes the report
written at train end), the median ratio with / without and the spread of the per-round ratios.
Goal: >= 0.99. Run it on a quiet machine: a busy 2-core box swings more than the overhead.

    python benchmarks/telemetry_overhead.py [--rounds 5] [--steps 60] [--logging-steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAKE_MACHINE = "1x-h200"


def build(out: str, steps: int, logging_steps: int, on_cuda: bool):
    """A plain MiniLM Trainer without any hf_gpu_train callback (used by the overhead benchmarks)."""
    import torch
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    from hf_gpu_train.finetune.builtin import minilm_path, text_dataset

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    data = text_dataset()["train"].map(lambda b: tokenizer(b["text"], truncation=True, max_length=64), batched=True)
    data = data.map(lambda b: {"labels": [int(x == "positive") for x in b["label"]]}, batched=True).remove_columns(["text", "label"])
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=2)
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=32, logging_steps=logging_steps,
                             report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=not on_cuda,
                             bf16=on_cuda and torch.cuda.is_bf16_supported(including_emulation=False), seed=0)
    return Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorWithPadding(tokenizer))


def shipped_run(out: str, steps: int, logging_steps: int, telemetry: bool) -> tuple[float, object]:
    """One ``finetune()`` run as ``scripts/finetune.py`` does it; (train steps/s, the telemetry callback or None)."""
    import torch
    from transformers import Trainer

    from hf_gpu_train.callbacks import TelemetryCallback
    from hf_gpu_train.finetune.loading import load_config
    from hf_gpu_train.finetune.run import finetune

    seen: dict = {}
    fake = None
    if not torch.cuda.is_available():
        from hf_gpu_train.hardware.fake import FakeNvmlBackend
        from hf_gpu_train.hardware.snapshot import load_machine

        # a busy GPU (97% utilization, 600 W of 700 W) so the verdict code takes its usual path, not the idle one
        fake = FakeNvmlBackend(load_machine(FAKE_MACHINE), series={"utilization_pct": [(97, 60)], "power_usage_mw": [600_000],
                                                                   "memory_info_used": [60 * 2**30]})

    class Measured(Trainer):
        """The shipped Trainer; it only notes train()'s speed and, on a CPU, points telemetry at the fake GPU."""

        def add_callback(self, callback):
            if isinstance(callback, TelemetryCallback):
                seen["telemetry"] = callback
                if fake is not None:
                    callback.backend, callback.gpu_indices = fake, [0]
            return super().add_callback(callback)

        def train(self, *args, **kwargs):
            result = super().train(*args, **kwargs)
            seen["steps_per_s"] = result.metrics["train_steps_per_second"]
            return result

    cfg = load_config(None, [f"output_dir={out}", f"max_steps={steps}", f"logging_steps={logging_steps}",
                             f"telemetry={'true' if telemetry else 'false'}", "max_eval_samples=64",
                             "dataset=builtin:text", "learning_rate=5e-5", "evaluate_before=false"])  # as when measured (docs)
    finetune(cfg, trainer_class=Measured)
    return seen["steps_per_s"], seen.get("telemetry")


def measure(rounds: int, steps: int, logging_steps: int) -> tuple[list[float], list[float], object]:
    """(steps/s without, steps/s with, the last telemetry callback); arms alternate, order flipped each round."""
    plain, with_telemetry, last = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        shipped_run(f"{tmp}/warmup", min(steps, 5), logging_steps, telemetry=False)  # caches, allocator, kernels
        for r in range(rounds):
            for use in ((False, True) if r % 2 == 0 else (True, False)):
                speed, callback = shipped_run(f"{tmp}/{r}{'on' if use else 'off'}", steps, logging_steps, telemetry=use)
                (with_telemetry if use else plain).append(speed)
                last = callback or last
    return plain, with_telemetry, last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--logging-steps", type=int, default=10)
    args = parser.parse_args()
    import torch

    plain, telemetry, callback = measure(args.rounds, args.steps, args.logging_steps)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, fake NVML {FAKE_MACHINE} sampled every 1 s"
    ratios = [t / p for t, p in zip(telemetry, plain)]
    print(f"\nscripts/finetune.py defaults (MiniLM, built-in text), {args.steps} steps x {args.rounds} rounds alternating, "
          f"logging every {args.logging_steps}; {device}")
    print(f"steps/s without telemetry: {', '.join(f'{x:.3f}' for x in plain)} (median {statistics.median(plain):.3f})")
    print(f"steps/s with telemetry:    {', '.join(f'{x:.3f}' for x in telemetry)} (median {statistics.median(telemetry):.3f})")
    ratio = statistics.median(telemetry) / statistics.median(plain)
    print(f"ratio (with / without): {ratio:.3f}; per round {min(ratios):.3f} .. {max(ratios):.3f} "
          f"(goal >= 0.99: {'met' if ratio >= 0.99 else 'NOT met'})")
    if callback is not None and callback.last_verdict is not None:
        mfu = [r["metrics"].get("loop/mfu_pct") for r in callback.records if r["metrics"].get("loop/mfu_pct")]
        print(f"last verdict: {callback.last_verdict.line()}")
        print(f"MFU: {statistics.median(mfu):.1f}%" if mfu else "MFU: n/a (CPU or unknown GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
