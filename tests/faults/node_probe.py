"""One process of a run on two "nodes" of this machine (two hf-gpu-train launches, machine ranks 0 and 1) with
``save_on_each_node=True``: each node's local rank 0 writes the checkpoints into its own output_dir
(``OUT/node<RANK>``: the two nodes' disks), every 2 steps, guarded by ``guard_saves`` (through attach_preemption)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_gpu_train.faults.preemption import attach_preemption  # noqa: E402
from tests.integrations.peers import build  # noqa: E402

out = Path(sys.argv[1]) / f"node{os.environ['RANK']}"
trainer = build("Trainer", str(out), per_device=2, max_steps=4, save_strategy="steps", save_steps=2, save_on_each_node=True)
attach_preemption(trainer)
trainer.train()
from hf_gpu_train.process_group import leave_process_group  # noqa: E402

leave_process_group()
