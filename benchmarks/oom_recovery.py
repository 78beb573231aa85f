"""The same injected-OOM scenario under our in-place recovery and under Trainer's auto_find_batch_size.

A tiny BERT, 512 samples, batch 16, one epoch; from the 11th training forward on, any batch above 8
samples raises a real ``torch.OutOfMemoryError`` (the fault injector). Printed side by side: steps
redone, wall time lost against a run without OOM, effective batch before and after, final loss.
Ours must redo zero steps and keep the effective batch exactly.

    python benchmarks/oom_recovery.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import Trainer, TrainerCallback  # noqa: E402

from hf_gpu_train.oom import OOMFaultInjector, enable_oom_recovery  # noqa: E402
from tests.callbacks.tiny import TokenDataset  # noqa: E402
from tests.oom.test_oom import exact_bert, oom_args  # noqa: E402


class CountSteps(TrainerCallback):
    def __init__(self):
        self.steps = 0
        self.batches: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        return control

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.batches.append(getattr(train_dataloader, "total_batch_size", None) or args.per_device_train_batch_size)
        return control


def run(tmp: str, mode: str) -> dict:
    model = exact_bert()
    injector = OOMFaultInjector(max_batch=8, start_after=10).install(model) if mode != "clean" else None
    args = oom_args(f"{tmp}/{mode}", per_device_train_batch_size=16, max_steps=-1, num_train_epochs=1, logging_steps=4,
                    auto_find_batch_size=mode == "auto_find_batch_size")
    counter = CountSteps()
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(n=512), eval_dataset=TokenDataset(n=128), callbacks=[counter])
    recovery = enable_oom_recovery(trainer) if mode == "ours" else None
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    if injector:
        injector.remove()
    final = trainer.state.global_step
    # what the last (re)started training loop really fed per optimizer step
    effective_after = counter.batches[-1] * trainer.args.gradient_accumulation_steps
    return {"mode": mode, "wall_s": wall, "steps_executed": counter.steps, "final_step": final,
            "steps_redone": counter.steps - final, "batch_before": 16, "batch_after": effective_after,
            "micro_batch": recovery.micro_batch if recovery else None, "ooms": injector.raised if injector else 0,
            "eval_loss": trainer.evaluate()["eval_loss"]}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(tmp, mode) for mode in ("clean", "ours", "auto_find_batch_size")]
    clean = results[0]
    print("tiny BERT, 512 samples, batch 16, 1 epoch, OOM injected above 8 samples from the 11th forward on (CPU)")
    print(f"{'':<22} {'OOMs':>5} {'steps run':>10} {'final step':>11} {'steps redone':>13} {'wall lost':>10} "
          f"{'eff. batch before -> after':>27} {'final eval loss':>16}")
    for r in results:
        print(f"{r['mode']:<22} {r['ooms']:>5} {r['steps_executed']:>10} {r['final_step']:>11} {r['steps_redone']:>13} "
              f"{r['wall_s'] - clean['wall_s']:>9.2f}s {str(r['batch_before']) + ' -> ' + str(r['batch_after']):>27} "
              f"{r['eval_loss']:>16.4f}")
    ours = results[1]
    ok = ours["steps_redone"] == 0 and ours["batch_after"] == ours["batch_before"] and ours["final_step"] == clean["final_step"]
    print(f"ours: micro-batch {ours['micro_batch']}, zero steps redone and effective batch kept: {'yes' if ok else 'NO'}; "
          f"final eval loss equal to the run without OOM: {abs(ours['eval_loss'] - clean['eval_loss']) < 1e-4}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
