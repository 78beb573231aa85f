"""scripts/finetune.py with one rank SIGKILLed at the end of a step (the kernel's OOM killer, a segfault):
``KILL_RANK`` and ``KILL_AT_STEP`` say which and when (``KILL_STAMP``: a file for the time of the kill, for
benchmarks/faults.py; ``KILL_ONCE``: a file whose existence means the kill happened already: a failure that a
restart does not meet again). The kill comes once the newest checkpoint is complete (its background write done and
marked, waited for here, up to a minute): a crash between checkpoints, not during a write (that case:
tests/faults/test_background_save.py; ``KILL_DURING_WRITE=1``: at the save of step ``KILL_AT_STEP`` instead, told at
once after its staging, while a background write is in flight). ``STEP_STAMP``: a file
rank 0 appends "time step" to at the first step end of each start (benchmarks/resilience.py: seconds from the kill to
training again). ``KILL_RANK=any``: whichever rank this is (an elastic launch numbers nodes as they join: the node is
chosen by whose environment says so); ``KILL_WHOLE_NODE=1``: the launcher and torchrun above this process are killed
with it (a node lost: nothing of it restarts). Everything else is the real entry point."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import TrainerCallback  # noqa: E402

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.faults.checkpoint_marker import COMPLETE_MARKER  # noqa: E402
from hf_gpu_train.finetune import run  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)


class KillAt(TrainerCallback):
    first_step_seen = False
    hears_of_staged_saves = True  # its on_save comes right after the staging (faults/background_save.py)

    def on_save(self, args, state, control, **kwargs):
        if (os.environ.get("KILL_DURING_WRITE") == "1" and state.global_step == int(os.environ["KILL_AT_STEP"])
                and self._this_rank(args)):
            self._kill()

    def on_step_end(self, args, state, control, **kwargs):
        if os.environ.get("STEP_STAMP") and args.process_index == 0 and not self.first_step_seen:
            self.first_step_seen = True
            with open(os.environ["STEP_STAMP"], "a") as stamps:
                stamps.write(f"{time.time()} {state.global_step}\n")
        if (state.global_step == int(os.environ["KILL_AT_STEP"]) and self._this_rank(args)
                and os.environ.get("KILL_DURING_WRITE") != "1"):
            newest = max((p for p in Path(args.output_dir).glob("checkpoint-*")), default=None,
                         key=lambda p: int(p.name.split("-")[1]))
            deadline = time.monotonic() + 60
            while newest is not None and not (newest / COMPLETE_MARKER).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            self._kill()

    @staticmethod
    def _this_rank(args) -> bool:
        return os.environ["KILL_RANK"] == "any" or args.process_index == int(os.environ["KILL_RANK"])

    @staticmethod
    def _kill() -> None:
        once = os.environ.get("KILL_ONCE")
        if once:
            if Path(once).exists():
                return
            Path(once).write_text(str(time.time()))
        if os.environ.get("KILL_STAMP"):
            Path(os.environ["KILL_STAMP"]).write_text(str(time.time()))
        if os.environ.get("KILL_WHOLE_NODE") == "1":
            launcher = os.getppid()  # torchrun; above it hf-gpu-train launch
            above = int(Path(f"/proc/{launcher}/stat").read_text().rsplit(")", 1)[1].split()[1])
            for pid in (above, launcher):
                os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


defaults = run.default_callbacks
run.default_callbacks = lambda cfg, labels: [*defaults(cfg, labels), KillAt()]
sys.exit(run.main(sys.argv[1:]))
