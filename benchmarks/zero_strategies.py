"""DeepSpeed ZeRO beside DDP and FSDP on the same 2-process CPU run (issue 31): steps/s and peak RSS per rank of the
same causal-LM full fine-tune under each strategy, launched with the config `hf-gpu-train config --strategy S` writes
(DeepSpeed on its CPU accelerator, gloo), and how far each run's losses and final weights are from one process's.

    python benchmarks/zero_strategies.py [--steps 8] [--layers 8] [--hidden 768] [--offload]

The model: a randomly initialised Llama (``--layers`` x ``--hidden``, ~55M parameters at the defaults, fp32: 4 bytes
of weights, 4 of gradients and 8 of AdamW state per parameter, ~880 MB of training state) on chat rows packed to 160
tokens, 4 rows a step over every process. Each rank holds: under DDP the whole state (and DDP's gradient buckets);
under FSDP (resharded after forward) and ZeRO-3 half of it; under ZeRO-2 the whole weights and half of the gradients
and optimizer state. The private memory after a step (USS, the largest over the steps, freed memory given back to the system first:
glibc's ``malloc_trim``) is the state as a rank holds it, beside Python,
torch and the data (~1 GiB per process); the peak RSS includes loading, where every rank reads the whole checkpoint
before any strategy shards it. Timings on this 2-core machine are noisy, the arms run one after another:
compare ratios, not absolute figures. ``--offload``: ZeRO-2 and ZeRO-3 with the optimizer on DeepSpeed's CPU Adam too
(the first run compiles it: its time is not a figure).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gloo_launch import ROOT, cpu_config, launch

sys.path.insert(0, str(ROOT))

ARM = ROOT / "benchmarks" / "zero_strategies_arm.py"
STRATEGIES = ("ddp", "fsdp", "deepspeed-zero2", "deepspeed-zero3")


def make_case(folder: Path, layers: int, hidden: int) -> list[str]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.finetune.tasks.language_modeling.tiny import chat_rows, tiny_tokenizer, write_jsonl

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    print(f"model: Llama {layers} x {hidden}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    return [f"model={folder / 'model'}", f"train_file={write_jsonl(folder / 'train.jsonl', chat_rows(96))}",
            f"validation_file={write_jsonl(folder / 'validation.jsonl', chat_rows(8, offset=200))}", "task=causal-lm",
            "method=full", "max_length=160", "learning_rate=1e-4", "warmup_ratio=0", "logging_steps=1", "generation_samples=0",
            "extra={adam_epsilon: 1.0e-6}", "global_batch_size=4", "eval_strategy=no", "save_strategy=no",
            "evaluate_before=false", "telemetry=false", "max_eval_samples=4"]


def strategy_config(folder: Path, strategy: str) -> str:
    return cpu_config(folder) if strategy == "ddp" else cpu_config(folder, 2, strategy)


def history(out: Path, key: str) -> list[float]:
    return [h[key] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if key in h and "step" in h]


def largest_difference(out: Path, reference: Path) -> tuple[float, float]:
    """(max relative loss difference over the steps, max absolute weight difference) against one process."""
    from safetensors.torch import load_file

    losses = max(abs(a - b) / abs(b) for a, b in zip(history(out, "loss"), history(reference, "loss"), strict=True))
    got, expected = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    return losses, max((got[k].float() - expected[k].float()).abs().max().item() for k in expected)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--offload", action="store_true", help="ZeRO-2 and ZeRO-3 with the optimizer offloaded (DeepSpeed's CPU Adam) too")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="deepspeed-bench-"))
    case = [*make_case(tmp, args.layers, args.hidden), f"max_steps={args.steps}"]
    one = tmp / "one"
    started = time.monotonic()
    run = subprocess.run([sys.executable, str(ARM), str(tmp / "figures-one"), *case, "per_device_train_batch_size=4",
                          f"output_dir={one}"], capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        raise SystemExit(run.stderr[-3000:])
    rows = [("one process", json.loads((tmp / "figures-one" / "rank0.json").read_text()), None)]
    print(f"one process: {time.monotonic() - started:.0f} s", flush=True)
    strategies = STRATEGIES + (("deepspeed-zero2-offload", "deepspeed-zero3-offload") if args.offload else ())
    for strategy in strategies:
        out, figures = tmp / strategy / "out", tmp / strategy / "figures"
        (tmp / strategy).mkdir()
        started = time.monotonic()
        run = launch(strategy_config(tmp / strategy, strategy), str(ARM), str(figures), *case, "per_device_train_batch_size=2",
                     f"output_dir={out}")
        if run.returncode != 0:
            raise SystemExit(f"{strategy}: {run.stderr[-3000:]}")
        ranks = [json.loads((figures / f"rank{r}.json").read_text()) for r in (0, 1)]
        rows.append((strategy, {**ranks[0], **{key: max(r[key] for r in ranks) for key in ("peak_rss_bytes", "step_rss_bytes")}},
                     largest_difference(out, one)))
        print(f"{strategy}: {time.monotonic() - started:.0f} s", flush=True)
    base = next(r for name, r, _ in rows if name == "ddp")
    print(f"\n{args.steps} steps, 4 packed rows of 160 tokens a step (2 a process), fp32, 2 CPU processes of 1 thread each\n")
    print("| strategy | steps/s | vs DDP | private memory after a step (larger rank) | vs DDP | peak RSS, loading included | "
          "loss vs one process (max rel.) | weights vs one process (max abs.) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r, diff in rows:
        speed = r["steps"] / r["train_seconds"]
        alone = name == "one process"
        versus = "-" if alone else f"{speed / (base['steps'] / base['train_seconds']):.2f}x"
        step_rss = f"{r['step_rss_bytes'] / 2**30:.2f} GiB"
        rss_versus = "-" if alone else f"{r['step_rss_bytes'] / base['step_rss_bytes']:.2f}x"
        differences = f"{diff[0]:.1e} | {diff[1]:.1e}" if diff else "- | -"
        print(f"| {name} | {speed:.2f} | {versus} | {step_rss} | {rss_versus} | {r['peak_rss_bytes'] / 2**30:.2f} GiB | {differences} |",
              flush=True)


if __name__ == "__main__":
    main()
