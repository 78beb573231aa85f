import json
import threading

import pytest
from transformers import Trainer

from hf_gpu_train.callbacks import CpuByAccidentGuard, TelemetryCallback, TrainingOnCpuByAccident, attach_telemetry
from hf_gpu_train.hardware.fake import FakeNvmlBackend

from .tiny import TokenDataset, tiny_args, tiny_bert

SERIES = {
    "utilization_pct": [(40, 10), (60, 20), (95, 50)],
    "power_usage_mw": [150_000, 250_000, 350_000],
    "temperature_c": [55, 60, 65],
    "sm_clock_mhz": [1410],
    "memory_info_used": [10 * 2**30],
}


def sampler_threads():
    return [t for t in threading.enumerate() if t.name == "hf_gpu_train-telemetry"]


def fake_memory(device):
    return {"torch/mem_allocated_gib": 2.0, "torch/mem_reserved_gib": 3.0, "torch/mem_peak_gib": 2.5,
            "torch/reserved_minus_allocated_gib": 1.0, "torch/alloc_retries": 0.0, "torch/ooms": 0.0}


def test_real_trainer_with_fake_nvml_logs_units_values_and_report(tmp_path, machine):
    backend = FakeNvmlBackend(machine("2x-a100-one-busy"), series=SERIES)
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path), train_dataset=TokenDataset())
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
                "train/step_time_s", "train/samples_per_s", "train/tokens_per_s", "train/data_wait_pct",
                "torch/mem_allocated_gib", "torch/mem_reserved_gib", "torch/alloc_retries"):
        assert key in entry, key
    assert entry["gpu0/util_pct_max"] == 95 and entry["gpu0/power_w_max"] == 350.0
    assert entry["gpu0/power_limit_w"] == 400.0 and entry["gpu0/mem_used_gib"] == 10.0 and entry["gpu0/temp_c_max"] == 65
    assert 0 <= entry["train/data_wait_pct"] <= 100
    assert "train/mfu_pct" not in entry  # the model is on the CPU: no peak to compare with
    assert any("gpu0/util_pct" in logs for logs in logs_seen)  # went through the Trainer's own logging
    # report files written, thread stopped
    for name in ("telemetry.jsonl", "telemetry_summary.json", "report.md", "telemetry_utilization.png", "telemetry_power.png"):
        assert (tmp_path / name).is_file(), name
    summary = json.loads((tmp_path / "telemetry_summary.json").read_text())
    assert summary["final_verdict"]["kind"] in ("healthy", "under-utilized", "data-bound", "memory-pressure")
    assert summary["gpus"] == {"0": "NVIDIA A100-SXM4-40GB"}
    assert not sampler_threads() and not callback.sampler.running


def test_logs_dict_is_not_mutated(tmp_path):
    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path, max_steps=4), train_dataset=TokenDataset())
    attach_telemetry(trainer, interval_s=0.05, write_report=False)
    trainer.train()
    loss_entries = [h for h in trainer.state.log_history if "loss" in h]
    assert loss_entries and not any(k.startswith(("train/", "host/")) for h in loss_entries for k in h)


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
