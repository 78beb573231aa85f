"""What each of our per-step pieces adds to a step that is all overhead, in milliseconds per step.

On this CPU a fine-tune's step takes about a second, so a ratio of steps/s hides a millisecond; a GPU step of 20-50 ms
would show it. Here the model is so small (a one-layer BERT of width 16, 8 rows of 8 tokens) that a plain Trainer step
takes a few milliseconds: what our pieces add is most of what differs. Arms, each a fresh Trainer of the same seed, the
pieces as shipped (their defaults):

- ``none``: the plain Trainer;
- ``telemetry``: ``attach_telemetry`` (its sampler thread, hooks, the loss guard, the compact console; with several
  processes its gather at log steps and the straggler exchange every 5 steps);
- ``watchdog``: ``attach_watchdog``;
- ``preemption``: ``attach_preemption`` (the signal handlers, ``guard_saves`` and the control-flag agreement);
- ``oom``: ``enable_oom_recovery`` (the wrapped step; with several processes its gradient reducer and ballots);
- ``loss_guard``: ``guard_loss_scaling`` alone;
- ``all``: every one of them.

Each round runs every arm once, in a rotated order (alternating), ``--steps`` measured steps after ``--warmup``; an
arm's time per step is from the end of the warm-up's last step to the end of the last step (log steps, every
``--logging-steps``, included). The added milliseconds per step of an arm is its median over rounds of (arm - none of the
same round). One process, then 2 gloo processes (rank 0's clock; both ranks run the same arms in the same order).

Goal (issue 39): ``all`` adds <= 0.5 ms per step on one process and <= 2 ms on two.

    python benchmarks/step_overhead.py [--rounds 7] [--steps 300] [--processes 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARMS = ("none", "telemetry", "watchdog", "preemption", "oom", "loss_guard", "all")


def tiny_trainer(out: Path, steps: int, logging_steps: int):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    class Rows(torch.utils.data.Dataset):
        def __init__(self, n: int):
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(1, 50, (n, 8), generator=g)
            self.labels = torch.randint(0, 2, (n,), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "attention_mask": torch.ones(8, dtype=torch.long), "labels": self.labels[i]}

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                     intermediate_size=32, max_position_embeddings=16, num_labels=2))
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, max_steps=steps, logging_steps=logging_steps,
                             report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    return Trainer(model=model, args=args, train_dataset=Rows(8 * steps * 2))


def attach(arm: str, trainer, out: Path) -> None:
    from hf_gpu_train import attach_preemption, attach_telemetry, attach_watchdog, enable_oom_recovery, guard_loss_scaling

    pieces = {"telemetry": lambda: attach_telemetry(trainer),
              "watchdog": lambda: attach_watchdog(trainer, output_dir=out),
              "preemption": lambda: attach_preemption(trainer, exit=False),
              "oom": lambda: enable_oom_recovery(trainer),
              "loss_guard": lambda: guard_loss_scaling(trainer)}
    for name in (pieces if arm == "all" else [arm] if arm in pieces else []):
        pieces[name]()


def run_arm(arm: str, out: Path, warmup: int, steps: int, logging_steps: int) -> float:
    """Seconds per step of ``steps`` steps after ``warmup``."""
    from transformers import TrainerCallback

    ends: list[float] = []

    class StepClock(TrainerCallback):
        hf_gpu_train_sets_flags_alike = True  # it sets no flag: not a reason for the per-step flag agreement

        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer = tiny_trainer(out, warmup + steps, logging_steps)
    trainer.add_callback(StepClock())
    attach(arm, trainer, out)
    trainer.train()
    return (ends[-1] - ends[warmup - 1]) / steps


def worker(out: Path, rounds: int, warmup: int, steps: int, logging_steps: int) -> None:
    import logging

    logging.disable(logging.WARNING)  # the pieces' start-up notes are the same in every round
    rank = int(os.environ.get("RANK", "0"))
    per_step: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(rounds):
        order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
        for arm in order:
            per_step[arm].append(run_arm(arm, out / f"round{r}-{arm}", warmup, steps, logging_steps))
    if rank == 0:
        (out / "per_step.json").write_text(json.dumps(per_step))
    from hf_gpu_train.process_group import leave_process_group

    leave_process_group()


def table(per_step: dict[str, list[float]], processes: int) -> list[dict]:
    base = per_step["none"]
    rows = []
    for arm in ARMS:
        added = [1000 * (a - b) for a, b in zip(per_step[arm], base)]
        rows.append({"piece": arm, "processes": processes, "step_ms": round(1000 * statistics.median(per_step[arm]), 3),
                     "added_ms_per_step": round(statistics.median(added), 3),
                     "added_ms_range": [round(min(added), 3), round(max(added), 3)]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--logging-steps", type=int, default=10, help="the fine-tune's default (finetune/config.py)")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), args.rounds, args.warmup, args.steps, args.logging_steps)
        return 0
    from gloo_launch import cpu_config, launch

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for processes in args.processes:
            out = Path(tmp) / f"p{processes}"
            out.mkdir()
            command = [__file__, "--worker", str(out), "--rounds", str(args.rounds), "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--logging-steps", str(args.logging_steps)]
            if processes == 1:
                run = subprocess.run([sys.executable, *command], capture_output=True, text=True)
            else:
                run = launch(cpu_config(tmp, processes), *command)
            if run.returncode != 0:
                print(run.stderr[-4000:], file=sys.stderr)
                return 1
            rows += table(json.loads((out / "per_step.json").read_text()), processes)
    print("| piece | processes | ms per step | added ms per step (median; min..max over rounds) |")
    print("|---|---|---|---|")
    for row in rows:
        low, high = row["added_ms_range"]
        added = "-" if row["piece"] == "none" else f"{row['added_ms_per_step']:+.2f} ({low:+.2f}..{high:+.2f})"
        print(f"| {row['piece']} | {row['processes']} | {row['step_ms']:.2f} | {added} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
