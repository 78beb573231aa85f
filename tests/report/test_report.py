import json

from hf_gpu_train.callbacks.sampler import Sample
from hf_gpu_train.callbacks.verdicts import Verdict
from hf_gpu_train.cli import main
from hf_gpu_train.report.writer import write_run_report


def test_report_command_redraws_and_prints_the_verdict(tmp_path, capsys):
    samples = [Sample(t=float(i), gpus={0: {"util_pct": 90 + i, "power_w": 300.0, "temp_c": 70 + i, "mem_used_gib": 20.0,
                                            "sm_clock_mhz": 1400 - 50 * i, "sm_clock_max_mhz": 1410,
                                            "throttle_reasons": ["HwThermalSlowdown"] if i > 2 else []}},
                      host={"cpu_pct": 20.0}) for i in range(5)]
    records = [{"step": 10 * i, "time": float(i), "final": False, "throttle_reasons": {"0": ["HwThermalSlowdown"]} if i else {},
                "metrics": {"loop/samples_per_s": 100.0 - i, "loop/data_wait_pct": 2.0, "torch/mem_allocated_gib": 10.0,
                            "torch/mem_reserved_gib": 12.0, "gpu0/util_pct": 92.0},
                "verdict": {"kind": "throttled", "evidence": "e", "next_step": "n", "notes": []}} for i in range(3)]
    write_run_report(tmp_path, samples, records, Verdict("throttled", "clocks held back", "improve cooling"), {0: "NVIDIA H100"})
    for name in ("telemetry_utilization.svg", "telemetry_temperature.svg", "telemetry_clocks.svg", "telemetry_torch_memory.svg",
                 "telemetry_throughput.svg", "report.md"):
        (tmp_path / name).unlink()
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "verdict: throttled: clocks held back. Next: improve cooling" in out and "HwThermalSlowdown" in out
    assert (tmp_path / "telemetry_clocks.svg").is_file() and "telemetry_clocks.svg" in (tmp_path / "report.md").read_text()
    summary = json.loads((tmp_path / "telemetry_summary.json").read_text())
    assert summary["metrics"]["loop/samples_per_s"]["max"] == 100.0


def test_power_limit_is_reported_as_such_not_as_throttling(tmp_path):
    from hf_gpu_train.report.writer import load_run, render_terminal_summary

    samples = [Sample(t=float(i), gpus={0: {"util_pct": 99, "power_w": 698.0, "throttle_reasons": ["SwPowerCap"]}}) for i in range(3)]
    records = [{"step": 10, "time": 1.0, "final": False, "throttle_reasons": {}, "metrics": {"gpu0/power_capped_pct": 80.0},
                "verdict": {"kind": "healthy", "evidence": "e", "next_step": "n", "notes": [], "qualifiers": ["at power limit"]}}]
    write_run_report(tmp_path, samples, records, Verdict("healthy", "GPU busy", "nothing to change", qualifiers=("at power limit",)),
                     {0: "NVIDIA H200"})
    text = render_terminal_summary(load_run(tmp_path)[2])
    assert "gpu0 at power limit (SwPowerCap, not throttling) in 80% of readings" in text
    assert "verdict: healthy, at power limit: GPU busy" in text and "throttling seen" not in text


def test_the_report_shows_the_launch_plan_next_to_the_measured_peak(tmp_path):
    import json

    from hf_gpu_train.report.writer import render_plan_section

    plan = {"file": "box.plan.json", "machine": "1x-h200", "strategy": "single", "found_by": "HF_GPU_TRAIN_PLAN",
            "values": {"per_device_train_batch_size": {"plan": 64, "used": 32, "reason": "largest that fits"}},
            "overridden": [{"key": "per_device_train_batch_size", "plan_value": 64, "user_value": 32, "source": "config"}],
            "memory": {"estimate_bytes": 10 * 2**30, "usable_bytes": 120 * 2**30, "measured_peak_bytes": 11 * 2**30,
                       "measured": "torch.cuda.max_memory_reserved", "error_pct": 10.0}}
    text = "\n".join(render_plan_section(json.loads(json.dumps(plan))))
    assert "| per_device_train_batch_size | 64 | 32 | largest that fits |" in text
    assert "overridden by config: per_device_train_batch_size=32 over the plan's 64" in text
    assert "planner 10.00 GiB per process" in text and "measured peak 11.00 GiB" in text and "error +10.0%" in text


def test_the_clock_panel_ignores_a_maximum_that_is_not_a_number(tmp_path):
    from hf_gpu_train.report.plots import draw_all

    samples = [{"t": float(i), "gpus": {"0": {"sm_clock_mhz": 1400.0 - i, "sm_clock_max_mhz": m}}}
               for i, m in enumerate([float("nan"), 1410.0, float("inf")])]
    (path,) = draw_all(tmp_path, samples, [])
    assert path.name == "telemetry_clocks.svg" and "max SM clock" in path.read_text() and "nan" not in path.read_text()


def test_a_run_recorded_with_the_old_train_keys_reads_as_loop_keys():
    from hf_gpu_train.report.writer import renamed_loop_keys

    assert renamed_loop_keys({"train/samples_per_s": 3.0, "gpu0/util_pct": 50.0}) == {"loop/samples_per_s": 3.0,
                                                                                     "gpu0/util_pct": 50.0}
