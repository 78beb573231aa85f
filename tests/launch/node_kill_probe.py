"""scripts/finetune.py with the training process(es) of one SLURM node SIGKILLed at the end of a step: ``KILL_NODE``
(a node name, SLURMD_NODENAME) and ``KILL_AT_STEP``; ``KILL_STAMP``: a JSON file for the time, the node and the global
rank of the kill. By node, not by rank: under c10d rendezvous torchelastic ignores the machine rank and numbers the
nodes in the order they join, so global rank 1 is on either node. Everything else is the real entry point."""

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import TrainerCallback  # noqa: E402

from hf_gpu_train.finetune import run  # noqa: E402


class KillNodeAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        node = os.environ.get("SLURMD_NODENAME")
        if state.global_step == int(os.environ["KILL_AT_STEP"]) and node == os.environ["KILL_NODE"]:
            Path(os.environ["KILL_STAMP"]).write_text(json.dumps({"time": time.time(), "node": node,
                                                                  "rank": args.process_index}))
            os.kill(os.getpid(), signal.SIGKILL)


defaults = run.default_callbacks
run.default_callbacks = lambda cfg, labels: [*defaults(cfg, labels), KillNodeAt()]
sys.exit(run.main(sys.argv[1:]))
