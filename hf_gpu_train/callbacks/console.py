"""One compact console line per log step, instead of the Trainer printing every logged dict.

Telemetry sends its full metric set through ``Trainer.log`` so every ``report_to`` sink gets it; the
Trainer's ``PrinterCallback`` / ``ProgressCallback`` would then print that dict (and the Trainer's own
loss dict) in full at every log step. ``attach_telemetry`` swaps them for the printers here, which
print::

    step 40/500 [01:12<13:48] | loss 0.41 | lr 3.00e-05 | 812 samples/s | 52k tok/s | MFU 38% | mem 12.1/80.0 GiB | healthy

from rank 0: the telemetry window (kept when it is logged) joined with the Trainer's loss log of the
same step; evaluation and end-of-training logs get one short line each. ``[elapsed<remaining]`` is tqdm's: the time
since the first step began (not what runs at train begin, such as the evaluation before training), and the steps left at
the average step time so far (the evaluations and saves between steps included: they recur). Nothing is dropped from ``logs``: the
printers only read it. The Trainer's progress bar (``ProgressCallback``, on by default, and what TRL's trainers keep) is
replaced too: one display, the lines, not a bar with lines written through it.
"""

from __future__ import annotations

import time

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

# keys of the Trainer's training log that the line shows in its own way, or that only add noise there
# (with include_num_input_tokens_seen the Trainer adds its running train_* speed to every training log)
_SHOWN_APART = frozenset({"loss", "learning_rate", "epoch", "total_flos", "grad_norm", "num_input_tokens_seen", "train_runtime",
                          "train_samples_per_second", "train_steps_per_second", "train_tokens_per_second"})
_EVAL_APART = frozenset({"runtime", "samples_per_second", "steps_per_second", "model_preparation_time"})  # the last: load-time noise


def _num(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _rate(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def telemetry_parts(metrics: dict[str, float], verdict_label: str | None) -> list[str]:
    """The telemetry half of the line: speed, MFU, memory, verdict (each only when known)."""
    parts = []
    if "loop/samples_per_s" in metrics:
        parts.append(f"{_rate(metrics['loop/samples_per_s'])} samples/s")
    if "loop/tokens_per_s" in metrics:
        parts.append(f"{_rate(metrics['loop/tokens_per_s'])} tok/s")
    if "loop/mfu_pct" in metrics:
        mfu = metrics["loop/mfu_pct"]
        parts.append(f"MFU {mfu:.0f}%" if mfu >= 10 else f"MFU {mfu:.1f}%")
    gpus = sorted(int(k[3:].split("/")[0]) for k in metrics if k.startswith("gpu") and k.endswith("/mem_used_gib"))
    if gpus and f"gpu{gpus[0]}/mem_total_gib" in metrics:
        parts.append(f"mem {metrics[f'gpu{gpus[0]}/mem_used_gib']:.1f}/{metrics[f'gpu{gpus[0]}/mem_total_gib']:.1f} GiB")
    elif "torch/mem_allocated_gib" in metrics:
        parts.append(f"mem {metrics['torch/mem_allocated_gib']:.1f} GiB (reserved {metrics.get('torch/mem_reserved_gib', 0):.1f})")
    elif "host/rss_gib" in metrics:
        parts.append(f"rss {metrics['host/rss_gib']:.1f} GiB")
    if verdict_label:
        parts.append(verdict_label)
    return parts


def clock(seconds: float) -> str:
    """tqdm's format: mm:ss, or h:mm:ss from an hour."""
    seconds = int(round(max(0.0, seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


def progress(step: int, max_steps: int | None, elapsed_s: float | None, steps_timed: int) -> str:
    """`` [elapsed<remaining]`` (``steps_timed``: the steps the elapsed time covers; the rest at their average), or
    ``[elapsed]`` without a known end, or '' without a clock."""
    if elapsed_s is None:
        return ""
    if not max_steps or max_steps <= 0 or steps_timed <= 0:
        return f" [{clock(elapsed_s)}]"
    return f" [{clock(elapsed_s)}<{clock((max_steps - step) * elapsed_s / steps_timed)}]"


def step_line(step: int, max_steps: int | None, train_logs: dict | None, telemetry: list[str], timing: str = "") -> str:
    head = (f"step {step}/{max_steps}" if max_steps and max_steps > 0 else f"step {step}") + timing
    parts = [head]
    if train_logs:
        if "loss" in train_logs:
            parts.append(f"loss {_num(train_logs['loss'])}")
        if "learning_rate" in train_logs:
            parts.append(f"lr {train_logs['learning_rate']:.2e}")
        parts += [f"{k} {_num(v)}" for k, v in train_logs.items() if k not in _SHOWN_APART and isinstance(v, (int, float))]
    return " | ".join(parts + telemetry)


def brief_line(step: int, logs: dict) -> str:
    """A log that is not a training step's: evaluation, the end-of-training summary, or anything a user logged."""
    if "train_loss" in logs and "train_runtime" in logs:
        parts = ["train done", f"{logs['train_runtime']:.1f} s"]
        if "train_samples_per_second" in logs:
            parts.append(f"{_rate(logs['train_samples_per_second'])} samples/s")
        if "train_loss" in logs:
            parts.append(f"loss {_num(logs['train_loss'])}")
        return " | ".join(parts)
    evaluation = {k[5:]: v for k, v in logs.items() if k.startswith("eval_")}
    if evaluation:
        parts = [f"eval step {step}"]
        parts += [f"{k} {_num(v)}" for k, v in evaluation.items() if k not in _EVAL_APART and isinstance(v, (int, float))]
        if "runtime" in evaluation:
            parts.append(f"{evaluation['runtime']:.1f} s")
        return " | ".join(parts)
    return " | ".join([f"step {step}"] + [f"{k} {_num(v)}" for k, v in logs.items() if k not in ("total_flos", "epoch")])


class _CompactLines:
    """Joins the telemetry window and the Trainer's loss log of one step into one line."""

    def __init__(self, telemetry):
        self.telemetry = telemetry
        self._pending: tuple[int, list[str]] | None = None
        self._started: tuple[float, int] | None = None  # (monotonic time, global step) when training began

    def start(self, state) -> None:
        self._started = (time.monotonic(), state.global_step)

    def reset(self) -> None:
        self._started = None

    @property
    def started(self) -> bool:
        return self._started is not None

    def timing(self, state, step: int) -> str:
        if self._started is None:  # attached after train() began: timed from the first line
            self.start(state)
        began, first = self._started
        return progress(step, state.max_steps, time.monotonic() - began, step - first)

    def lines_for(self, state, logs: dict) -> list[str]:
        if self.telemetry.emitting:
            verdict = self.telemetry.last_verdict
            out = self.flush(state)
            self._pending = (state.global_step, telemetry_parts(logs, verdict.label() if verdict else None))
            return out
        if "loss" in logs:
            pending = self._pending[1] if self._pending and self._pending[0] == state.global_step else []
            out = [] if pending or not self._pending else self.flush(state)
            self._pending = None
            return out + [step_line(state.global_step, state.max_steps, logs, pending, self.timing(state, state.global_step))]
        return self.flush(state) + [brief_line(state.global_step, logs)]

    def flush(self, state) -> list[str]:
        if self._pending is None:
            return []
        step, parts = self._pending
        self._pending = None
        return [step_line(step, state.max_steps, None, parts, self.timing(state, step))]


HEARTBEAT_S = 30.0  # a line at least this often while training or evaluating, whatever logging_steps is


class CompactPrinterCallback(TrainerCallback):
    """Replaces ``PrinterCallback`` (``disable_tqdm=True``) and ``ProgressCallback`` (the default). The progress bar
    it replaces moved on every step; the lines come at each logging step, and between them (transformers' default
    ``logging_steps`` is 500, an evaluation of thousands of rows logs once at its end) a progress line at least every
    ``heartbeat_s``: never minutes of silence."""

    def __init__(self, telemetry, heartbeat_s: float = HEARTBEAT_S):
        self.lines = _CompactLines(telemetry)
        self.heartbeat_s = heartbeat_s
        self._last_line = time.monotonic()
        self._evaluation: tuple[float, int] | None = None  # (when the evaluation's first batch ran, batches so far)

    def _say(self, lines: list[str]) -> None:
        for line in lines:
            print(line, flush=True)
        if lines:
            self._last_line = time.monotonic()

    def _due(self) -> bool:
        return time.monotonic() - self._last_line >= self.heartbeat_s

    def on_train_begin(self, args, state, control, **kwargs):
        self.lines.reset()  # timed from the first step: what runs at train begin (an evaluation first) is not a step
        self._last_line = time.monotonic()
        return control

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.lines.started:
            self.lines.start(state)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        # not on a step that logs (the Trainer's flow callback, first in the list, has decided): its line comes in on_log
        if state.is_world_process_zero and self._due() and not control.should_log:
            self._say([step_line(state.global_step, state.max_steps, None, [], self.lines.timing(state, state.global_step))])
        return control

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        began, batches = self._evaluation or (time.monotonic(), 0)
        self._evaluation = (began, batches + 1)
        if state.is_world_process_zero and self._due():
            total = len(eval_dataloader) if eval_dataloader is not None and hasattr(eval_dataloader, "__len__") else None
            done = f"{batches + 1}/{total}" if total else f"{batches + 1}"
            self._say([f"evaluating: batch {done} [{clock(time.monotonic() - began)}]"])
        return control

    def on_evaluate(self, args, state, control, **kwargs):
        self._evaluation = None
        return control

    def on_predict(self, args, state, control, **kwargs):
        self._evaluation = None
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs is not None:
            self._say(self.lines.lines_for(state, logs))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._say(self.lines.flush(state))
        return control


def use_compact_console(trainer, telemetry, in_place: bool = False) -> None:
    """Swap the Trainer's own printer (exactly ``PrinterCallback`` or ``ProgressCallback``; a user's subclass
    or a notebook printer is left alone) for the compact lines, through the public callback API. ``in_place``: from
    inside a callback event (the Trainer is iterating its callbacks), the printer is replaced at its own position
    instead, which the running event then reaches as usual (the Trainer adds its printer after the user's callbacks)."""
    handler = trainer.callback_handler
    for index, callback in enumerate(list(handler.callbacks)):
        if type(callback) not in (PrinterCallback, ProgressCallback):
            continue
        replacement = CompactPrinterCallback(telemetry)
        if in_place:
            # a bar the Trainer's progress callback already drew (its on_train_begin ran before ours) is closed, so
            # the lines are the one display from here on
            for bar in (getattr(callback, "training_bar", None), getattr(callback, "prediction_bar", None)):
                if bar is not None:
                    bar.close()
            handler.callbacks[index] = replacement  # its clock starts at the first step
        else:
            trainer.remove_callback(callback)
            trainer.add_callback(replacement)
