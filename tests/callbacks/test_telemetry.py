import json
import logging
import re
import threading
import time

import pytest
from transformers import Trainer

from hf_gpu_train.callbacks import CpuByAccidentGuard, TelemetryCallback, TrainingOnCpuByAccident, attach_telemetry
from hf_gpu_train.hardware.fake import FakeNvmlBackend
from hf_gpu_train.oom import OOMFaultInjector, enable_oom_recovery
from tests.callbacks.tiny import TokenDataset, tiny_args, tiny_bert

SW_POWER_CAP = 0x4
# A GPU that works hard at its power limit: utilization climbs to 95%, SwPowerCap in every reading and the SM
# clock at 1200 of 1410 MHz (the A100 snapshot's maximum). That is "at power limit", not throttling.
SERIES = {
    "utilization_pct": [(40, 10), (60, 20), (95, 50)],
    "power_usage_mw": [150_000, 250_000, 350_000],
    "temperature_c": [55, 60, 65],
    "sm_clock_mhz": [1200],
    "clock_event_reasons": [SW_POWER_CAP],
    "memory_info_used": [10 * 2**30],
}


def sampler_threads():
    return [t for t in threading.enumerate() if t.name == "hf_gpu_train-telemetry"]


def fake_memory(device, allocated=2.0, reserved=3.0):
    return {"torch/mem_allocated_gib": allocated, "torch/mem_reserved_gib": reserved, "torch/mem_peak_gib": 2.5,
            "torch/reserved_minus_allocated_gib": reserved - allocated, "torch/alloc_retries": 0.0, "torch/ooms": 0.0}


def slow_forward(model, seconds=0.04):
    """Steps that take a known minimum time, so data wait stays a small share on a busy 2-core machine."""
    model.register_forward_pre_hook(lambda module, args: time.sleep(seconds) if module.training else None)
    return model


def windows(out):
    return [json.loads(line) for line in (out / "telemetry.jsonl").read_text().splitlines() if '"kind": "window"' in line]


def test_real_trainer_with_fake_nvml_logs_units_values_and_report(tmp_path, machine):
    backend = FakeNvmlBackend(machine("2x-a100-one-busy"), series=SERIES)
    trainer = Trainer(model=slow_forward(tiny_bert()), args=tiny_args(tmp_path), train_dataset=TokenDataset())
    callback = attach_telemetry(trainer, backend=backend, gpu_indices=[0], interval_s=0.02, memory_probe=fake_memory)
    logs_seen = []

    class Spy(TelemetryCallback.__mro__[1]):  # a plain TrainerCallback that records what on_log got
        def on_log(self, args, state, control, logs=None, **kw):
            logs_seen.append(dict(logs))
            return control

    trainer.add_callback(Spy())
    trainer.train()
    history = [h for h in trainer.state.log_history if "gpu0/util_pct" in h]
    assert history, trainer.state.log_history
    entry = history[-1]
    for key in ("gpu0/util_pct", "gpu0/util_pct_max", "gpu0/power_w", "gpu0/power_limit_w", "gpu0/temp_c", "gpu0/mem_used_gib",
                "gpu0/sm_clock_mhz", "gpu0/sm_clock_max_mhz", "gpu0/throttled_pct", "host/cpu_pct", "host/rss_gib",
                "loop/step_time_s", "loop/samples_per_s", "loop/tokens_per_s", "loop/data_wait_pct",
                "torch/mem_allocated_gib", "torch/mem_reserved_gib", "torch/alloc_retries"):
        assert key in entry, key
    assert entry["gpu0/util_pct_max"] == 95 and entry["gpu0/power_w_max"] == 350.0
    assert entry["gpu0/power_limit_w"] == 400.0 and entry["gpu0/mem_used_gib"] == 10.0 and entry["gpu0/temp_c_max"] == 65
    assert 0 <= entry["loop/data_wait_pct"] <= 100
    assert "loop/mfu_pct" not in entry  # the model is on the CPU: no peak to compare with
    assert any("gpu0/util_pct" in logs for logs in logs_seen)  # went through the Trainer's own logging
    # report files written, thread stopped
    for name in ("telemetry.jsonl", "telemetry_summary.json", "report.md", "telemetry_utilization.svg", "telemetry_power.svg"):
        assert (tmp_path / name).is_file(), name
    summary = json.loads((tmp_path / "telemetry_summary.json").read_text())
    # derived from the series: clocks below maximum with SwPowerCap only -> not throttled, but at power limit;
    # steps slow enough that data wait is small -> not data-bound; reserved 3.0 vs allocated 2.0 GiB -> memory pressure
    final = summary["final_verdict"]
    assert (final["kind"], final["qualifiers"]) == ("memory-pressure", ["at power limit"]), final
    assert "reserved 3.0 GiB vs allocated 2.0 GiB" in final["evidence"]
    assert entry["gpu0/power_capped_pct"] == 100 and entry["gpu0/throttled_pct"] == 0
    assert summary["throttle_reasons_seen"] == []
    assert summary["gpus"] == {"0": "NVIDIA A100-SXM4-40GB"}
    assert not sampler_threads() and not callback.sampler.running


def test_logs_dict_is_not_mutated(tmp_path):
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=4), train_dataset=TokenDataset())
    attach_telemetry(trainer, interval_s=0.05, write_report=False)
    trainer.train()
    loss_entries = [h for h in trainer.state.log_history if "loss" in h]
    assert loss_entries and not any(k.startswith(("loop/", "host/")) for h in loss_entries for k in h)


def test_a_report_that_cannot_be_written_warns_and_training_ends_normally(tmp_path, monkeypatch, caplog):
    import hf_gpu_train.report.writer as writer

    def broken(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(writer, "write_run_report", broken)
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=2), train_dataset=TokenDataset())
    attach_telemetry(trainer, interval_s=0.05)
    with caplog.at_level("WARNING", logger="hf_gpu_train.telemetry"):
        result = trainer.train()
    assert result.global_step == 2
    assert "the run report was not written (OSError: No space left on device)" in caplog.text


def test_thread_stops_when_training_raises(tmp_path):
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path), train_dataset=TokenDataset(fail_at=30))
    callback = attach_telemetry(trainer, interval_s=0.02, write_report=False)
    with pytest.raises(RuntimeError, match="broken sample"):
        trainer.train()
    assert not sampler_threads() and not callback.sampler.running


def test_sampler_errors_are_reported_once_and_sampling_goes_on(machine):
    from hf_gpu_train.callbacks.sampler import DeviceSampler

    backend = FakeNvmlBackend(machine("1x-t4"), failures={"temperature_c": "gpu_is_lost"})
    backend.init()
    sampler = DeviceSampler(backend, {0: 0}, interval_s=0.01)
    readings = [sampler.sample_now() for _ in range(5)]
    assert len(sampler.errors) == 1 and "temperature_c" in sampler.errors[0]
    assert all("temp_c" not in r.gpus[0] and "power_limit_w" in r.gpus[0] for r in readings)
    assert backend.calls["temperature_c"] == 1  # not asked again
    nvml_less = DeviceSampler(None, {}, interval_s=0.01)
    assert nvml_less.sample_now().host["ram_used_gib"] > 0


def test_cpu_by_accident_guard(tmp_path, machine):
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=1), train_dataset=TokenDataset(),
                      callbacks=[CpuByAccidentGuard(backend=FakeNvmlBackend(machine("1x-h200")))])
    with pytest.raises(TrainingOnCpuByAccident, match="1 GPU\\(s\\) visible \\(NVIDIA H200\\) but the model is on the CPU"):
        trainer.train()
    ok = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=1), train_dataset=TokenDataset(),
                 callbacks=[CpuByAccidentGuard(allow_cpu=True, backend=FakeNvmlBackend(machine("1x-h200")))])
    ok.train()
    none = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=1), train_dataset=TokenDataset(),
                   callbacks=[CpuByAccidentGuard(backend=FakeNvmlBackend(machine("cpu-only")))])
    none.train()


def token_total(dataset):
    return int(sum((dataset[i]["attention_mask"]).sum() for i in range(len(dataset))))


@pytest.mark.parametrize("case", ["plain", "trainer_counts_too", "accumulation", "oom_split_and_retry"])
def test_tokens_are_counted_once_without_the_trainer_counter(tmp_path, case):
    """One epoch over 64 padded samples: the windows' tokens add up to the data's non-padding tokens exactly,
    with include_num_input_tokens_seen off, on (not counted twice), under gradient accumulation, and when the
    OOM recovery splits a batch after an OOM in backward and retries it."""
    data = TokenDataset(n=64)
    kw = {"trainer_counts_too": dict(include_num_input_tokens_seen="non_padding"),
          "accumulation": dict(max_steps=4, gradient_accumulation_steps=2)}.get(case, {})
    model = tiny_bert()
    trainer = Trainer(model=model, args=tiny_args(tmp_path, **kw), train_dataset=data)
    if case == "oom_split_and_retry":
        injector = OOMFaultInjector(max_batch=4, phase="backward", times=1, start_after=2)
        injector.install(model)
        recovery = enable_oom_recovery(trainer)
    callback = attach_telemetry(trainer, interval_s=0.05)
    trainer.train()
    if case == "oom_split_and_retry":
        assert injector.raised == 1 and recovery.micro_batch == 4
    counted = sum(w["metrics"].get("loop/tokens", 0) for w in windows(tmp_path))
    assert counted == token_total(data)
    assert callback.records[0]["metrics"]["loop/tokens_per_s"] > 0
    if case == "trainer_counts_too":
        assert trainer.state.num_input_tokens_seen == counted


def test_throughput_is_training_time_only_not_an_evaluation_inside_the_window(tmp_path):
    """An evaluation that takes 0.5 s inside a 4-step window must not show up as a slower GPU."""

    class SlowEval(TokenDataset):
        def __getitem__(self, i):
            time.sleep(0.5 / len(self))
            return super().__getitem__(i)

    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=8, logging_steps=4, eval_strategy="steps",
                                                       eval_steps=2, per_device_eval_batch_size=8),
                      train_dataset=TokenDataset(), eval_dataset=SlowEval(n=8))
    callback = attach_telemetry(trainer, interval_s=0.05, write_report=False)
    trainer.train()
    first, second = ([r for r in callback.records if r["step"] == step][0] for step in (4, 8))
    wall_s = second["time"] - first["time"]  # the window from step 4 to 8 holds the evaluation at step 6
    metrics = second["metrics"]
    assert metrics["loop/steps"] == 4 and wall_s - metrics["loop/train_time_s"] >= 0.45
    assert metrics["loop/samples_per_s"] == pytest.approx(4 * 8 / metrics["loop/train_time_s"])
    assert metrics["loop/samples_per_s"] > 4 * 8 / (wall_s - 0.45)  # wall time would have counted the evaluation


def test_the_run_verdict_comes_from_the_last_full_window_not_a_one_step_tail(tmp_path, machine):
    """9 steps, a log every 4: windows of 4, 4 and a 1-step tail. Memory looks fragmented only in the tail;
    the run's verdict is the last full window's."""
    calls = []

    def memory(device):
        calls.append(device)
        return fake_memory(device, 2.0, 10.0 if len(calls) == 3 else 2.2)

    backend = FakeNvmlBackend(machine("2x-a100-one-busy"), series={"utilization_pct": [(95, 50)], "sm_clock_mhz": [1410]})
    trainer = Trainer(model=slow_forward(tiny_bert()), args=tiny_args(tmp_path, max_steps=9, logging_steps=4),
                      train_dataset=TokenDataset(n=72))
    callback = attach_telemetry(trainer, backend=backend, gpu_indices=[0], interval_s=0.02, memory_probe=memory)
    trainer.train()
    steps = [(r["step"], r["metrics"]["loop/steps"], r["full"], r["verdict"]["kind"]) for r in callback.records]
    assert steps == [(4, 4, True, "healthy"), (8, 4, True, "healthy"), (9, 1, False, "memory-pressure")]
    summary = json.loads((tmp_path / "telemetry_summary.json").read_text())
    assert summary["final_verdict"]["kind"] == "healthy" and callback.last_verdict.kind == "healthy"


def head(line: str) -> str:
    """The step line's first field without its clock, which is there ([mm:ss<mm:ss])."""
    first = line.split(" | ")[0]
    assert re.search(r" \[\d\d:\d\d<\d\d:\d\d\]$", first), line
    return re.sub(r" \[.*\]$", "", first)


@pytest.mark.parametrize("progress_bar, trainer_counts_tokens", [(False, False), (True, False), (False, True)])
def test_console_gets_one_compact_line_per_log_step(tmp_path, capsys, progress_bar, trainer_counts_tokens):
    extra = dict(include_num_input_tokens_seen="non_padding") if trainer_counts_tokens else {}  # adds train_* to loss logs
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=4, logging_steps=2, disable_tqdm=not progress_bar,
                                                       eval_strategy="steps", eval_steps=4, **extra),
                      train_dataset=TokenDataset(), eval_dataset=TokenDataset(n=8))
    sink = []

    class Sink(TelemetryCallback.__mro__[1]):  # stands for TensorBoard / any report_to sink
        def on_log(self, args, state, control, logs=None, **kw):
            sink.append(dict(logs))

    trainer.add_callback(Sink())
    attach_telemetry(trainer, interval_s=0.05, write_report=False)
    trainer.train()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    steps = [line for line in lines if line.startswith("step ")]
    assert [head(line) for line in steps] == ["step 2/4", "step 4/4"], lines
    for line in steps:
        fields = line.split(" | ")
        assert fields[1].startswith("loss ") and fields[2].startswith("lr ")
        assert fields[3].endswith(" samples/s") and fields[4].endswith(" tok/s") and fields[-1] == "healthy", line
    evals = [line.split(" | ") for line in lines if line.startswith("eval ")]
    assert len(evals) == 1 and len(evals[0]) == 3 and evals[0][0] == "eval step 4" and evals[0][1].startswith("loss "), evals
    assert evals[0][2].endswith(" s") and [line.split(" | ")[0] for line in lines if line.startswith("train")] == ["train done"]
    assert not any("{" in line or "gpu" in line or "host/" in line for line in lines), lines  # no logged dicts printed
    assert any("loop/tokens_per_s" in logs and "host/rss_gib" in logs for logs in sink)  # the sinks get everything


def test_compact_line_with_gpu_memory_and_mfu():
    from hf_gpu_train.callbacks.console import step_line, telemetry_parts

    metrics = {"loop/samples_per_s": 812.4, "loop/tokens_per_s": 52_300.0, "loop/mfu_pct": 38.2, "gpu0/mem_used_gib": 12.06,
               "gpu0/mem_total_gib": 79.65, "torch/mem_allocated_gib": 9.0}
    line = step_line(40, 500, {"loss": 0.41, "learning_rate": 3e-5, "epoch": 0.4, "grad_norm": 1.2, "mean_token_accuracy": 0.71},
                     telemetry_parts(metrics, "healthy, at power limit"))
    assert line == ("step 40/500 | loss 0.41 | lr 3.00e-05 | mean_token_accuracy 0.71 | 812 samples/s | 52.3k tok/s | MFU 38% | "
                    "mem 12.1/79.7 GiB | healthy, at power limit")


def test_attach_telemetry_brings_the_loss_scaling_guard(tmp_path):
    """A BERT classifier's mean loss must not be taken for a num_items-normalised one (tests/scaling)."""
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=1), train_dataset=TokenDataset())
    assert trainer.model_accepts_loss_kwargs  # what transformers 5 concludes from BERT's **kwargs
    attach_telemetry(trainer, write_report=False)
    trainer.train()
    assert trainer.model_accepts_loss_kwargs is False


@pytest.mark.parametrize("progress_bar", [False, True])
def test_the_callback_route_works_like_attach_telemetry(tmp_path, capsys, progress_bar):
    """Trainer(callbacks=[TelemetryCallback()]), the way most callbacks are given: metrics reach the report_to sinks
    (0 telemetry keys in log_history before this fix), the loss guard is on and the console is compact."""
    from transformers.integrations.integration_utils import rewrite_logs

    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=4, logging_steps=2, disable_tqdm=not progress_bar),
                      train_dataset=TokenDataset(), callbacks=[TelemetryCallback(interval_s=0.05, write_report=False)])
    trainer.train()
    telemetry = [h for h in trainer.state.log_history if "loop/tokens_per_s" in h]
    assert len(telemetry) == 2 and "host/rss_gib" in telemetry[0]
    assert getattr(trainer, "_hf_gpu_train_loss_guard", None) is not None
    assert trainer.model_accepts_loss_kwargs is False  # the guard asked BERT's loss: a mean
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [head(line) for line in steps] == ["step 2/4", "step 4/4"] and all("tok/s" in s for s in steps)
    tags = rewrite_logs(telemetry[0])  # what TensorBoard and W&B write: their own "train/" prefix, once
    assert "train/loop/tokens_per_s" in tags and not any(t.startswith("train/train/") for t in tags)


def test_the_callback_route_without_a_trainer_on_the_stack_fails_with_the_fix():
    from hf_gpu_train.callbacks.telemetry import TelemetryNotAttached

    with pytest.raises(TelemetryNotAttached, match=r"attach_telemetry\(trainer\)"):
        TelemetryCallback()._attach_late(None)


def test_the_callback_added_after_the_printer_closes_its_progress_bar(tmp_path, capsys):
    """trainer.add_callback(TelemetryCallback()) puts telemetry after the Trainer's ProgressCallback, whose
    on_train_begin has already drawn the bar when the compact printer takes its place: the bar is closed and the lines
    are the one display (issue 20: not a bar with lines written through it)."""
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=4, logging_steps=2, disable_tqdm=False),
                      train_dataset=TokenDataset())
    trainer.add_callback(TelemetryCallback(interval_s=0.05, write_report=False))
    trainer.train()
    assert len([h for h in trainer.state.log_history if "loop/tokens_per_s" in h]) == 2
    captured = capsys.readouterr()
    assert re.search(r"step 4/4 \[\d\d:\d\d<00:00\] \| loss", captured.out)
    assert "| 1/4 [" not in captured.err and "| 4/4 [" not in captured.err  # the bar never moved past its first frame


def test_with_attach_telemetry_a_trainer_that_shows_a_bar_shows_the_lines_alone(tmp_path, capsys):
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=4, logging_steps=2, disable_tqdm=False),
                      train_dataset=TokenDataset())
    attach_telemetry(trainer, interval_s=0.05, write_report=False)
    trainer.train()
    captured = capsys.readouterr()
    assert re.search(r"step 2/4 \[\d\d:\d\d<\d\d:\d\d\] \| loss", captured.out)
    assert "it/s" not in captured.out + captured.err  # tqdm's bar never drawn


def test_the_clock_reads_like_tqdms():
    from hf_gpu_train.callbacks.console import clock, progress

    assert (clock(72), clock(220), clock(3725)) == ("01:12", "03:40", "1:02:05")
    assert progress(40, 500, 72.0, 40) == " [01:12<13:48]"  # 460 steps left at 1.8 s a step
    assert progress(40, None, 72.0, 40) == " [01:12]" and progress(40, 500, None, 40) == ""


def test_a_gpu_health_event_during_the_run_is_said_once_with_the_rank(tmp_path, machine, caplog):
    """Issue 39, item 2: an XID the driver reports mid-run, and a row remap that becomes pending, reach telemetry.jsonl,
    the summary and the log once each, with the rank; what the GPU had before the run is not news."""
    backend = FakeNvmlBackend(machine("1x-h200"))
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=8), train_dataset=TokenDataset())
    attach_telemetry(trainer, backend=backend, gpu_indices=[0], interval_s=0.02, memory_probe=fake_memory, health_every_s=0.02)

    class GpuFallsSick(TelemetryCallback.__mro__[1]):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                backend.inject_xid(backend.handle(0), 48)
                backend.set_health(backend.handle(0), row_remap_pending=True)
            if state.global_step in (3, 6):
                time.sleep(0.2)  # the sampler's next health reading
            return control

    trainer.add_callback(GpuFallsSick())
    with caplog.at_level(logging.WARNING, logger="hf_gpu_train.telemetry"):
        trainer.train()
    events = [e for w in windows(tmp_path) for e in w.get("gpu_health", [])]
    assert sorted(e["kind"] for e in events) == ["row_remap_pending", "xid"], events
    assert all(e["rank"] == 0 and e["gpu"] == 0 for e in events)
    assert "XID 48" in next(e["message"] for e in events if e["kind"] == "xid")
    said = [r.getMessage() for r in caplog.records if "XID 48" in r.getMessage()]
    assert len(said) == 1 and "rank 0" in said[0] and "Fix:" in said[0]
    summary = json.loads((tmp_path / "telemetry_summary.json").read_text())
    assert [e["kind"] for e in summary["gpu_health"]] == [e["kind"] for e in events]
