"""Straggler attribution by arrival (callbacks/arrivals.py): the pure attribution, one step's split, the verdict's
persistence, the report's picture, and 2 gloo processes with a delay in one rank's data, forward, backward, optimizer
step or host work (and none)."""

import json
from pathlib import Path

import pytest

from hf_gpu_train.callbacks.arrivals import COLUMNS, Mark, PhaseClock, StragglerWatch, _Step, attribute, split_step
from hf_gpu_train.report.plots import draw_rank_timeline
from tests.launching import cpu_config, launch


def row(steps=5, wait=10.0, units=0, **phases):
    """Per-step milliseconds -> a rank's sums in seconds over ``steps`` steps (period: the phases and the wait);
    ``units``: the work per step (0: not counted)."""
    per = {"data": 1.0, "forward": 4.0, "backward": 4.0, "optimizer": 1.0, "host": 0.5, **phases}
    per["wait"] = wait
    per["period"] = sum(per.values())
    return {**{k: steps * v / 1000 for k, v in per.items()}, "units": float(steps * units), "steps": float(steps)}


def test_the_late_rank_is_the_one_with_the_long_phase_and_the_short_wait():
    # rank 2's backward is 60 ms longer; the others wait for it at the gradient all-reduce
    rows = [row(wait=70.0), row(wait=71.0), row(backward=64.0, wait=10.0), row(wait=69.0)]
    finding = attribute(rows)
    assert (finding.rank, finding.phase) == (2, "backward")
    assert finding.excess_s == pytest.approx(0.060) and finding.waited_less_s == pytest.approx(0.060)  # the others median 70 ms, it 10


def test_a_longer_phase_that_the_others_did_not_wait_for_is_not_a_straggler():
    # rank 1's forward is longer, but it waited as long as rank 0: something both wait on (an FSDP all-gather, noise)
    assert attribute([row(wait=40.0), row(forward=30.0, wait=40.0)]) is None
    # below 15% of the step: noise on a shared host
    assert attribute([row(wait=12.0), row(forward=6.0, wait=10.0)]) is None
    assert attribute([row()]) is None  # one rank: nobody to compare with
    assert attribute([row(), row(steps=0)]) is None


def test_one_step_is_split_into_own_work_and_waiting():
    m = lambda t, waited=0.0: Mark(t, waited)  # noqa: E731
    step = _Step(begin=m(1.020), fetch=(m(1.000), m(1.010), m(1.018)), forwards=[(m(1.025), m(1.045))],
                 last_grads=[m(1.085)], optimizer=(m(1.100), m(1.104)))
    # 2 ms in our own collectives (the flag agreement) after the previous step's end, before the fetch
    split = split_step(step, m(0.990, waited=0.0), m(1.110, waited=0.002))
    assert split["period"] == pytest.approx(0.120)
    assert split["data"] == pytest.approx(0.010) and split["forward"] == pytest.approx(0.020)
    assert split["backward"] == pytest.approx(0.040) and split["optimizer"] == pytest.approx(0.004)
    # ours 2 ms + the item count 8 ms + to the forward 7 ms + the gradient all-reduce's end 15 ms
    assert split["wait"] == pytest.approx(0.032)
    assert split["host"] == pytest.approx(0.120 - 0.010 - 0.020 - 0.040 - 0.004 - 0.032)
    # a loop without get_batch_samples: the gap before the step is its loading
    step.fetch = None
    split = split_step(step, m(0.990), m(1.110))
    assert split["data"] == pytest.approx(0.030) and split["wait"] == pytest.approx(0.005 + 0.015)


def test_the_clock_keeps_one_gradient_hook_after_the_first_backward():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    clock = PhaseClock(torch.device("cpu")).install(None, model)
    assert len(clock._handles) == 2 + 4
    for _ in range(2):
        clock.step_begin()
        model(torch.randn(2, 4)).sum().backward()
        clock.optimizer_begins()
        clock.optimizer_ends()
        clock.step_end()
    assert len(clock._handles) == 3  # the forward hooks and the first layer's last-computed gradient
    sums = clock.take()
    assert sums["steps"] == 1 and sums["forward"] > 0  # the first step is left out and sums["backward"] > 0
    assert set(sums) == set(COLUMNS)
    clock.remove()
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_named_after_three_exchanges_in_a_row_and_cleared_after_two_without():
    watch = StragglerWatch(clock=None, check_steps=5)
    slow = attribute([row(wait=70.0), row(data=61.0, wait=10.0)])
    assert watch._judge(5, slow, True) is None and watch._judge(10, slow, True) is None and watch.named is None
    assert watch._judge(15, slow, True)["since_step"] == 15
    assert watch._judge(20, slow, True) is None and watch.named["since_step"] == 15  # said once
    assert watch._judge(25, None, True) is None and watch.named is not None
    watch._judge(30, None, True)
    assert watch.named is None
    for step in (35, 40, 50, 55):  # twice in a row, a gap, twice again: noise, never named
        watch._judge(step, slow, True)
        if step == 40:
            watch._judge(45, None, True)
    assert watch.named is None


def test_a_rank_given_longer_rows_is_slower_but_not_a_straggler():
    """Dynamic padding: rank 1's rows were twice as long in this window, its forward and backward took twice as long
    and rank 0 waited for it. Per unit of work it is as fast: nothing is flagged. Twice as slow per unit: flagged."""
    longer = [row(wait=18.0, units=64), row(forward=8.0, backward=8.0, wait=10.0, units=128)]
    assert attribute(longer) is None
    sick = [row(wait=18.0, units=64), row(forward=12.0, wait=10.0, units=64)]  # 3x as slow per unit in its forward
    assert (attribute(sick).rank, attribute(sick).phase) == (1, "forward")
    # on CUDA the host phase is not named (a device wait blocks the host later): the same window names nothing there
    host = [row(wait=70.0), row(host=61.0, wait=10.0)]
    assert attribute(host).phase == "host" and attribute(host, phases=("data", "forward", "backward", "optimizer")) is None


def test_the_report_draws_each_ranks_step(tmp_path):
    assert draw_rank_timeline(tmp_path, []) is None
    per = lambda **p: {k: v / 5 for k, v in row(**p).items() if k != "steps"}  # noqa: E731
    arrivals = [{"step": 5, "ranks": [per(), per()], "finding": None},
                {"step": 10, "ranks": [per(wait=70.0), per(data=61.0, wait=10.0)],
                 "finding": {"rank": 1, "phase": "data", "excess_ms": 60.0}},
                {"step": 15, "ranks": [per(), per()], "finding": None}]
    svg = draw_rank_timeline(tmp_path, arrivals).read_text()
    assert "exchange at step 10: rank 1 slow in data" in svg and "rank 1 *" in svg
    assert "<title>data: 61.0 ms</title>" in svg


@pytest.mark.slow
def test_two_gloo_processes_name_the_delayed_rank_and_phase_and_nothing_without_a_delay(tmp_path):
    """Issue 39, item 1: 60 ms per step on rank 1 from step 10, in one phase per run. Each is named with its phase within
    20 steps (three exchanges, every 5 steps); rank 0 never is; the run without a delay names nobody."""
    out = tmp_path / "run"
    cases = ("none", "data", "forward", "backward", "optimizer", "host")
    run = launch(cpu_config(tmp_path), Path(__file__).with_name("straggler_probe.py"), str(out), *cases, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    for case in cases:
        for rank in (0, 1):
            seen = json.loads((out / case / f"rank-{rank}.json").read_text())
            named = {(n["rank"], n["phase"], n["since_step"]) for n in seen["named"]}
            if case == "none":
                assert named == set(), (case, seen["findings"])
                continue
            assert {(r, p) for r, p, _ in named} == {(1, case)}, (case, seen["findings"])
            assert all(10 < since <= 10 + 20 for _, _, since in named), (case, named)
            assert all(f is None or f["rank"] == 1 for step, f in seen["findings"] if step > 10), (case, seen["findings"])
    assert "straggler: rank 1 is slow in backward" in run.stderr
