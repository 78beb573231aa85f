"""The console lines (callbacks/console.py) against what a user sees in time: the clock starts at the first step (an
evaluation at train begin is not a step), and between logging steps, or through a long evaluation, a progress line
comes at least every heartbeat, whatever logging_steps is."""

from __future__ import annotations

import re
import time

from transformers import Trainer, TrainerCallback

from hf_gpu_train.callbacks import attach_telemetry
from hf_gpu_train.callbacks.console import CompactPrinterCallback
from tests.callbacks.tiny import TokenDataset, tiny_args, tiny_bert


class SlowEvaluationFirst(TrainerCallback):
    """An evaluation at train begin that takes ``seconds`` (as evaluate_before's does on a large validation set)."""

    def __init__(self, trainer, seconds: float):
        self.trainer, self.seconds = trainer, seconds

    def on_train_begin(self, args, state, control, **kwargs):
        time.sleep(self.seconds)
        return control


def _clock_seconds(text: str) -> int:
    minutes, seconds = text.split(":")[-2:]
    return int(minutes) * 60 + int(seconds)


def test_the_remaining_time_is_not_inflated_by_what_runs_at_train_begin(tmp_path, capsys):
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=12, logging_steps=4, disable_tqdm=False),
                      train_dataset=TokenDataset(96))
    attach_telemetry(trainer, write_report=False)
    wait = 6.0
    trainer.add_callback(SlowEvaluationFirst(trainer, wait))
    started = time.monotonic()
    trainer.train()
    training = time.monotonic() - started - wait  # the steps alone (however busy the machine)
    first = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step 4/12"))
    elapsed, remaining = (_clock_seconds(t) for t in re.search(r"\[([\d:]+)<([\d:]+)\]", first).groups())
    assert elapsed <= training + 1  # the wait at train begin is not in it (it would be at least 6 s more)
    assert remaining <= 2 * elapsed + 2  # 8 steps left at the 4 steps' average (whole seconds)


def test_a_line_comes_between_logging_steps_and_through_an_evaluation(tmp_path, capsys):
    """transformers' default logging_steps is 500: with the progress bar replaced, the heartbeat keeps the console
    alive; an evaluation says how far it is."""
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=6, logging_steps=500, disable_tqdm=False,
                                                        per_device_eval_batch_size=8),
                      train_dataset=TokenDataset(48), eval_dataset=TokenDataset(32))
    attach_telemetry(trainer, write_report=False)
    printer = next(c for c in trainer.callback_handler.callbacks if isinstance(c, CompactPrinterCallback))
    printer.heartbeat_s = 0.0
    trainer.train()
    trainer.evaluate()
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" [")[0] for line in out if line.startswith("step ")][:6] == [f"step {i}/6" for i in range(1, 7)]
    assert any(line.startswith("evaluating: batch 4/4") for line in out)


def test_a_logging_step_gets_one_line_whatever_the_heartbeat(tmp_path, capsys):
    """The heartbeat comes in on_step_end, before the Trainer's log: on a step that logs, only the log's line."""
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=4, logging_steps=2, disable_tqdm=False),
                      train_dataset=TokenDataset(32))
    attach_telemetry(trainer, write_report=False)
    next(c for c in trainer.callback_handler.callbacks if isinstance(c, CompactPrinterCallback)).heartbeat_s = 0.0
    trainer.train()
    heads = [line.split(" [")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert heads == ["step 1/4", "step 2/4", "step 3/4", "step 4/4"]
