"""Launched with 2 gloo processes: rank 1 stalls at step 3, either asleep inside its collate function ("collate") or
inside a collective rank 0 never enters ("collective"). The watchdog (a 4 s limit) must end both processes with
every rank's stacks and rank 1 named; without it the run would wait out the 30-minute collective timeout. Or rank 1
is killed at step 3 ("kill", SIGKILL): the launch must end and name it.

Saves and evaluations every rank enters, or none ("alone"): rank 1 alone sets ``should_save`` and
``should_evaluate`` at step 2 (both ranks must save and evaluate), rank 0 alone calls ``trainer.save_model()`` at step
3 (plain DDP: allowed), then rank 0 alone calls ``trainer.evaluate()`` at step 4 (a clear error naming rank 1, not a
hang)."""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.data.data_collator import default_data_collator  # noqa: E402

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.faults.watchdog import attach_watchdog  # noqa: E402
from tests.callbacks.tiny import TokenDataset  # noqa: E402
from tests.oom.test_oom import exact_bert, oom_args  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)

out, mode = sys.argv[1], sys.argv[2]
calls = 0


def collate_that_stalls_on_rank_1(rows):
    global calls
    calls += 1
    if mode == "collate" and calls == 4 and torch.distributed.get_rank() == 1:
        time.sleep(600)  # a loader that never returns
    return default_data_collator(rows)


class CollectiveOnRankOneOnly(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        self.group = torch.distributed.new_group(backend="gloo")  # every rank makes it; only rank 1 will use it

    def on_step_end(self, args, state, control, **kwargs):
        if mode == "collective" and state.global_step == 3 and torch.distributed.get_rank() == 1:
            torch.distributed.all_reduce(torch.ones(1), group=self.group)  # rank 0 never enters it
        if mode == "kill" and state.global_step == 3 and torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the kernel's OOM killer, a segfault
        if mode == "alone" and state.global_step == 2 and torch.distributed.get_rank() == 1:
            control.should_save = control.should_evaluate = True  # from something only rank 1 sees
        if mode == "alone" and state.global_step == 3 and torch.distributed.get_rank() == 0:
            trainer.save_model(f"{out}/rank-0-model")  # plain DDP gathers nothing: the documented idiom
        if mode == "alone" and state.global_step == 4 and torch.distributed.get_rank() == 0:
            trainer.evaluate()  # gathers from every rank

    def on_evaluate(self, args, state, control, **kwargs):  # a file: a process ended by its peer's error loses no line
        with open(f"{out}/evaluated-rank-{torch.distributed.get_rank()}.txt", "a") as f:
            f.write(f"{state.global_step}\n")


trainer = Trainer(model=exact_bert(), args=oom_args(out, max_steps=50, per_device_train_batch_size=4),
                  train_dataset=TokenDataset(n=400), eval_dataset=TokenDataset(n=16),
                  data_collator=collate_that_stalls_on_rank_1, callbacks=[CollectiveOnRankOneOnly()])
attach_watchdog(trainer, timeout=4, poll_s=0.25, collect_s=5)
trainer.train()
print("hang_probe: training finished, which it must not", flush=True)
