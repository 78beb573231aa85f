"""scripts/finetune.py with a stop signal sent during a step: ``SIGNAL`` (TERM, USR1, USR2) to ``SIGNAL_TARGET`` (``self``:
this rank; ``launcher``: the ``hf-gpu-train launch`` process above the launcher that started this rank) from rank
``SIGNAL_RANK`` in the middle of step ``SIGNAL_AT_STEP``'s gradient accumulation (``SIGNAL_STAMP``: a file for the
time it was sent, for benchmarks/preemption.py). Everything else is the real entry point."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import TrainerCallback  # noqa: E402

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.finetune import run  # noqa: E402

end_quickly()


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


class SignalAt(TrainerCallback):
    def __init__(self):
        self.sent = False

    def _send(self, args, state) -> None:
        if self.sent or args.process_index != int(os.environ["SIGNAL_RANK"]):
            return
        self.sent = True
        target = os.getpid() if os.environ.get("SIGNAL_TARGET", "self") == "self" else parent_of(os.getppid())
        if os.environ.get("SIGNAL_STAMP"):
            Path(os.environ["SIGNAL_STAMP"]).write_text(str(time.time()))
        os.kill(target, getattr(signal, f"SIG{os.environ.get('SIGNAL', 'TERM')}"))

    def on_substep_end(self, args, state, control, **kwargs):  # inside a step: a micro-batch done, another to come
        if state.global_step == int(os.environ["SIGNAL_AT_STEP"]) - 1:
            self._send(args, state)

    def on_step_end(self, args, state, control, **kwargs):  # no accumulation: at the end of the step before
        if args.gradient_accumulation_steps == 1 and state.global_step == int(os.environ["SIGNAL_AT_STEP"]) - 1:
            self._send(args, state)


defaults = run.default_callbacks
run.default_callbacks = lambda cfg, labels: [*defaults(cfg, labels), SignalAt()]
sys.exit(run.main(sys.argv[1:]))
