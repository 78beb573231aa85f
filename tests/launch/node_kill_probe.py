"""scripts/finetune.py with the training process(es) of one SLURM node SIGKILLed at the end of a step: ``KILL_NODE``
(a node name, SLURMD_NODENAME) and ``KILL_AT_STEP``; ``KILL_STAMP``: a JSON file for the time, the node and the global
rank of the kill. By node, not by rank: under c10d rendezvous torchelastic ignores the machine rank and numbers the
nodes in the order they join, so global rank 1 is on either node. ``KILL_ONCE``: a file whose existence means the kill
happened already (a failure a restart does not meet again); ``DRAIN_NODE=1``: the node is drained first (its
administrator took it out: a requeued job gets the nodes left). The kill waits for the newest checkpoint to be
complete (a crash between checkpoints). Everything else is the real entry point."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import TrainerCallback  # noqa: E402

from hf_gpu_train.faults.checkpoint_marker import COMPLETE_MARKER  # noqa: E402
from hf_gpu_train.finetune import run  # noqa: E402


class KillNodeAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        node = os.environ.get("SLURMD_NODENAME")
        if state.global_step != int(os.environ["KILL_AT_STEP"]) or node != os.environ["KILL_NODE"]:
            return
        once = os.environ.get("KILL_ONCE")
        if once and Path(once).exists():
            return
        newest = max(Path(args.output_dir).glob("checkpoint-*"), default=None, key=lambda p: int(p.name.split("-")[1]))
        deadline = time.monotonic() + 60
        while newest is not None and not (newest / COMPLETE_MARKER).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.environ.get("DRAIN_NODE") == "1":
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=hf-gpu-train-test"], check=True)
        if once:
            Path(once).write_text(node)
        Path(os.environ["KILL_STAMP"]).write_text(json.dumps({"time": time.time(), "node": node,
                                                              "rank": args.process_index}))
        os.kill(os.getpid(), signal.SIGKILL)


defaults = run.default_callbacks
run.default_callbacks = lambda cfg, labels: [*defaults(cfg, labels), KillNodeAt()]
sys.exit(run.main(sys.argv[1:]))
