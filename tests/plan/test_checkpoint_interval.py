"""The checkpoint interval from measured cost (issue 38, item 2): Young/Daly's optimum, checked against the expected
cost it minimises, the default time between failures by GPU count, the floor of a background write and the cap."""

from __future__ import annotations

import math

import pytest

from hf_gpu_train.plan.checkpoint_interval import (
    CAP_MINUTES,
    GPU_DAYS_PER_FAILURE,
    default_mtbf_hours,
    optimal_interval_s,
    plan_interval,
)


def expected_waste(tau: float, c: float, m: float) -> float:
    """Daly's expected wall time per unit of work, restart time 0: saving every tau of work, failures every m."""
    return m * math.exp(c / m) * (math.exp((tau + c) / m) - 1) / tau


@pytest.mark.parametrize("c, m", [(1.0, 3600.0), (30.0, 86400.0), (0.05, 3.6e6), (600.0, 3600.0)])
def test_the_interval_minimises_the_expected_time_of_saves_plus_lost_work(c, m):
    tau = optimal_interval_s(c, m)
    grid = [tau * f for f in (0.5, 0.7, 0.9, 0.97, 1.03, 1.1, 1.4, 2.0)]
    best = expected_waste(tau, c, m)
    assert all(best <= expected_waste(t, c, m) * (1 + 2e-3) for t in grid)
    if c < m / 100:
        assert tau == pytest.approx(math.sqrt(2 * c * m), rel=0.05)  # Young's first order


def test_a_save_longer_than_twice_the_mtbf_checkpoints_every_mtbf_and_a_free_one_never_waits():
    assert optimal_interval_s(10.0, 4.0) == 4.0
    assert optimal_interval_s(0.0, 100.0) == 0.0


def test_the_default_time_between_failures_shrinks_with_the_gpu_count():
    assert default_mtbf_hours(1) == pytest.approx(GPU_DAYS_PER_FAILURE * 24)
    assert default_mtbf_hours(16) == pytest.approx(default_mtbf_hours(1) / 16)
    plan = plan_interval(5.0, None, 1024)
    assert "1024 GPUs" in plan.mtbf_source and "Llama 3" in plan.mtbf_source and "1024 GPUs" in plan.line()


def test_a_background_write_is_the_floor_and_the_cap_is_said():
    assert plan_interval(0.01, 1.0, 8, write_s=120.0).interval_s == 120.0  # never two writes in flight
    long = plan_interval(30.0, None, 1)
    assert long.capped and long.interval_s == CAP_MINUTES * 60 and "capped" in long.line()
    short = plan_interval(2.0, 2.0, 64)
    assert not short.capped and short.saving_fraction == pytest.approx(2.0 / short.interval_s)
    assert short.expected_loss_per_failure_s == pytest.approx(short.interval_s / 2)


def test_the_staging_of_a_background_save_is_the_state_its_largest_writer_holds():
    from hf_gpu_train.plan.checkpoint_interval import staging_bytes
    from hf_gpu_train.plan.memory import MemoryBreakdown

    def breakdown(strategy, **rows):
        values = dict(weights=4e9, gradients=4e9, optimizer=8e9, master_weights=0, comm_buffers=1e8, gathered_params=0,
                      activations=2e9, context=5e8)
        return MemoryBreakdown(strategy, **{**values, **rows})

    assert staging_bytes(breakdown("ddp"), 8) == 12e9  # weights and Adam's moments; not gradients or activations
    assert staging_bytes(breakdown("ddp", adapter_weights=1e7, optimizer=2e7, method="lora"), 8) == 3e7  # adapters only
    assert staging_bytes(breakdown("fsdp"), 8) == 12e9  # its shards (the per-GPU breakdown): DCP's async_save stages them
    # ZeRO-3 on 8 GPUs: 16-bit weights 1/8 per GPU; rank 0 stages the whole 16-bit model twice and its partition
    zero3 = breakdown("deepspeed-zero3", weights=1e9, optimizer=1e9, master_weights=0.5e9)
    assert staging_bytes(zero3, 8) == 1.5e9 + 2 * 8e9
