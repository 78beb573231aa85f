"""A plain Trainer with ``attach_preemption`` under plain ``torchrun`` (no hf-gpu-train launch): rank 1 sends itself
SIGTERM during step 2. ``python -m torch.distributed.run --nproc-per-node 2 torchrun_probe.py OUTPUT_DIR``."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import TrainerCallback  # noqa: E402

from hf_gpu_train.faults.preemption import attach_preemption  # noqa: E402
from tests.integrations.peers import build  # noqa: E402


class SignalRankOne(TrainerCallback):
    def on_substep_end(self, args, state, control, **kwargs):
        if args.process_index == 1 and state.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)


trainer = build("Trainer", sys.argv[1], per_device=2, accumulation=2, max_steps=4)
trainer.add_callback(SignalRankOne())
attach_preemption(trainer)
trainer.train()
