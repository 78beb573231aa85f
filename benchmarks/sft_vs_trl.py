"""Supervised fine-tuning, ours against TRL's ``SFTTrainer``: tokens/s, eval loss and peak memory, side by side.

Same model (the converted SmolLM2-135M-Instruct directory of ``model=builtin:smollm2``), same rows (the demo's
docstring chats, recipes/data/python_docs_chat), same LoRA (r, alpha, dropout, every linear layer but the head),
max_length, epochs, learning rate, linear schedule with 10% warm-up, weight decay and optimizer (fused AdamW: ours
sets it, transformers 5 defaults to it), same seed, same hardware, one process per arm. All from
recipes/smollm2_lora_demo.yaml, which is what ours runs, every other default of ours on (packing, completion-only loss,
telemetry, OOM recovery, evaluation and checkpoints on a timer, generation samples).

Arms:

- ``ours``: ``hf_gpu_train.finetune.run.finetune`` on the recipe (scripts/finetune.py's path, in-process);
- ``trl``: ``SFTTrainer`` with its defaults (no packing: examples padded per batch; loss on the full sequence,
  TRL's default for ``messages`` data; gradient checkpointing on), except the common settings above, and the batch:
  examples per step chosen so that it takes as many optimizer steps as ours (``ceil(rows / ours' steps)``), so both
  make the same number of updates of about the same number of tokens. On a CPU its precision is set to fp32, as an
  expert would on a CPU without bf16 units (TRL defaults to bf16: see ``trl-bf16``);
- ``trl-packing``: the same with ``packing=True`` (TRL's best-fit-decreasing packing into rows of max_length,
  padding-free batches flattened into one row with per-example position_ids), and ours' batch of 4 rows;
- ``trl-packing-nockpt``: the same with gradient checkpointing off (TRL's default is on), and on a GPU the base loaded in
  bf16 instead of TRL's fp32: what an expert does for a 135M model;
- ``trl-bf16`` (CPU only, ``--bf16-steps`` steps): TRL's defaults all the way, bf16 and batch 8 included (plus
  ``use_cpu=True``: without it transformers refuses bf16 on a machine without a GPU, so TRL's plain defaults do not
  start on a CPU at all), a reference line for the bf16 trap (torch's reference GEMM on a CPU without bf16 units), not
  part of the goals.

Measured per arm (benchmarks/sft_vs_trl_arm.py): real tokens (non-padding, counted from the rows each batch was made
of) per second of ``trainer.train()``, less the evaluations and checkpoints run inside it (loading, tokenizing and
packing are outside it); peak memory over ``train()`` (process RSS on the CPU, ``torch.cuda.max_memory_allocated`` on
a GPU). Then one common evaluation of every saved adapter: base model in fp32, the same 53 validation conversations
tokenized the same way, mean token cross-entropy on the assistant turns (answer + end-of-turn token, what ours trains
on) and on every token (what TRL's default trains on). The goals read the assistant-token loss.

Goals: ours >= 1.3x the tokens/s of ``trl``, >= 1.0x the best TRL arm with packing, at equal (within 0.01) or lower
assistant-token eval loss than each.

    python benchmarks/sft_vs_trl.py                       # one epoch, every arm (CPU: many minutes)
    python benchmarks/sft_vs_trl.py --rows 64 --steps 3   # quick: 64 train rows, 3 optimizer steps per arm
    python benchmarks/sft_vs_trl.py --json out.json       # also write every measure
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = "recipes/smollm2_lora_demo.yaml"
ARMS = ("ours", "trl", "trl-packing", "trl-packing-nockpt")
NAMES = {
    "ours": "ours (scripts/finetune.py)",
    "trl": "TRL SFTTrainer defaults",
    "trl-packing": "TRL packing=True",
    "trl-packing-nockpt": "TRL packing, no ckpt",
    "trl-bf16": "TRL all defaults (bf16)",
}
LOSS_TOLERANCE = 0.01
TRL_DEFAULT_BATCH = 8


def say(line: str = "") -> None:
    print(line, flush=True)


def plan(args) -> dict:
    """Settings from the recipe, the rows, and the step arithmetic that matches TRL's batch to ours."""
    from transformers import AutoTokenizer

    from hf_gpu_train.finetune.causal_lm import smollm2
    from hf_gpu_train.finetune.causal_lm.packing import best_fit_decreasing
    from hf_gpu_train.finetune.config import load_config_and_keys

    cfg, _ = load_config_and_keys(args.recipe, [])
    model_path = str(smollm2.ensure_converted(say)) if cfg.model == smollm2.BUILTIN_NAME else cfg.model
    rows = [json.loads(line) for line in Path(cfg.train_file).read_text().splitlines() if line.strip()]
    rows = rows[:args.rows] if args.rows else rows
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    lengths = [min(cfg.max_length, len(tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])) for r in rows]
    packed_rows = len(best_fit_decreasing(lengths, cfg.max_length))
    ours_steps = math.ceil(packed_rows / cfg.per_device_train_batch_size) * math.ceil(cfg.num_train_epochs)
    epoch_steps = math.ceil(packed_rows / cfg.per_device_train_batch_size)
    trl_batch = math.ceil(len(rows) / epoch_steps)
    return {"cfg": cfg, "model_path": model_path, "rows": rows, "tokens_per_epoch": sum(lengths),
            "packed_rows": packed_rows, "ours_steps": ours_steps, "trl_batch": trl_batch}


def trl_settings(p: dict, args, arm: str) -> dict:
    cfg = p["cfg"]
    common = dict(seed=cfg.seed, num_train_epochs=cfg.num_train_epochs, max_steps=args.steps or -1,
                  learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler_type, warmup_ratio=cfg.warmup_ratio,
                  weight_decay=cfg.weight_decay, max_length=cfg.max_length, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                  lora_dropout=cfg.lora_dropout, lora_target_modules=cfg.lora_target_modules, batch=p["trl_batch"], options={})
    if arm == "trl-packing":
        common.update(batch=cfg.per_device_train_batch_size, options={"packing": True})
    elif arm == "trl-packing-nockpt":
        common.update(batch=cfg.per_device_train_batch_size, options={"packing": True, "gradient_checkpointing": False},
                      model_dtype="bfloat16")
    elif arm == "trl-bf16":
        common.update(batch=TRL_DEFAULT_BATCH, max_steps=args.bf16_steps, options={"bf16": True})
    return common


def run_spec(spec: dict, work: Path, name: str) -> dict:
    spec_file, log = work / f"{name}.spec.json", work / f"{name}.log"
    spec["result"] = str(work / f"{name}.result.json")
    spec_file.write_text(json.dumps(spec, indent=2))
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sft_vs_trl_arm.py"), str(spec_file)],
                              cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = log.read_text().splitlines()[-40:]
        raise SystemExit(f"{name} failed (exit {code}); the end of {log}:\n" + "\n".join(tail))
    result = json.loads(Path(spec["result"]).read_text())
    result["process_seconds"] = time.perf_counter() - start
    return result


def train_spec(p: dict, args, arm: str, work: Path, train_file: Path, tag: str) -> dict:
    out = work / tag
    spec = {"mode": "train", "arm": arm.replace("trl-bf16", "trl"), "out": str(out), "model_path": p["model_path"],
            "train_file": str(train_file), "validation_file": str(p["cfg"].validation_file), "recipe": args.recipe}
    if arm == "ours":
        overrides = [f"output_dir={out}", f"train_file={train_file}", "generation_samples=0"]  # generation: outside train()
        if args.steps:
            overrides.append(f"max_steps={args.steps}")
        spec["ours_overrides"] = overrides
    else:
        spec["trl"] = trl_settings(p, args, arm)
    return spec


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def report(runs: dict, bf16: dict | None, evaluation: dict, on_cuda: bool, bf16_steps: int) -> list[str]:
    """The table and the goals, from the arms' results and the common evaluation."""
    arms = list(runs)
    losses = evaluation["results"]
    rate_key = "steady_tokens_per_second" if on_cuda else "tokens_per_second"  # a GPU run is short: warm-up would dominate

    def median(arm, key):
        values = [run[key] for run in runs[arm] if run.get(key) is not None]
        return statistics.median(values) if values else None

    def eval_loss(arm, key="eval_loss_assistant"):
        return statistics.median(losses[f"{arm}-r{i}"][key] for i in range(len(runs[arm])))

    rate = {arm: median(arm, rate_key) or median(arm, "tokens_per_second") for arm in arms}
    trl_arms = [a for a in arms if a.startswith("trl")]
    packing_arms = [a for a in arms if a.startswith("trl-packing")]
    best = max(packing_arms, key=lambda a: rate[a]) if packing_arms else None
    memory_key, memory_name = ("cuda_peak_allocated", "CUDA peak MiB") if on_cuda else ("peak_rss_train", "peak RSS MiB")
    lines = [f"{'arm':<28} {'tok/s':>8} {'steady':>8} {'vs TRL':>7} {'vs best':>7} {'eval asst':>9} {'eval all':>9} "
             f"{memory_name:>13} {'steps':>5} {'train s':>8}"]
    base = losses["base"]
    lines.append(f"{'base model (no training)':<28} {'':>8} {'':>8} {'':>7} {'':>7} {base['eval_loss_assistant']:>9.4f} "
                 f"{base['eval_loss_all']:>9.4f}")
    for arm in arms:
        vs_trl = f"{rate[arm] / rate['trl']:.2f}x" if "trl" in rate else "-"
        vs_best = f"{rate[arm] / rate[best]:.2f}x" if best else "-"
        steady = median(arm, "steady_tokens_per_second")
        lines.append(f"{NAMES[arm]:<28} {median(arm, 'tokens_per_second'):>8.1f} {'-' if steady is None else f'{steady:.1f}':>8} "
                     f"{vs_trl:>7} {vs_best:>7} {eval_loss(arm):>9.4f} {eval_loss(arm, 'eval_loss_all'):>9.4f} "
                     f"{mib(median(arm, memory_key)):>13} {runs[arm][0]['optimizer_steps']:>5} {median(arm, 'train_seconds'):>8.1f}")
    if bf16 is not None:
        vs_trl = f"{bf16['tokens_per_second'] / rate['trl']:.2f}x" if "trl" in rate else "-"
        lines.append(f"{NAMES['trl-bf16']:<28} {bf16['tokens_per_second']:>8.1f} {'-':>8} {vs_trl:>7} {'':>7} {'-':>9} {'-':>9} "
                     f"{mib(bf16['peak_rss_train']):>13} {bf16['optimizer_steps']:>5} {bf16['train_seconds']:>8.1f}")
        lines.append(f"  (TRL's defaults all the way, bf16 and batch {TRL_DEFAULT_BATCH} included, for {bf16_steps} steps only: "
                     "not trained to the end, so no eval loss"
                     + (f"; ours runs {rate['ours'] / bf16['tokens_per_second']:.1f}x its tokens/s)" if "ours" in rate else ")"))
    lines.append(f"tok/s: real (non-padding) tokens per second of trainer.train(), in-loop evaluation and checkpoints excluded; "
                 "steady: the same without the first optimizer step. vs TRL / vs best: "
                 f"{'steady' if rate_key.startswith('steady') else 'tok/s'} against TRL's defaults / against the faster TRL "
                 "packing arm. eval asst / eval all: one common evaluation (fp32 base + each adapter, the same "
                 f"{evaluation['validation_rows']} validation conversations): mean token cross-entropy on the assistant "
                 "turns / on every token. Peak memory over trainer.train()"
                 + (" (torch.cuda.max_memory_allocated)." if on_cuda else " (process RSS, sampled every 20 ms)."))
    if "ours" in arms:
        lines.append(f"ours' own eval_loss (packed validation, assistant tokens): {median('ours', 'own_eval_loss'):.4f}; "
                     f"the common evaluation's: {eval_loss('ours'):.4f}")
    if "ours" in arms and "trl" in arms and best:
        ours_loss = eval_loss("ours")
        checks = [("tokens/s >= 1.3x TRL defaults", rate["ours"] / rate["trl"] >= 1.3, f"{rate['ours'] / rate['trl']:.2f}x"),
                  (f"tokens/s >= 1.0x TRL's best ({NAMES[best]})", rate["ours"] / rate[best] >= 1.0,
                   f"{rate['ours'] / rate[best]:.2f}x")]
        for arm in trl_arms:
            other = eval_loss(arm)
            checks.append((f"assistant eval loss <= {NAMES[arm]} (+{LOSS_TOLERANCE})", ours_loss <= other + LOSS_TOLERANCE,
                           f"{ours_loss:.4f} vs {other:.4f}"))
        lines.append("goals:")
        lines += [f"  {'MET   ' if met else 'MISSED'} {what}: {figure}" for what, met, figure in checks]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=RECIPE, help="ours' recipe; its settings are every arm's (default %(default)s)")
    parser.add_argument("--rows", type=int, default=0, help="the first N train rows only (default: all)")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per arm (default: one epoch, as the recipe)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every arm, the order alternating (default 1)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    parser.add_argument("--bf16-steps", type=int, default=2,
                        help="CPU only: steps of TRL's all-defaults bf16 line (0: skip it; default 2: it is ~20x slower)")
    parser.add_argument("--json", help="write every measure here")
    parser.add_argument("--keep", help="keep the runs (adapters, logs) in this directory instead of a temporary one")
    args = parser.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}: choose from {', '.join(ARMS)}")

    import torch

    on_cuda = torch.cuda.is_available()
    started = time.perf_counter()
    p = plan(args)
    cfg = p["cfg"]
    device = torch.cuda.get_device_name(0) if on_cuda else f"CPU, {os.cpu_count()} cores"
    say(f"SmolLM2-135M-Instruct + LoRA r{cfg.lora_r}/alpha {cfg.lora_alpha} (all linear), {len(p['rows'])} train rows "
        f"({p['tokens_per_epoch']} tokens an epoch; ours packs them into {p['packed_rows']} rows of up to {cfg.max_length}), "
        f"lr {cfg.learning_rate:g} linear, warm-up {cfg.warmup_ratio:g}, weight decay {cfg.weight_decay:g}, "
        + (f"{args.steps} optimizer steps per arm" if args.steps else f"{cfg.num_train_epochs:g} epoch ({p['ours_steps']} steps)"))
    say(f"batches: ours {cfg.per_device_train_batch_size} packed rows; TRL defaults {p['trl_batch']} examples (as many steps "
        f"as ours); TRL packing {cfg.per_device_train_batch_size} rows of {cfg.max_length}. Device: {device}, "
        f"{'bf16' if on_cuda else 'fp32'} for every arm; load average at start {os.getloadavg()[0]:.2f}")
    temporary = None if args.keep else tempfile.TemporaryDirectory(prefix="sft_vs_trl_")
    work = Path(args.keep) if args.keep else Path(temporary.name)
    work.mkdir(parents=True, exist_ok=True)
    try:
        train_file = work / "train.jsonl"
        train_file.write_text("".join(json.dumps(r) + "\n" for r in p["rows"]))
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        for r in range(args.rounds):
            for arm in (arms if r % 2 == 0 else list(reversed(arms))):
                tag = f"{arm}-r{r}"
                result = run_spec(train_spec(p, args, arm, work, train_file, tag), work, tag)
                runs[arm].append(result)
                say(f"  round {r + 1}, {NAMES[arm]}: {result['tokens']} tokens in {result['train_seconds']:.1f} s of training "
                    f"({result['optimizer_steps']} steps; {result['process_seconds']:.0f} s for the whole process; load average "
                    f"{result['load_average_1min'][0]:.1f} -> {result['load_average_1min'][1]:.1f})")
        bf16 = None
        if not on_cuda and args.bf16_steps > 0:
            try:
                bf16 = run_spec(train_spec(p, args, "trl-bf16", work, train_file, "trl-bf16"), work, "trl-bf16")
            except SystemExit as failure:  # a reference line only: the table goes on without it
                say(f"  {NAMES['trl-bf16']}: {failure}")
        if bf16 is not None:
            say(f"  {NAMES['trl-bf16']}: {bf16['tokens']} tokens in {bf16['train_seconds']:.1f} s ({bf16['optimizer_steps']} steps)")
        adapters = {f"{arm}-r{i}": run["adapter"] for arm, rs in runs.items() for i, run in enumerate(rs)}
        evaluation = run_spec({"mode": "eval", "model_path": p["model_path"], "validation_file": str(cfg.validation_file),
                               "max_length": cfg.max_length, "adapters": adapters}, work, "common-eval")
    finally:
        if temporary is not None:
            temporary.cleanup()
    say()
    for line in report(runs, bf16, evaluation, on_cuda, args.bf16_steps):
        say(line)
    say(f"load average at end {os.getloadavg()[0]:.2f}; whole benchmark {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "trl_bf16": bf16, "common_eval": evaluation,
                                               "plan": {k: v for k, v in p.items() if k not in ("cfg", "rows")},
                                               "rows": len(p["rows"]), "steps": args.steps, "device": device}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
