"""scripts/finetune.py with stop signals sent during a step, an evaluation or a save, each once per output_dir (a
resumed run sends the ones still to come). ``SIGNALS``: ``SIG:TARGET:WHEN:STEP`` entries joined by ``+`` (not commas: sbatch --export splits on them), sent from rank
``SIGNAL_RANK``:

- SIG: TERM, USR1 or USR2.
- TARGET: ``self`` (this rank), ``launcher`` (the ``hf-gpu-train launch`` process above the launcher that started this
  rank, as Kubernetes signals PID 1), ``steps`` (every process of this SLURM job's steps, ``scancel --signal=SIG``,
  what SLURM's preemption sends at the start of its GraceTime), ``job`` (every process of the job, the batch shell
  and its srun too, ``scancel --signal=SIG --full``, as at a time limit) or ``batch`` (the batch shell only,
  ``scancel --signal=SIG --batch``, what ``#SBATCH --signal=B:USR1@N`` does N seconds before the time limit).
- WHEN: ``accumulation`` (in the middle of step STEP's gradient accumulation; with no accumulation, at the end of the
  step before), ``evaluation`` (during the evaluation at step STEP) or ``save`` (while the checkpoint of step STEP is
  written).

``SIGNAL_STAMP``: a file for the time the first signal was sent and the last step finished then, for
benchmarks/preemption.py. Everything else is the real entry point."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import Trainer, TrainerCallback  # noqa: E402

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.finetune import run  # noqa: E402

end_quickly()
PLAN = [tuple(entry.split(":")) for entry in os.environ["SIGNALS"].split("+")]
SCOPE = {"steps": [], "job": ["--full"], "batch": ["--batch"]}


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def send(args, when: str, step: int, finished_step: int) -> None:
    if args.process_index != int(os.environ["SIGNAL_RANK"]):
        return
    for index, (name, target, planned_when, planned_step) in enumerate(PLAN):
        sent = Path(args.output_dir) / f"signal-sent-{index}"
        if (planned_when, int(planned_step)) != (when, step) or sent.exists():
            continue
        sent.write_text("")
        if os.environ.get("SIGNAL_STAMP") and index == 0:
            Path(os.environ["SIGNAL_STAMP"]).write_text(json.dumps({"time": time.time(), "finished_step": finished_step}))
        if target in SCOPE:
            # scancel runs inside the job step it signals: the signal may end it too (exit -15), after it was sent
            done = subprocess.run(["scancel", f"--signal={name}", *SCOPE[target], os.environ["SLURM_JOB_ID"]])
            assert done.returncode in (0, -getattr(signal, f"SIG{name}")), f"scancel failed: {done.returncode}"
        else:
            os.kill(os.getpid() if target == "self" else parent_of(os.getppid()), getattr(signal, f"SIG{name}"))


class SignalAt(TrainerCallback):
    def on_substep_end(self, args, state, control, **kwargs):  # inside a step: a micro-batch done, another to come
        send(args, "accumulation", state.global_step + 1, state.global_step)

    def on_step_end(self, args, state, control, **kwargs):  # no accumulation: at the end of the step before
        if args.gradient_accumulation_steps == 1:
            send(args, "accumulation", state.global_step + 1, state.global_step)

    def on_prediction_step(self, args, state, control, **kwargs):
        send(args, "evaluation", state.global_step, state.global_step)


saving = Trainer._save_checkpoint


def save_with_a_signal(self, *args, **kwargs):
    send(self.args, "save", self.state.global_step, self.state.global_step)
    return saving(self, *args, **kwargs)


Trainer._save_checkpoint = save_with_a_signal
defaults = run.default_callbacks
run.default_callbacks = lambda cfg, labels: [*defaults(cfg, labels), SignalAt()]
sys.exit(run.main(sys.argv[1:]))
