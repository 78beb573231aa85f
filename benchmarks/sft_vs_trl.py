"""Supervised fine-tuning, ours against TRL's ``SFTTrainer``: tokens/s, eval loss and peak memory, side by side.

Same model (the converted SmolLM2-135M-Instruct directory of ``model=builtin:smollm2``), same rows (the demo's
docstring chats, hf_gpu_train/finetune/recipes/data/python_docs_chat), same LoRA (r, alpha, dropout, every linear layer but the head),
max_length, epochs, learning rate, linear schedule with 10% warm-up, weight decay and optimizer (fused AdamW: ours
sets it, transformers 5 defaults to it), same seed, same hardware, one process per arm. All from
the shipped recipe smollm2_lora_demo, which is what ours runs, every other default of ours on (packing, completion-only loss,
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
- ``trl-lean`` (CUDA): TRL's leanest: its fused LM head (always on in TRL 1.16), packing, gradient checkpointing and
  ``activation_offloading=True``. On a CPU TRL's offloading does not start (it makes CUDA streams: "CUDA driver version
  is insufficient"), so there ``trl-packing`` (fused head, packing, checkpointing) is TRL's leanest arm;
- ``ours-lean``: ours with the memory levers ``hf-gpu-train tune`` picks: after the TRL arms, tune measures the job
  (`hf-gpu-train config --num-processes 1`, then `hf-gpu-train tune --memory-budget-gib B`, B = ``--lean-fraction`` x
  the peak of TRL's leanest arm) and writes its winner into the plan; the arm runs with that plan, as a user would
  (`HF_GPU_TRAIN_PLAN`: the tuned values apply to this very job);
- ``trl-bf16`` (CPU only, ``--bf16-steps`` steps): TRL's defaults all the way, bf16 and batch 8 included (plus
  ``use_cpu=True``: without it transformers refuses bf16 on a machine without a GPU, so TRL's plain defaults do not
  start on a CPU at all), a reference line for the bf16 trap (torch's reference GEMM on a CPU without bf16 units), not
  part of the goals.

Measured per arm (benchmarks/sft_vs_trl_arm.py): real tokens (non-padding, counted from the rows each batch was made
of) per second of ``trainer.train()``, less the evaluations and checkpoints run inside it (loading, tokenizing and
packing are outside it); peak memory over ``train()`` (process RSS on the CPU, ``torch.cuda.max_memory_reserved`` on
a GPU). Then one common evaluation of every saved adapter: base model in fp32, the same 53 validation conversations
tokenized the same way, mean token cross-entropy on the assistant turns (answer + end-of-turn token, what ours trains
on) and on every token (what TRL's default trains on). The goals read the assistant-token loss.

Goals: ours >= 1.3x the tokens/s of ``trl``, >= 1.0x the best TRL arm with packing, at equal (within 0.01) or lower
assistant-token eval loss than each. Issue 19's: ``ours-lean`` >= 1.3x the tokens/s of TRL's fastest arm while its peak
memory is <= 0.75x TRL's leanest arm's, both at once, with its assistant-token eval loss within 0.02 of ours' (the
levers are exact) and no more than 0.02 above any TRL arm's.

    python benchmarks/sft_vs_trl.py                       # one epoch, every arm (CPU: many minutes)
    python benchmarks/sft_vs_trl.py --rows 64 --steps 3   # quick: 64 train rows, 3 optimizer steps per arm
    python benchmarks/sft_vs_trl.py --json out.json       # also write every measure
    python benchmarks/sft_vs_trl.py --rows 160 --max-length 1024 --rows-per-step 2   # issue 19's setting
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

RECIPE = "smollm2_lora_demo"  # a shipped recipe's name, or a file
ARMS = ("ours", "trl", "trl-packing", "trl-packing-nockpt", "trl-lean", "ours-lean")
NAMES = {
    "ours": "ours (scripts/finetune.py)",
    "trl": "TRL SFTTrainer defaults",
    "trl-packing": "TRL packing=True",
    "trl-packing-nockpt": "TRL packing, no ckpt",
    "trl-lean": "TRL lean (+ offloading)",
    "ours-lean": "ours, levers tune picks",
    "trl-bf16": "TRL all defaults (bf16)",
}
LOSS_TOLERANCE = 0.01
LEAN_LOSS_TOLERANCE = 0.02
LEAN_SPEED, LEAN_MEMORY = 1.3, 0.75  # issue 19: ours-lean's speed over TRL's fastest, peak over TRL's leanest
TRL_DEFAULT_BATCH = 8


def say(line: str = "") -> None:
    print(line, flush=True)


def plan(args) -> dict:
    """Settings from the recipe, the rows, and the step arithmetic that matches TRL's batch to ours."""
    from transformers import AutoTokenizer

    from hf_gpu_train.finetune.loading import load_config_and_keys
    from hf_gpu_train.finetune.tasks.language_modeling import smollm2
    from hf_gpu_train.finetune.tasks.language_modeling.packing import best_fit_decreasing

    cfg, _ = load_config_and_keys(args.recipe, args.recipe_files + shape_overrides(args) + ours_micro_batch(args))
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


def shape_overrides(args) -> list[str]:
    """The recipe's max_length and rows per step, as the command line sets them: the rows per step as the global batch
    (what the job is), so tune may still choose the micro-batch that makes it up."""
    return ([f"max_length={args.max_length}"] if args.max_length else []) + (
        [f"global_batch_size={args.rows_per_step}"] if args.rows_per_step else [])


def ours_micro_batch(args) -> list[str]:
    """ours' default arm: the whole step in one micro-batch (the recipe's micro-batch may be larger than the step)."""
    return [f"per_device_train_batch_size={args.rows_per_step}"] if args.rows_per_step else []


def trl_settings(p: dict, args, arm: str) -> dict:
    cfg = p["cfg"]
    common = dict(seed=cfg.seed, num_train_epochs=cfg.num_train_epochs, max_steps=args.steps or -1,
                  learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler_type, warmup_ratio=cfg.warmup_ratio,
                  weight_decay=cfg.weight_decay, max_length=cfg.max_length, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                  lora_dropout=cfg.lora_dropout, lora_target_modules=cfg.lora_target_modules, batch=p["trl_batch"], options={})
    if arm == "trl-packing":
        common.update(batch=cfg.per_device_train_batch_size, options={"packing": True})
    elif arm == "trl-lean":  # TRL's fused LM head is always on; packing, checkpointing and offloading are options
        common.update(batch=cfg.per_device_train_batch_size, options={"packing": True, "activation_offloading": True})
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


def ours_job(args, train_file: Path) -> list[str]:
    """ours' key=value for the recipe: what the job is (the same for ours, ours-lean and tune), without output_dir."""
    overrides = [*args.recipe_files, f"train_file={train_file}", "generation_samples=0", *shape_overrides(args)]  # generation: outside train()
    return overrides + ([f"max_steps={args.steps}"] if args.steps else [])


def train_spec(p: dict, args, arm: str, work: Path, train_file: Path, tag: str, plan_file: Path | None = None) -> dict:
    out = work / tag
    spec = {"mode": "train", "arm": arm.replace("trl-bf16", "trl"), "out": str(out), "model_path": p["model_path"],
            "train_file": str(train_file), "validation_file": str(p["cfg"].validation_file), "recipe": args.recipe}
    if arm.startswith("ours"):
        micro = ours_micro_batch(args) if arm == "ours" else []  # ours-lean: the micro-batch tune measured
        spec["ours_overrides"] = [*ours_job(args, train_file), *micro, f"output_dir={out}"]
        if plan_file is not None:  # ours-lean: the plan tune wrote, applied by the run itself
            spec["plan_file"] = str(plan_file)
    else:
        spec["trl"] = trl_settings(p, args, arm)
    return spec


def tune_levers(args, work: Path, train_file: Path, budget_bytes: int) -> tuple[Path, list[str]]:
    """`hf-gpu-train config` for one process here, then `hf-gpu-train tune` on ours' job under the memory budget: the
    plan file it wrote its winner into, and its table and reasons."""
    box = work / "box"
    hf = [sys.executable, "-m", "hf_gpu_train"]
    made = subprocess.run([*hf, "config", "--num-processes", "1", "--output", str(box), "--force"], cwd=ROOT,
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise SystemExit(f"hf-gpu-train config failed:\n{made.stdout[-2000:]}{made.stderr[-2000:]}")
    command = [*hf, "tune", "--fresh", "--budget-s", str(args.tune_budget_s), "--memory-budget-gib", f"{budget_bytes / 2**30:.3f}",
               "--config-file", str(box.with_suffix(".yaml")), "scripts/finetune.py", "--config", args.recipe,
               *ours_job(args, train_file)]
    start = time.perf_counter()
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    table = [line for line in lines if line[:1].isdigit() or line.startswith(("#  ", "-  "))]
    shown = [line for line in lines if line.startswith(("hf-gpu-train tune: fastest", "hf-gpu-train tune: not eligible",
                                                         "hf-gpu-train tune: next", "hf-gpu-train tune: no candidate"))]
    head = f"tune under {budget_bytes / 2**20:,.0f} MiB: {time.perf_counter() - start:.0f} s"
    if run.returncode == 1 and any("no candidate" in line for line in shown):
        return None, [head, *table, *shown]  # nothing fits the budget: ours-lean does not run, the goal is missed
    if run.returncode != 0:
        raise SystemExit(f"hf-gpu-train tune failed (exit {run.returncode}):\n" + "\n".join(lines[-30:]) + run.stderr[-3000:])
    return box.with_suffix(".plan.json"), [head, *table, *shown]


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
    memory_key, memory_name = ("cuda_peak_reserved", "CUDA reserved MiB") if on_cuda else ("peak_rss_train", "peak RSS MiB")
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
                 + (" (torch.cuda.max_memory_reserved)." if on_cuda else " (process RSS, sampled every 20 ms)."))
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
    if "ours-lean" in arms and trl_arms:
        lines += lean_goals(arms, trl_arms, rate, lambda arm: median(arm, memory_key), eval_loss)
    return lines


def lean_goals(arms, trl_arms, rate, peak, eval_loss) -> list[str]:
    """Issue 19: ours with the levers tune picks against TRL's fastest and TRL's leanest arm, both at once."""
    fastest = max(trl_arms, key=lambda a: rate[a])
    leanest = min(trl_arms, key=peak)
    lean_loss = eval_loss("ours-lean")
    checks = [(f"ours-lean tokens/s >= {LEAN_SPEED}x TRL's fastest ({NAMES[fastest]})", rate["ours-lean"] / rate[fastest] >= LEAN_SPEED,
               f"{rate['ours-lean'] / rate[fastest]:.2f}x"),
              (f"ours-lean peak memory <= {LEAN_MEMORY}x TRL's leanest ({NAMES[leanest]})",
               peak("ours-lean") / peak(leanest) <= LEAN_MEMORY, f"{peak('ours-lean') / peak(leanest):.2f}x")]
    if "ours" in arms:
        ours_loss = eval_loss("ours")
        checks.append((f"ours-lean assistant eval loss within {LEAN_LOSS_TOLERANCE} of ours' (exact levers)",
                       abs(lean_loss - ours_loss) <= LEAN_LOSS_TOLERANCE, f"{lean_loss:.4f} vs {ours_loss:.4f}"))
    best_trl = min(trl_arms, key=eval_loss)
    checks.append((f"ours-lean assistant eval loss <= TRL's best (+{LEAN_LOSS_TOLERANCE})",
                   lean_loss <= eval_loss(best_trl) + LEAN_LOSS_TOLERANCE, f"{lean_loss:.4f} vs {eval_loss(best_trl):.4f} ({NAMES[best_trl]})"))
    return ["goals of issue 19 (both at once):"] + [f"  {'MET   ' if met else 'MISSED'} {what}: {figure}" for what, met, figure in checks]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=RECIPE, help="ours' recipe; its settings are every arm's (default %(default)s)")
    parser.add_argument("--rows", type=int, default=0, help="the first N train rows only (default: all)")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per arm (default: one epoch, as the recipe)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every arm, the order alternating (default 1)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    parser.add_argument("--bf16-steps", type=int, default=2,
                        help="CPU only: steps of TRL's all-defaults bf16 line (0: skip it; default 2: it is ~20x slower)")
    parser.add_argument("--max-length", type=int, default=0, help="tokens per row, every arm (default: the recipe's)")
    parser.add_argument("--rows-per-step", type=int, default=0, help="packed rows per optimizer step for ours and TRL's packing "
                        "arms (default: the recipe's per_device_train_batch_size)")
    parser.add_argument("--lean-fraction", type=float, default=LEAN_MEMORY,
                        help="ours-lean: tune's memory budget, as a fraction of TRL's leanest arm's peak (default %(default)s)")
    parser.add_argument("--tune-budget-s", type=float, default=600.0, help="ours-lean: seconds of tune's trials (default %(default)s)")
    parser.add_argument("--json", help="write every measure here")
    parser.add_argument("--keep", help="keep the runs (adapters, logs) in this directory instead of a temporary one")
    args = parser.parse_args()
    from hf_gpu_train.finetune.run import parse_args as finetune_args

    args.recipe, args.recipe_files = finetune_args(["--config", args.recipe])  # a name: the shipped file, its data files absolute
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
        if "trl-lean" in arms and not on_cuda:
            arms.remove("trl-lean")
            say("  TRL lean: TRL's activation offloading makes CUDA streams and does not start on a CPU; here TRL packing=True "
                "(fused LM head, packing, gradient checkpointing) is TRL's leanest arm")
        first = [a for a in arms if a != "ours-lean"]
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}

        def train(arm: str, r: int, plan_file: Path | None = None) -> None:
            tag = f"{arm}-r{r}"
            result = run_spec(train_spec(p, args, arm, work, train_file, tag, plan_file), work, tag)
            runs[arm].append(result)
            levers = f"; levers: {result['levers']}" if result.get("levers") else ""
            say(f"  round {r + 1}, {NAMES[arm]}: {result['tokens']} tokens in {result['train_seconds']:.1f} s of training "
                f"({result['optimizer_steps']} steps; {result['process_seconds']:.0f} s for the whole process; load average "
                f"{result['load_average_1min'][0]:.1f} -> {result['load_average_1min'][1]:.1f}){levers}")

        for r in range(args.rounds):
            for arm in (first if r % 2 == 0 else list(reversed(first))):
                train(arm, r)
        tune_lines = []
        if "ours-lean" in arms:  # after the TRL arms: its memory budget is a fraction of TRL's leanest peak
            key = "cuda_peak_reserved" if on_cuda else "peak_rss_train"
            trl_peaks = {a: statistics.median(run[key] for run in runs[a]) for a in first if a.startswith("trl")}
            if not trl_peaks:
                raise SystemExit("ours-lean needs at least one TRL arm: its memory budget is a fraction of TRL's leanest peak")
            leanest = min(trl_peaks, key=trl_peaks.get)
            # tune's peak on a GPU is torch's reserved plus what the device holds outside it (the CUDA context): the same
            # outside figure is added to the budget, so the goal's measure (reserved) is what the budget holds
            outside = statistics.median(run["cuda_outside_torch"] for run in runs[leanest]) if on_cuda else 0
            plan_file, tune_lines = tune_levers(args, work, train_file, int(args.lean_fraction * trl_peaks[leanest] + outside))
            tune_lines.insert(0, f"ours-lean: tune's budget is {args.lean_fraction} x {NAMES[leanest]}'s peak {mib(trl_peaks[leanest])} MiB")
            for line in tune_lines:
                say(f"  {line}")
            if plan_file is None:
                arms.remove("ours-lean")
                runs.pop("ours-lean")
                tune_lines.append("ours-lean: not run, tune found no candidate under the budget: issue 19's goals MISSED")
            for r in range(args.rounds if plan_file is not None else 0):
                train("ours-lean", r, plan_file)
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
    for line in tune_lines:
        say(line)
    say(f"load average at end {os.getloadavg()[0]:.2f}; whole benchmark {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "trl_bf16": bf16, "common_eval": evaluation,
                                               "plan": {k: v for k, v in p.items() if k not in ("cfg", "rows")},
                                               "rows": len(p["rows"]), "steps": args.steps, "device": device}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
