"""Run a training script unchanged and note where its time goes (benchmarks/phases.py).

    python benchmarks/phase_clock.py RECORD SCRIPT [ARGS ...]

A global optimizer-step hook of torch's (``register_optimizer_step_post_hook``) notes the wall-clock times of the first
and the latest optimizer step. Around the pieces both scripts call (the model's ``from_pretrained``, ``Dataset.map``,
the Trainer's ``__init__``, ``train``, ``training_step``, ``evaluate``, ``_save_checkpoint``, ``save_model`` and its
callbacks' events) a clock is wrapped at class level that adds each call's own seconds (its nested clocked calls
taken out, so the items add up) to its item, split by when it started: before the first optimizer step ends, between
the first and the last (a call after a step is filed once the next step ends), or after the last. RECORD is rewritten
with one ``pwrite`` at each step, when ``train()`` returns and when the script returns or calls ``os._exit``. The script runs as ``__main__`` with its own
arguments; what it imports and does is untouched.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import time

RECORD_BYTES = 32768


class Clock:
    def __init__(self, record: str):
        self.fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.times: dict[str, float] = {"script_start": time.time()}
        self.items: dict[str, float] = {}  # "phase/item" -> own seconds
        self.calls: dict[str, int] = {}  # "phase/item" -> how many calls
        self.since_last_step: dict[str, list] = {}  # item -> [own seconds, calls] inside train() after the latest step
        self.stack: list[float] = []  # seconds of clocked calls nested in each open one
        self.pid = os.getpid()  # a forked child (a DataLoader worker, a map process) inherits the clock: never writes

    def add(self, began: float, item: str, seconds: float) -> None:
        """Before the first step's end: "start"; inside train() after a step, held until the next step ends ("steps")
        or train() returns without one (then it was after the last step: "end"); after train() returned: "end"."""
        if "first_step_end" not in self.times or began < self.times["first_step_end"]:
            key = f"start/{item}"
        elif "train_returned" in self.times:
            key = f"end/{item}"
        else:
            held = self.since_last_step.setdefault(item, [0.0, 0])
            held[0] += seconds
            held[1] += 1
            return
        self._file(key, seconds, 1)

    def _file(self, key: str, seconds: float, calls: int) -> None:
        self.items[key] = self.items.get(key, 0.0) + seconds
        self.calls[key] = self.calls.get(key, 0) + calls

    def settle(self, phase: str) -> None:
        for item, (seconds, calls) in self.since_last_step.items():
            self._file(f"{phase}/{item}", seconds, calls)
        self.since_last_step.clear()

    def write(self) -> None:
        if os.getpid() != self.pid:
            return
        data = json.dumps({**self.times, "items": self.items, "calls": self.calls}).encode()
        os.pwrite(self.fd, data.ljust(RECORD_BYTES), 0)

    def clocked(self, label, function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            began = time.time()
            self.stack.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                took = time.time() - began
                nested = self.stack.pop()
                if self.stack:
                    self.stack[-1] += took
                self.add(began, label(args) if callable(label) else label, took - nested)
        return wrapper

    def step_ended(self, *unused) -> None:
        now = time.time()
        self.times.setdefault("first_step_end", now)
        self.times["last_step_end"] = now
        self.times["steps"] = self.times.get("steps", 0) + 1
        self.settle("steps")
        self.write()

    def train_returned(self) -> None:
        self.times["train_returned"] = time.time()
        self.settle("end")
        self.write()

    def script_returned(self) -> None:
        """The script returned or called ``os._exit``; calls held since the last step (an exit from inside train():
        a stop signal, the watchdog) were after it."""
        self.times.setdefault("script_returned", time.time())
        self.settle("end")
        self.write()


def install(clock: Clock) -> None:
    import datasets
    import transformers
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from transformers import trainer_callback

    register_optimizer_step_post_hook(clock.step_ended)
    patches = [(transformers.PreTrainedModel, "from_pretrained", "model load"),
               (datasets.Dataset, "map", "data preparation (Dataset.map)"),
               (transformers.Trainer, "__init__", "Trainer.__init__"),
               (transformers.Trainer, "training_step", "training_step (forward, backward)"),
               (transformers.Trainer, "evaluate", "evaluation"),
               (transformers.Trainer, "_save_checkpoint", "checkpoint save (optimizer, scheduler, state)"),
               (transformers.Trainer, "save_model", "model save (the final one's, and each checkpoint's weights)"),
               (trainer_callback.CallbackHandler, "call_event", lambda args: f"callbacks: {args[1]}")]
    for owner, name, label in patches:
        original = owner.__dict__[name]
        wrapped = clock.clocked(label, original.__func__ if isinstance(original, classmethod) else original)
        setattr(owner, name, classmethod(wrapped) if isinstance(original, classmethod) else wrapped)
    training_step = transformers.Trainer.training_step

    @functools.wraps(training_step)
    def counted(self, model, inputs, *args, **kwargs):  # the padded tokens the steps compute on: the batches' shape
        ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        if ids is not None:
            clock.times["padded_tokens"] = clock.times.get("padded_tokens", 0) + ids.numel()
        return training_step(self, model, inputs, *args, **kwargs)
    transformers.Trainer.training_step = counted
    train = transformers.Trainer.train

    @functools.wraps(train)
    def train_noted(*args, **kwargs):
        clock.times.setdefault("train_called", time.time())
        try:
            return train(*args, **kwargs)
        finally:
            clock.train_returned()
    transformers.Trainer.train = train_noted
    leave = os._exit

    def exit_noted(code):  # a run of several processes ends with os._exit (hf_gpu_train/fast_exit.py): no finally runs
        clock.script_returned()
        leave(code)
    os._exit = exit_noted


def main() -> None:
    record, script, *args = sys.argv[1:]
    clock = Clock(record)
    install(clock)
    clock.times["clock_installed"] = time.time()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        clock.script_returned()


if __name__ == "__main__":
    main()
