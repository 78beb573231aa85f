"""Launched with 2 gloo processes by test_stragglers.py: one run per case, a delay on rank 1 from step ONSET on, in
the phase the case names (none: no delay). Each rank writes what telemetry named, and at which step, as JSON.

Usage: straggler_probe.py OUT [CASE ...]

``STRAGGLER_ON_GPU=1`` (scripts/gpu_checks/stragglers_on_gpu.py, NCCL): the model on the GPU, and a delay inside the
forward or the backward a GPU spin (a host sleep there would not be the GPU's time).
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import Trainer, TrainerCallback  # noqa: E402

from hf_gpu_train.callbacks import attach_telemetry  # noqa: E402
from tests.callbacks.tiny import TokenDataset, tiny_args, tiny_bert  # noqa: E402

DELAY_S = float(os.environ.get("STRAGGLER_DELAY_S", "0.06"))
ONSET = 10  # the first step with the delay
STEPS = 10 + 3 * 5 + 4  # onset, then the three exchanges that name it (check every 5 steps), and a few more
RANK = int(os.environ.get("RANK", "0"))
ON_GPU = os.environ.get("STRAGGLER_ON_GPU") == "1"
delaying = [False]


def pause(seconds: float = DELAY_S, on_device: bool = False) -> None:
    if delaying[0] and RANK == 1:
        if on_device and ON_GPU:
            from scripts.gpu_checks.stragglers_on_gpu import spin

            spin(1000 * seconds)
        else:
            time.sleep(seconds)


class SlowData(TokenDataset):
    def __getitem__(self, i):
        item = super().__getitem__(i)
        if CASE == "data":
            pause(DELAY_S / 8)  # per sample, 8 per step: the step's delay is the other cases'
        return item


class Injector(TrainerCallback):
    """Turns the delay on from step ONSET; puts it in the phase the case names."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if CASE == "forward":
            model.bert.encoder.register_forward_pre_hook(lambda module, inputs: pause(on_device=True))
        if CASE == "backward":  # inside the backward, before this rank's last gradient (the embeddings come last)
            model.classifier.weight.register_hook(lambda grad: (pause(on_device=True), grad)[1])
        if CASE == "optimizer":
            torch_optimizer = getattr(optimizer, "optimizer", optimizer)
            torch_optimizer.register_step_pre_hook(lambda *a: pause())

    def on_step_end(self, args, state, control, **kwargs):
        delaying[0] = state.global_step + 1 >= ONSET  # the next step is delayed
        if CASE == "host":
            pause()


out = Path(sys.argv[1])
for CASE in sys.argv[2:]:
    delaying[0] = False
    data = SlowData(n=8 * 2 * STEPS)
    trainer = Trainer(model=tiny_bert(), args=tiny_args(out / CASE, max_steps=STEPS, logging_steps=4, use_cpu=not ON_GPU),
                      train_dataset=data, callbacks=[Injector()])
    telemetry = attach_telemetry(trainer, interval_s=0.5)
    trainer.train()
    watch = telemetry.stragglers
    findings = [(w["step"], w["finding"]) for w in watch.windows]
    named = [r.get("straggler") for r in telemetry.records if r.get("straggler")]
    (out / CASE / f"rank-{RANK}.json").write_text(json.dumps({"findings": findings, "named": named,
                                                              "windows": watch.windows}))

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.process_group import leave_process_group  # noqa: E402

end_quickly()
leave_process_group()
