"""One compact console line per log step, instead of the Trainer printing every logged dict.

Telemetry sends its full metric set through ``Trainer.log`` so every ``report_to`` sink gets it; the
Trainer's ``PrinterCallback`` / ``ProgressCallback`` would then print that dict (and the Trainer's own
loss dict) in full at every log step. ``attach_telemetry`` swaps them for the printers here, which
print::

    step 40/500 | loss 0.41 | lr 3.00e-05 | 812 samples/s | 52k tok/s | MFU 38% | mem 12.1/80.0 GiB | healthy

from rank 0: the telemetry window (kept when it is logged) joined with the Trainer's loss log of the
same step; evaluation and end-of-training logs get one short line each. Nothing is dropped from
``logs``: the printers only read it.
"""

from __future__ import annotations

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

# keys of the Trainer's training log that the line shows in its own way, or that only add noise there
# (with include_num_input_tokens_seen the Trainer adds its running train_* speed to every training log)
_SHOWN_APART = frozenset({"loss", "learning_rate", "epoch", "total_flos", "grad_norm", "num_input_tokens_seen", "train_runtime",
                          "train_samples_per_second", "train_steps_per_second", "train_tokens_per_second"})
_EVAL_APART = frozenset({"runtime", "samples_per_second", "steps_per_second"})


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


def step_line(step: int, max_steps: int | None, train_logs: dict | None, telemetry: list[str]) -> str:
    head = f"step {step}/{max_steps}" if max_steps and max_steps > 0 else f"step {step}"
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
            return out + [step_line(state.global_step, state.max_steps, logs, pending)]
        return self.flush(state) + [brief_line(state.global_step, logs)]

    def flush(self, state) -> list[str]:
        if self._pending is None:
            return []
        step, parts = self._pending
        self._pending = None
        return [step_line(step, state.max_steps, None, parts)]


class CompactPrinterCallback(TrainerCallback):
    """Replaces ``PrinterCallback`` (``disable_tqdm=True``)."""

    def __init__(self, telemetry):
        self.lines = _CompactLines(telemetry)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs is not None:
            for line in self.lines.lines_for(state, logs):
                print(line, flush=True)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            for line in self.lines.flush(state):
                print(line, flush=True)
        return control


class CompactProgressCallback(ProgressCallback):
    """Replaces ``ProgressCallback``: the same progress bars, compact lines written above them."""

    def __init__(self, telemetry, max_str_len: int = 100):
        super().__init__(max_str_len=max_str_len)
        self.lines = _CompactLines(telemetry)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs is not None:
            for line in self.lines.lines_for(state, logs):
                self.training_bar.write(line)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            for line in self.lines.flush(state):
                self.training_bar.write(line)
        return super().on_train_end(args, state, control, **kwargs)


def use_compact_console(trainer, telemetry, in_place: bool = False) -> None:
    """Swap the Trainer's own printer (exactly ``PrinterCallback`` or ``ProgressCallback``; a user's subclass
    or a notebook printer is left alone) for the compact one, through the public callback API. ``in_place``: from
    inside a callback event (the Trainer is iterating its callbacks), the printer is replaced at its own position
    instead, which the running event then reaches as usual (the Trainer adds its printer after the user's callbacks)."""
    handler = trainer.callback_handler
    for index, callback in enumerate(list(handler.callbacks)):
        if type(callback) is PrinterCallback:
            replacement = CompactPrinterCallback(telemetry)
        elif type(callback) is ProgressCallback:
            replacement = CompactProgressCallback(telemetry, max_str_len=callback.max_str_len)
        else:
            continue
        if in_place:
            # a printer before us in the list has had its on_train_begin (its progress bar exists): keep what it built
            lines = getattr(replacement, "lines", None)
            replacement.__dict__.update(callback.__dict__)
            replacement.lines = lines
            handler.callbacks[index] = replacement
        else:
            trainer.remove_callback(callback)
            trainer.add_callback(replacement)
