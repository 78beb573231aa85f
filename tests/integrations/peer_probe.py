"""Train one peer of the integration matrix and record what it did.

In-process: ``record(out, name, **run)``. Launched with several processes: ``python peer_probe.py OUT RUNS_JSON``
runs each named configuration in turn and every rank writes ``OUT/NAME.rankR.pt``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from hf_gpu_train.callbacks import attach_telemetry  # noqa: E402
from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.faults.watchdog import attach_watchdog  # noqa: E402
from hf_gpu_train.oom import OOMFaultInjector, enable_oom_recovery  # noqa: E402
from tests.integrations.peers import build  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def train(out: Path, kind: str, per_device: int, ours: bool = True, oom: dict | None = None,
          evaluate: bool = False, accumulation: int = 1, mean_loss: bool = False) -> tuple:
    trainer = build(kind, str(out), per_device, accumulation)
    if mean_loss:  # what a user who knows does for a mean loss (transformers 5 multiplies it by the processes otherwise)
        trainer.model_accepts_loss_kwargs = False
    lines = _Lines()
    logging.getLogger("hf_gpu_train").addHandler(lines)
    injector = OOMFaultInjector(**oom).install(trainer.model) if oom else None
    recovery = None
    if ours:
        attach_telemetry(trainer, compact_console=False, write_report=False)
        recovery = enable_oom_recovery(trainer)
        attach_watchdog(trainer)  # its flag agreement and entry gate must change nothing in anyone's trainer
    try:
        trainer.train()
        evaluation = trainer.evaluate() if evaluate else {}
    finally:
        logging.getLogger("hf_gpu_train").removeHandler(lines)
    history = trainer.state.log_history
    trainable = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
                 if p.requires_grad}
    result = {
        "losses": [h["loss"] for h in history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in history if "grad_norm" in h],
        "global_step": trainer.state.global_step,
        "ooms_raised": injector.raised if injector else 0,
        "micro_batch": recovery.micro_batch if recovery else None,
        "restarts": recovery.restarts if recovery else 0,
        "stepped_aside": [line for line in lines.lines if "OOM recovery is off" in line],
        "telemetry_keys": sorted({k for h in history for k in h if "/" in k}),
        "telemetry_tokens": sum(h.get("loop/tokens", 0) for h in history),
        "generated_tokens": sum(h.get("loop/generated_tokens", 0) for h in history),
        "tallies": {k: h[k] for h in history for k in ("num_tokens",) if k in h},
        "own_tallies": {k: getattr(trainer, k) for k in ("calls", "tokens_seen") if hasattr(trainer, k)},
        "params": trainable,
        "evaluation": {k: v for k, v in evaluation.items() if k in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy")},
        "eval_micro_batch": recovery.state.eval_micro_batch if recovery else None,
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

    leave_process_group()
