"""Resilience (issue 38): what a checkpoint costs the training, and what each way a job ends costs the run.

``saves``: one process, a plain ``transformers.Trainer`` with ``guard_saves`` (what scripts/finetune.py installs), a
BERT-base-sized model (6 layers, hidden 768: ~67 M parameters, random weights, no hub) and AdamW: each checkpoint holds
the weights, the optimizer's two moments, the scheduler and the RNG (~0.8 GB). Side by side in one process, alternating:
the training time each save blocks (the first save's included: it allocates the staging buffers), synchronous (``HF_GPU_TRAIN_BACKGROUND_SAVES=0``, what the Trainer does) against
background (the default); and the steps/s (from the third step's end to the last) of a run that saves every N steps against one that never
saves. Arms alternate their order from round to round, after a warm-up run in none. The
background write ``fsync``s its files (the synchronous save does not): the comparison favours the synchronous save.

    python benchmarks/resilience.py [--only saves] [--rounds 2] [--steps 18] [--save-every 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _trainer(out: Path, steps: int, save_every: int | None, background: bool):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from hf_gpu_train.faults.disk_full import guard_saves

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 4096

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randint(1, 30000, (64,), generator=g), "labels": torch.tensor(i % 2)}

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_hidden_layers=6, hidden_size=768, intermediate_size=3072,
                                                     num_attention_heads=12, vocab_size=30522))
    args = TrainingArguments(str(out), max_steps=steps, per_device_train_batch_size=4, report_to="none", use_cpu=True,
                             disable_tqdm=True, logging_steps=steps, save_strategy="steps" if save_every else "no",
                             save_steps=save_every or 1, save_total_limit=2)
    trainer = Trainer(model=model, args=args, train_dataset=Rows())
    guard_saves(trainer, background=background)
    blocked: list[float] = []
    original = trainer._save_checkpoint

    def timed(*a, **kw):
        start = time.perf_counter()
        result = original(*a, **kw)
        blocked.append(time.perf_counter() - start)
        return result

    trainer._save_checkpoint = timed
    return trainer, blocked


def _step_ends(trainer) -> list[float]:
    """The time of each step's end (steps/s is taken from the third on: the first steps warm the allocator up)."""
    from transformers import TrainerCallback

    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer.add_callback(StepEnds())
    return ends


def _checkpoint_bytes(out: Path) -> int:
    found = sorted(out.glob("checkpoint-*"))
    return sum(p.stat().st_size for p in found[-1].rglob("*") if p.is_file()) if found else 0


def saves(rounds: int, steps: int, save_every: int) -> None:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    arms = {"never saves": (None, True), "synchronous saves": (save_every, False), "background saves": (save_every, True)}
    results: dict[str, dict[str, list[float]]] = {name: {"blocked": [], "steps_per_s": [], "write": []} for name in arms}
    size = 0
    warm, _ = _trainer(Path(tempfile.mkdtemp()), 2, None, True)
    warm.train()  # torch's and the allocator's first steps, in no arm
    for round_index in range(rounds):
        order = list(arms.items())
        for name, (every, background) in (order if round_index % 2 == 0 else order[::-1]):
            with tempfile.TemporaryDirectory() as folder:
                trainer, blocked = _trainer(Path(folder), steps, every, background)
                ends = _step_ends(trainer)
                trainer.train()
                results[name]["steps_per_s"].append((len(ends) - 2) / (ends[-1] - ends[1]))
                results[name]["blocked"] += blocked
                written = trainer._hf_gpu_train_background_saves
                if background and written is not None:
                    results[name]["write"] += written.write_seconds
                size = max(size, _checkpoint_bytes(Path(folder)))
    sync = statistics.median(results["synchronous saves"]["blocked"])
    never = statistics.median(results["never saves"]["steps_per_s"])
    print(f"\nsaves: one process, ~67 M parameters + AdamW, a checkpoint of {size / 2**30:.2f} GiB every {save_every} steps "
          f"of {steps}, {rounds} rounds (medians)")
    print("| arm | training blocked per save | vs synchronous | background write per save | steps/s | vs never saves |")
    print("|---|---|---|---|---|---|")
    for name, found in results.items():
        blocked = statistics.median(found["blocked"]) if found["blocked"] else None
        write = statistics.median(found["write"]) if found["write"] else None
        rate = statistics.median(found["steps_per_s"])
        print(f"| {name} | {'-' if blocked is None else f'{blocked:.2f} s'} | "
              f"{'-' if blocked is None else f'{blocked / sync:.2f}x'} | {'-' if write is None else f'{write:.2f} s'} | "
              f"{rate:.3f} | {rate / never:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["saves"], default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=18)
    parser.add_argument("--save-every", type=int, default=4)
    args = parser.parse_args(argv)
    if args.only in (None, "saves"):
        saves(args.rounds, args.steps, args.save_every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
