"""Launched with 2 gloo processes by test_telemetry_ranks.py (issue 28, item 4): a user callback sets a control flag at
step 3 on rank 0 only (``should_log`` is off the logging schedule there: every 2 steps). Each case trains the tiny BERT
for 6 steps in turn, in one process group:

- ``reference``: telemetry and no callback of the user's (so no flag agreement either: every callback sets its flags
  alike on every rank; the weights every case must end with);
- ``log``: telemetry alone, ``should_log`` on rank 0;
- ``log+watchdog``: telemetry and the watchdog, ``should_log`` on rank 0;
- ``evaluate``: telemetry alone, ``should_evaluate`` on rank 0;
- ``evaluate-everywhere``: the same with ``should_evaluate`` on every rank (an evaluation's data loader draws a seed
  from the global RNG, so the dropout after it differs from the reference's: this case's weights are ``evaluate``'s);
- ``save``: telemetry alone, ``should_save`` on rank 0;
- ``save+guard``: ``guard_saves`` (and the loss-scaling guard telemetry brings, so it trains as the others), no
  telemetry, ``should_save`` on rank 0;
- ``save-in-log+guard``: ``guard_saves``, ``should_save`` set on rank 0 from ``on_log`` (inside the Trainer's log, after the
  flags of the step were agreed: its save comes later in the same call);
- ``evaluate+oom``: ``enable_oom_recovery`` alone (its evaluation micro-batch is agreed by an all-reduce after each
  evaluation), no telemetry, ``should_evaluate`` on rank 0.

Each rank writes ``CASE/rank-N.json`` (the steps its log history shows telemetry figures at, the steps it evaluated and
saved at, the steps whose telemetry record holds both ranks' summaries) and ``CASE/rank-N.pt`` (its final weights).
A case that has not ended within 60 s (a few seconds each here; the watchdog's floor is 120 s) ends the process with
exit 1, naming it: a collective one rank entered alone waits forever on gloo, ``ddp_timeout`` or not."""

import json
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from hf_gpu_train.callbacks import attach_telemetry  # noqa: E402
from hf_gpu_train.faults.disk_full import guard_saves  # noqa: E402
from hf_gpu_train.faults.watchdog import attach_watchdog  # noqa: E402
from hf_gpu_train.oom.loss_scaling import guard_loss_scaling  # noqa: E402
from hf_gpu_train.oom.recovery import enable_oom_recovery  # noqa: E402
from tests.callbacks.tiny import TokenDataset, tiny_args, tiny_bert  # noqa: E402

out = Path(sys.argv[1])
FLAG = {"log": "should_log", "log+watchdog": "should_log", "evaluate": "should_evaluate",
        "evaluate-everywhere": "should_evaluate", "save": "should_save", "save+guard": "should_save",
        "save-in-log+guard": "should_save", "evaluate+oom": "should_evaluate"}


class OnRankZeroAlone(TrainerCallback):
    """Sets a flag from something only rank 0 sees (its clock, a file it reads)."""

    def __init__(self, flag):
        self.flag = flag

    def on_step_end(self, args, state, control, **kwargs):
        if case == "save-in-log+guard":
            return control
        if state.global_step == 3 and (torch.distributed.get_rank() == 0 or case == "evaluate-everywhere"):
            setattr(control, self.flag, True)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if case == "save-in-log+guard" and state.global_step == 4 and torch.distributed.get_rank() == 0:
            setattr(control, self.flag, True)
        return control


class Seen(TrainerCallback):
    def __init__(self):
        self.evaluated, self.saved = [], []

    def on_evaluate(self, args, state, control, **kwargs):
        self.evaluated.append(state.global_step)

    def on_save(self, args, state, control, **kwargs):
        self.saved.append(state.global_step)


def did_not_end(case):  # from a thread: a rank waiting inside a gloo collective runs no signal handler
    print(f"probe: case {case} did not end within 60 s", file=sys.stderr, flush=True)
    os._exit(1)


for case in ("reference", *FLAG):
    deadline = threading.Timer(60, did_not_end, (case,))
    deadline.daemon = True
    deadline.start()
    folder = out / case
    seen = Seen()
    callbacks = [OnRankZeroAlone(FLAG[case]), seen] if case in FLAG else []
    trainer = Trainer(model=tiny_bert(), args=tiny_args(folder, max_steps=6, logging_steps=2, per_device_eval_batch_size=8),
                      train_dataset=TokenDataset(n=96), eval_dataset=TokenDataset(n=16), callbacks=callbacks)
    telemetry = None
    if case in ("save+guard", "save-in-log+guard"):
        guard_saves(trainer)
        guard_loss_scaling(trainer)
    elif case == "evaluate+oom":
        enable_oom_recovery(trainer)
    else:
        telemetry = attach_telemetry(trainer, interval_s=0.05)
    if case == "log+watchdog":
        attach_watchdog(trainer)
    trainer.train()
    deadline.cancel()
    rank = torch.distributed.get_rank()
    figures = sorted({e["step"] for e in trainer.state.log_history if "loop/step_time_s" in e})
    both = sorted(r["step"] for r in (telemetry.records if telemetry else [])
                  if sorted(x.get("rank") for x in r.get("ranks", []) if "rank" in x) == [0, 1])
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, folder / f"rank-{rank}.pt")
    (folder / f"rank-{rank}.json").write_text(json.dumps({"telemetry_steps": figures, "both_ranks_steps": both,
                                                          "evaluated": seen.evaluated, "saved": seen.saved}))
    print(f"probe: {case} done on rank {rank}", flush=True)

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.process_group import leave_process_group  # noqa: E402

end_quickly()
leave_process_group()
