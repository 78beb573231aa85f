"""Run a training script unchanged and note where its time goes (benchmarks/phases.py).

    python benchmarks/phase_clock.py RECORD SCRIPT [ARGS ...]

A global optimizer-step hook of torch's (``register_optimizer_step_post_hook``) notes the wall-clock times of the first
and the latest optimizer step. Around the pieces both scripts call (the model's ``from_pretrained``, ``Dataset.map``,
the Trainer's ``__init__``, ``train``, ``training_step``, ``evaluate``, ``_save_checkpoint``, ``save_model`` and its
callbacks' events) a clock is wrapped at class level that adds each call's own seconds (its nested clocked calls
taken out, so the items add up) to its item, split by when it started: before the first optimizer step ends, between
the first and the last, or after. RECORD is rewritten with one ``pwrite`` at each step and when the script returns (a
process that ends with ``os._exit`` has written all but its end). The script runs as ``__main__`` with its own
arguments; what it imports and does is untouched.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import time

RECORD_BYTES = 16384


class Clock:
    def __init__(self, record: str):
        self.fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.times: dict[str, float] = {"script_start": time.time()}
        self.items: dict[str, float] = {}  # "phase/item" -> own seconds
        self.stack: list[float] = []  # seconds of clocked calls nested in each open one

    def phase(self, at: float) -> str:
        if "first_step_end" not in self.times:
            return "start"
        return "end" if "train_returned" in self.times else "steps"

    def write(self) -> None:
        data = json.dumps({**self.times, "items": self.items}).encode()
        os.pwrite(self.fd, data.ljust(RECORD_BYTES), 0)

    def clocked(self, label: str, function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            began = time.time()
            phase = self.phase(began)
            self.stack.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                took = time.time() - began
                nested = self.stack.pop()
                if self.stack:
                    self.stack[-1] += took
                key = f"{phase}/{label(args) if callable(label) else label}"
                self.items[key] = self.items.get(key, 0.0) + took - nested
        return wrapper

    def step_ended(self, *unused) -> None:
        now = time.time()
        self.times.setdefault("first_step_end", now)
        self.times["last_step_end"] = now
        self.times["steps"] = self.times.get("steps", 0) + 1
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
               (transformers.Trainer, "_save_checkpoint", "checkpoint save"),
               (transformers.Trainer, "save_model", "model save"),
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
            clock.times["train_returned"] = time.time()
            clock.write()
    transformers.Trainer.train = train_noted


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
        clock.times["script_returned"] = time.time()
        clock.write()


if __name__ == "__main__":
    main()
