"""On 2 gloo processes, for each sampler setting asked: the plain Trainer run whole, then stopped by a stop signal to
rank 1 in its second epoch and resumed by a new Trainer (``attach_preemption(exit=False)``: one launch for all three).
Rank 0 writes both final weights: ``OUT/NAME.whole.pt`` and ``OUT/NAME.resumed.pt``.

``python sampler_probe.py OUT '{"NAME": {"train_sampling_strategy": ..., "data_seed": ...}, ...}'``. 48 rows, 2 a
micro-batch, 2 micro-batches a step, 2 processes: 6 steps an epoch; the signal comes during step 8."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.faults.preemption import attach_preemption  # noqa: E402
from tests.integrations.peers import build  # noqa: E402

end_quickly()
STEPS, SIGNAL_STEP = 10, 8


class SignalRankOne(TrainerCallback):
    def __init__(self):
        self.sent = False

    def on_substep_end(self, args, state, control, **kwargs):  # in the middle of the step's accumulation
        if args.process_index == 1 and state.global_step == SIGNAL_STEP - 1 and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


def run(out: Path, name: str, settings: dict) -> None:
    def make(folder: Path):
        return build("Trainer", str(folder), per_device=2, accumulation=2, max_steps=STEPS, **settings)

    whole = make(out / name / "whole")
    attach_preemption(whole, exit=False)
    whole.train()
    stopped = make(out / name / "run")
    stopped.add_callback(SignalRankOne())
    preemption = attach_preemption(stopped, exit=False)
    stopped.train()
    assert preemption.preempted and preemption.stopped_at_step == SIGNAL_STEP, preemption.stopped_at_step
    resumed = make(out / name / "run")
    attach_preemption(resumed, exit=False)
    resumed.train(resume_from_checkpoint=True)
    if resumed.accelerator.process_index == 0:
        torch.save(weights(whole), out / f"{name}.whole.pt")
        torch.save(weights(resumed), out / f"{name}.resumed.pt")


if __name__ == "__main__":
    target = Path(sys.argv[1])
    for run_name, run_settings in json.loads(sys.argv[2]).items():
        run(target, run_name, run_settings)
    from hf_gpu_train.process_group import leave_process_group

    leave_process_group()
