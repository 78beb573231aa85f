"""`hf-gpu-train tune` against an exhaustive grid over the same candidates, and against `auto_find_batch_size`.

On this machine's CPU, one process of the shipped CPU launch config, the OOM injector as the memory limit (a batch
above ``--oom-above`` samples per forward raises a real ``torch.OutOfMemoryError``):

1. ``hf-gpu-train tune`` as shipped (its default budget unless ``--budget-s``): its pick, its trials and time;
2. the grid: every candidate of the same space, in one launch of the same worker, with the same measured steps;
3. ``auto_find_batch_size``: a Trainer built by the same factory, started at the recipe's batch, with the same
   injector: the batch it settles on, its effective batch and its samples/s.

Printed: throughput of tune's pick over the grid's best, both as the grid measured them (goal >= 0.97); tune's trial
time over the grid's (goal <= 0.15), and the same with model loading; auto_find_batch_size's samples/s over tune's pick.

    python benchmarks/tune_vs_grid.py                                  # MiniLM-L6 on builtin:text, global batch 32
    python benchmarks/tune_vs_grid.py --tiny --global-batch 16         # a 2-layer BERT: a quick check that it works
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_gpu_train.tune.candidates import Candidate  # noqa: E402
from hf_gpu_train.tune.results import TrialResult, choose  # noqa: E402
from tests.tune.hooks import environment as hook_environment  # noqa: E402


def cli(*args: str, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "hf_gpu_train", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"hf-gpu-train {args[0]} failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return run, time.perf_counter() - start


def tiny_model(folder: Path) -> str:
    """A 2-layer BERT of MiniLM's vocabulary (the scaling tests' shape), saved as a model directory."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from hf_gpu_train.finetune.builtin import minilm_path

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=128, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def recipe_args(opts, folder: Path) -> list[str]:
    args = ["--config", "minilm_text_demo", f"global_batch_size={opts.global_batch}",
            f"max_train_samples={opts.max_train_samples}", f"output_dir={folder / 'out'}",
            "dataset=builtin:text", "max_length=64", "learning_rate=5e-5"]  # the recipe as it was measured (docs/tune.md)
    if opts.tiny:
        args.append(f"model={tiny_model(folder / 'tiny-bert')}")
    return args


def run_grid(config: Path, args: list[str], measure_steps: int, env: dict, folder: Path) -> tuple[list[TrialResult], float, float, Candidate]:
    """Every candidate of tune's space, through the same worker in one launch."""
    from hf_gpu_train.tune.job import load_job

    job = load_job(str(config), "scripts/finetune.py", args, {}, environ=env)
    spec = {"recipe": job.recipe, "overrides": list(job.overrides), "space": job.space.to_dict(), "budget_s": 0.0,
            "warmup_steps": 2, "measure_steps": measure_steps, "cached": {}, "search": "grid",
            "results_path": str(folder / "grid.json"), "output_dir": str(folder / "grid_trials")}
    (folder / "grid_spec.json").write_text(json.dumps(spec))
    _, wall = cli("launch", "--config-file", str(config), "-m", "hf_gpu_train.tune.worker", str(folder / "grid_spec.json"), env=env)
    doc = json.loads((folder / "grid.json").read_text())
    return [TrialResult.from_dict(t) for t in doc["trials"]], doc["spent_s"], wall, job.space.base


def auto_find_batch_size(args: list[str], global_batch: int, oom_above: int, warmup: int, measure: int, folder: Path) -> dict:
    """The HF Trainer's auto_find_batch_size from the whole global batch per step (accumulation 1), under the same
    injector: the batch it settles on (it never raises the accumulation, so the effective batch shrinks with it)."""
    import torch
    from transformers import Trainer, TrainerCallback

    from hf_gpu_train.finetune.loading import load_config
    from hf_gpu_train.finetune.run import parse_args, prepared_for
    from hf_gpu_train.finetune.runtime import resolve_runtime
    from hf_gpu_train.finetune.trainer_factory import build_trainer
    from hf_gpu_train.oom import OOMFaultInjector

    recipe, overrides = parse_args(args)
    cfg = load_config(recipe, [*overrides, "global_batch_size=null", f"per_device_train_batch_size={global_batch}", "eval_strategy=no", "save_strategy=no",
                               f"max_steps={warmup + measure}", f"logging_steps={warmup + measure + 1}", "dataloader_num_workers=0",
                               f"output_dir={folder / 'auto'}", "extra={auto_find_batch_size: true}"])
    runtime = resolve_runtime(cfg)
    p = prepared_for(cfg, runtime)
    model, train, validation, collator, tokenizer = p.model, p.train, p.validation, p.collator, p.processing_class
    OOMFaultInjector(max_batch=oom_above).install(model)

    class Window(TrainerCallback):
        """Samples and time of the measured steps of the last (re)started loop."""

        def __init__(self):
            self.samples, self.start, self.seconds, self.batch = 0, None, 0.0, 0
            model.register_forward_pre_hook(self.count, with_kwargs=True)

        def on_train_begin(self, args, state, control, **kwargs):
            self.samples, self.start = 0, None
            return control

        def count(self, module, a, kw):
            ids = kw.get("input_ids")
            if module.training and isinstance(ids, torch.Tensor) and self.start is not None:
                self.samples += int(ids.shape[0])
            self.batch = int(ids.shape[0]) if isinstance(ids, torch.Tensor) else self.batch

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                self.start = time.perf_counter()
            elif state.global_step == warmup + measure:
                self.seconds = time.perf_counter() - self.start
            return control

    window = Window()
    trainer = build_trainer(cfg, runtime, model, train, validation, collator, tokenizer, callbacks=[window], trainer_class=Trainer)
    trainer.train()
    accumulation = trainer.args.gradient_accumulation_steps
    return {"batch": window.batch, "effective_batch": window.batch * accumulation, "recipe_batch": cfg.per_device_train_batch_size,
            "samples_per_s": window.samples / window.seconds if window.seconds else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer BERT instead of the shipped MiniLM-L6")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--max-train-samples", type=int, default=800)
    parser.add_argument("--oom-above", type=int, default=8, help="the injected memory limit: samples per forward")
    parser.add_argument("--budget-s", type=float, default=None, help="tune's budget (default: tune's own)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tune_vs_grid_") as tmp:
        folder = Path(tmp)
        env = {**os.environ, "PYTHONPATH": str(ROOT), **hook_environment(oom_above=opts.oom_above)}
        cli("config", "--machine", "cpu-only", "--num-processes", "1", "--output", str(folder / "cpu"), env=env)
        config = folder / "cpu.yaml"
        args = recipe_args(opts, folder)
        budget = ["--budget-s", str(opts.budget_s)] if opts.budget_s else []
        run, tune_wall = cli("tune", "--fresh", *budget, "--config-file", str(config), "scripts/finetune.py", *args, env=env)
        tuned = json.loads(config.with_suffix(".plan.json").read_text())["tuned"]
        tune_trials = [TrialResult.from_dict(t) for t in tuned["trials"]]
        ran = [t for t in tune_trials if t.ran]
        pick = Candidate.from_dict(tuned["winner"]["candidate"])
        tune_spent = sum(t.seconds for t in ran)
        measure = ran[0].measured_steps
        grid, grid_spent, grid_wall, base = run_grid(config, args, measure, env, folder)
        auto = auto_find_batch_size(args, opts.global_batch, opts.oom_above, 2, measure, folder)
    metric = "tokens/s"
    by_key = {r.candidate.key: r for r in grid}
    best = max((r for r in grid if r.fits), key=lambda r: r.throughput(metric))
    picked = by_key[pick.key]
    grid_choice = choose(grid, metric, base).winner
    model = "2-layer BERT" if opts.tiny else "MiniLM-L6"
    print("\ngrid (every candidate, as measured):")
    for r in grid:
        marks = " <- tune's pick" if r.candidate.key == pick.key else ""
        marks += " <- fastest that fits" if r is best else ""
        speed = r.throughput(metric)
        print(f"  {r.candidate.describe():62} {'-' if speed is None else f'{speed:,.0f}':>9} {metric}  {r.verdict()}{marks}")
    print("tune's trials:")
    for r in tune_trials:
        speed = r.throughput(metric)
        print(f"  {r.candidate.describe():62} {'-' if speed is None else f'{speed:,.0f}':>9} {metric}  {r.verdict()}")
    print(f"\ntune vs grid: {model}, builtin:text ({opts.max_train_samples} samples), global batch {opts.global_batch}, 1 CPU process, "
          f"OOM injected above {opts.oom_above} samples per forward; {measure} measured steps per trial")
    print(f"{'':22}{'trials':>8}{'trial s':>10}{'wall s':>9}  pick")
    print(f"{'tune':22}{len(ran):>8}{tune_spent:>10.1f}{tune_wall:>9.1f}  {pick.describe()}")
    print(f"{'grid (same space)':22}{len(grid):>8}{grid_spent:>10.1f}{grid_wall:>9.1f}  {best.candidate.describe()} (fastest that fits)")
    print(f"{'':22}{'':>8}{'':>10}{'':>9}  grid's own choice by tune's rules: {grid_choice.candidate.describe()}")
    print(f"grid's measurement of tune's pick: {picked.throughput(metric):,.0f} {metric}; grid's best: {best.throughput(metric):,.0f}")
    print(f"throughput of tune's pick / grid's best: {picked.throughput(metric) / best.throughput(metric):.3f} (goal >= 0.97)")
    print(f"tune trial time / grid trial time: {tune_spent / grid_spent:.3f} (goal <= 0.15); wall with loading: "
          f"{tune_wall / grid_wall:.3f}")
    if auto["samples_per_s"]:
        print(f"auto_find_batch_size: settled on batch {auto['batch']} from {auto['recipe_batch']} (effective batch "
              f"{auto['effective_batch']}, tune keeps {opts.global_batch}): {auto['samples_per_s']:.1f} samples/s; "
              f"over tune's pick ({picked.samples_per_s:.1f} samples/s in the grid): {auto['samples_per_s'] / picked.samples_per_s:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
