from hf_gpu_train.callbacks.sampler import Sample
from hf_gpu_train.callbacks.verdicts import WindowStats, judge, speed_trend
from hf_gpu_train.callbacks.window import LoopTimer, summarize_samples

HEALTHY = dict(on_gpu=True, gpu_util_pct=97, data_wait_pct=2, throttled_pct=0, sm_clock_mhz=1980, sm_clock_max_mhz=1980,
               reserved_gib=40, allocated_gib=38, samples_per_s=100, dataloader_workers=4, micro_batch=32)


def test_healthy():
    v = judge(WindowStats(**HEALTHY))
    assert v.kind == "healthy" and "97%" in v.evidence


def test_data_bound_names_the_worker_count():
    v = judge(WindowStats(**{**HEALTHY, "gpu_util_pct": 35, "data_wait_pct": 55, "dataloader_workers": 2}))
    assert v.kind == "data-bound" and "55%" in v.evidence and "from 2 to 4" in v.next_step and "pin_memory" in v.next_step


def test_throttled_thermal_and_hardware_slowdown():
    hot = judge(WindowStats(**{**HEALTHY, "throttled_pct": 80, "sm_clock_mhz": 1300, "throttle_reasons": frozenset({"HwThermalSlowdown"}),
                               "temp_c": 92}))
    assert hot.kind == "throttled" and "HwThermalSlowdown" in hot.evidence and "cooling" in hot.next_step
    for reason in ("HwSlowdown", "HwPowerBrakeSlowdown"):
        braked = judge(WindowStats(**{**HEALTHY, "throttled_pct": 60, "sm_clock_mhz": 1100, "throttle_reasons": frozenset({reason})}))
        assert braked.kind == "throttled" and reason in braked.evidence and "power cables" in braked.next_step
    # reasons at full clock are not throttling
    assert judge(WindowStats(**{**HEALTHY, "throttled_pct": 60, "throttle_reasons": frozenset({"HwSlowdown"})})).kind == "healthy"


def test_at_the_power_limit_under_full_load_is_not_throttling():
    capped = judge(WindowStats(**{**HEALTHY, "power_capped_pct": 90, "sm_clock_mhz": 1500, "power_w": 698, "power_limit_w": 700}))
    assert capped.kind == "healthy" and capped.qualifiers == ("at power limit",)
    assert capped.label() == "healthy, at power limit"
    assert any("at power limit" in n and "90%" in n and "698 W of 700 W" in n for n in capped.notes)
    # a power-capped GPU that is also starved keeps the verdict that matters, with the note
    starved = judge(WindowStats(**{**HEALTHY, "power_capped_pct": 90, "sm_clock_mhz": 1500, "data_wait_pct": 45}))
    assert starved.kind == "data-bound" and starved.qualifiers == ("at power limit",)
    # thermal throttling beside the power cap is still throttling
    both = judge(WindowStats(**{**HEALTHY, "power_capped_pct": 90, "throttled_pct": 50, "sm_clock_mhz": 1200,
                                "throttle_reasons": frozenset({"SwThermalSlowdown"})}))
    assert both.kind == "throttled" and both.qualifiers == ("at power limit",)
    # a few capped readings are not worth a note
    assert judge(WindowStats(**{**HEALTHY, "power_capped_pct": 5})).qualifiers == ()


def test_memory_pressure_from_retries_or_fragmentation():
    retries = judge(WindowStats(**{**HEALTHY, "alloc_retries_delta": 3}))
    assert retries.kind == "memory-pressure" and "expandable_segments:True" in retries.next_step
    gap = judge(WindowStats(**{**HEALTHY, "reserved_gib": 40, "allocated_gib": 20}))
    assert gap.kind == "memory-pressure" and "20.0 GiB cached but unused" in gap.evidence


def test_under_utilized_uses_the_planner_suggestion():
    v = judge(WindowStats(**{**HEALTHY, "gpu_util_pct": 40, "data_wait_pct": 3, "suggested_micro_batch": 128}))
    assert v.kind == "under-utilized" and "from 32 to 128" in v.next_step


def test_cpu_run_is_healthy_unless_starved():
    assert judge(WindowStats(on_gpu=False, data_wait_pct=5)).kind == "healthy"
    assert judge(WindowStats(on_gpu=False, data_wait_pct=40, dataloader_workers=0)).kind == "data-bound"


def test_speed_falling_is_called_out_with_the_cause():
    series = [WindowStats(**{**HEALTHY, "samples_per_s": s}) for s in (100, 102, 101)]
    assert speed_trend(series) is None
    series.append(WindowStats(**{**HEALTHY, "samples_per_s": 70, "throttle_reasons": frozenset({"HwThermalSlowdown"}), "data_wait_pct": 30}))
    note = speed_trend(series)
    assert "fell 31%" in note and "HwThermalSlowdown" in note and "data wait rose" in note


def test_loop_timer_measures_the_gap_and_excludes_logging():
    t = LoopTimer()
    t.step_begin(0.0)
    t.step_end(1.0)
    t.step_begin(1.5)  # 0.5 s fetching
    t.step_end(2.5)
    t.pause_end(4.0)  # logging/eval took until 4.0: not data wait
    t.step_begin(4.1)
    t.step_end(5.1)
    out = t.take()
    assert out["loop/step_time_s"] == 1.0 and out["loop/steps"] == 3
    assert abs(out["loop/data_wait_s"] - 0.6) < 1e-9
    assert abs(out["loop/data_wait_pct"] - 100 * 0.6 / 3.6) < 1e-9
    assert abs(out["loop/train_time_s"] - 3.6) < 1e-9  # steps and the gaps before them; the 1.5 s pause is not training
    assert t.take() == {}


def test_summarize_samples_means_maxima_and_throttling():
    samples = [Sample(t=i, gpus={0: {"util_pct": u, "throttle_reasons": r}}, host={"cpu_pct": 10.0})
               for i, (u, r) in enumerate([(50, ["GpuIdle"]), (100, ["SwPowerCap"]), (90, ["SwPowerCap", "HwSlowdown"]), (95, [])])]
    metrics, reasons = summarize_samples(samples)
    assert metrics["gpu0/util_pct"] == 83.75 and metrics["gpu0/util_pct_max"] == 100
    assert metrics["gpu0/throttled_pct"] == 25 and reasons == {0: {"HwSlowdown"}}
    assert metrics["gpu0/power_capped_pct"] == 50
