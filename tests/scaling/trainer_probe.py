"""Train the scaling models with a plain Trainer and record what each run did.

In-process: ``record(out, name, **run)``. Launched with several processes:
``python trainer_probe.py OUT RUNS_JSON`` runs each named configuration in turn (one process group,
one Trainer per run) and every rank writes ``OUT/NAME.rankR.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.oom import OOMFaultInjector, enable_oom_recovery, guard_loss_scaling  # noqa: E402
from tests.scaling.models import model_and_data  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)

MAX_STEPS = 4
ADAM_EPSILON = 1e-6


def training_args(out: Path, per_device: int, accumulation: int, **extra) -> TrainingArguments:
    """AdamW with eps 1e-6 (tests/scaling/equivalence.py says why)."""
    return TrainingArguments(adam_epsilon=ADAM_EPSILON,
        output_dir=str(out), per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        max_steps=MAX_STEPS, learning_rate=1e-3, warmup_steps=1, lr_scheduler_type="linear", logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, **extra)


def train(out: Path, kind: str, per_device: int, accumulation: int = 1, recovery: bool = False, guard: bool = True,
          oom: dict | None = None, bucket_bytes: int | None = None) -> tuple[Trainer, dict]:
    """One run; ``guard`` applies hf_gpu_train's loss-scaling guard alone, ``recovery`` the OOM recovery
    (which includes the guard), neither: the plain Trainer as a user has it."""
    model, data = model_and_data(kind)
    injector = OOMFaultInjector(**oom).install(model) if oom else None
    trainer = Trainer(model=model, args=training_args(out, per_device, accumulation), train_dataset=data)
    recovery_state = None
    if recovery:  # small buckets: gradients leave in several all-reduces while backward still runs
        recovery_state = enable_oom_recovery(trainer, **({"bucket_bytes": bucket_bytes} if bucket_bytes else {}))
    if guard and not recovery:
        guard_loss_scaling(trainer)
    trainer.train()
    history = trainer.state.log_history
    result = {
        "losses": [h["loss"] for h in history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "global_step": trainer.state.global_step,
        "ooms_raised": injector.raised if injector else 0,
        "micro_batch": recovery_state.micro_batch if recovery_state else None,
        "overlapped_buckets": recovery_state.overlapped_buckets if recovery_state else 0,
        "params": {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()},
    }
    return trainer, result


def record(out: Path, name: str, **run) -> dict:
    trainer, result = train(out / name, **run)
    torch.save(result, out / f"{name}.rank{trainer.accelerator.process_index}.pt")
    return result


if __name__ == "__main__":
    target = Path(sys.argv[1])
    for run_name, run in json.loads(sys.argv[2]).items():
        record(target, run_name, **run)
    from hf_gpu_train.process_group import leave_process_group

    leave_process_group()  # Gloo's threads could otherwise abort the exit (see hf_gpu_train/process_group.py)
