"""The search on a simulated machine: what it tries, in which order, where it stops, and what wins."""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from hf_gpu_train.tune.results import SKIPPED, choose
from hf_gpu_train.tune.search import run_search
from tests.tune.simulated import Machine, space


def tried(machine: Machine) -> list[tuple]:
    return [(c.micro_batch, c.gradient_checkpointing, c.dataloader_num_workers, c.precision) for c in machine.calls]


def search(sp, machine: Machine, budget_s: float = 1000.0, **kw):
    outcome = run_search(sp, budget_s, machine.run, **kw)
    return outcome, choose(outcome.results, sp.metric, sp.base)


def test_from_the_top_it_finds_the_largest_micro_batch_under_the_limit_and_never_picks_one_that_ran_out():
    sp = space(per_process=32)  # no plan: starts at the recipe's 32
    m = Machine(oom_above=12)
    outcome, choice = search(sp, m)
    # 32 ran out (the recovery failed at 32 and 16, rescued at 8): 16 is never tried; 8 fits; 4 (half) is slower;
    # checkpointing at 16 fits but is slower than 8 without it, so the ladder with checkpointing stops there
    assert tried(m) == [(32, False, 0, "fp32"), (8, False, 0, "fp32"), (4, False, 0, "fp32"), (16, True, 0, "fp32")]
    assert outcome.results[0].status == "oom" and outcome.results[0].samples_per_s > outcome.results[1].samples_per_s
    assert choice.winner.candidate.micro_batch == 8 and not choice.winner.candidate.gradient_checkpointing
    assert all(c.micro_batch * c.accumulation == 32 for c in m.calls)  # the effective batch never changes
    assert "not eligible: micro-batch 32 x 1" in choice.reasons[-1] and "oom (rescued at 8)" in choice.reasons[-1]


def test_it_climbs_from_the_planner_value_while_the_gain_beats_the_noise():
    sp = space(per_process=128, start=4)
    m = Machine(oom_above=128, half_speed_micro=1.0)  # speed m / (m + 1): +11%, +5.9%, +3.03%, +1.5% per doubling
    outcome, choice = search(sp, m)
    assert [c.micro_batch for c in m.calls] == [4, 8, 16, 32, 64]  # 3.03% beats the 3% floor, 1.5% does not: 128 untried
    assert "micro-batch 64 is not faster than 32 by more than the noise" in outcome.notes[0]
    assert choice.winner.candidate.micro_batch == 64  # the fastest measured; both fit, neither asks more

    noisy = Machine(oom_above=128, half_speed_micro=1.0, jitter=0.15)  # paired noise far above 3%: it stops sooner
    search(space(per_process=128, start=4), noisy)
    assert [c.micro_batch for c in noisy.calls] == [4, 8, 2]  # 8 is not surely faster: 4 stays, and half of it is tried


def test_below_the_start_it_goes_down_while_a_smaller_micro_batch_is_faster():
    @dataclass
    class Thrashing(Machine):
        def run(self, c, warmup=2, measure=4):  # near the memory limit the allocator retries: 32 and 16 are slow
            result = Machine.run(self, c, warmup, measure)
            slow = {32: 0.5, 16: 0.8}.get(c.micro_batch, 1.0)
            return replace(result, samples_per_s=result.samples_per_s * slow, tokens_per_s=result.tokens_per_s * slow,
                           step_times_s=tuple(t / slow for t in result.step_times_s))

    m = Thrashing(oom_above=32, half_speed_micro=1.0)
    outcome, choice = search(space(per_process=32, start=32), m)
    assert [c.micro_batch for c in m.calls][:4] == [32, 16, 8, 4]  # 16 and 8 faster each time; 4 is not
    assert choice.winner.candidate.micro_batch == 8
    assert "micro-batch 16 is faster than 32: going down" in outcome.notes


def test_checkpointing_is_tried_only_where_memory_stopped_the_ladder_and_kept_when_the_larger_batch_pays():
    m = Machine(oom_above=8, ckpt_factor=4, ckpt_cost=0.1, half_speed_micro=16.0)
    _, choice = search(space(per_process=64, start=8), m)
    assert tried(m) == [(8, False, 0, "fp32"), (16, False, 0, "fp32"), (4, False, 0, "fp32"), (16, True, 0, "fp32"),
                        (32, True, 0, "fp32"), (64, True, 0, "fp32")]
    assert (choice.winner.candidate.micro_batch, choice.winner.candidate.gradient_checkpointing) == (32, True)

    unlimited = Machine(oom_above=64, half_speed_micro=1.0)
    outcome, _ = search(space(per_process=64, start=4), unlimited)
    assert not any(c.gradient_checkpointing for c in unlimited.calls)
    assert any(n.startswith("checkpointing: not tried: memory did not stop the micro-batch ladder") for n in outcome.notes)


def test_the_planner_prunes_what_it_says_cannot_fit():
    def planner(values):
        limit = 32 if values["gradient_checkpointing"] else 8
        return SimpleNamespace(fits=values["per_device_train_batch_size"] <= limit, estimate_bytes=1, usable_bytes=1)

    sp = space(per_process=32, memory_check=planner)
    m = Machine(oom_above=64, ckpt_cost=0.5)
    outcome, choice = search(sp, m)
    assert tried(m) == [(8, False, 0, "fp32"), (4, False, 0, "fp32"), (16, True, 0, "fp32")]  # no climb past the planner
    assert "the planner says micro-batch 16 does not fit; 8 is the largest it allows" in outcome.notes[0]
    assert [(v.micro_batch, v.gradient_checkpointing) for v in sp.pruned()] == [(16, False), (32, False)]
    assert choice.winner.candidate.micro_batch == 8


def test_workers_are_tried_when_the_best_waited_for_data_and_the_faster_wins():
    waiting = Machine(oom_above=64, data_wait=((0, 0.4), (2, 0.05)))
    _, choice = search(space(per_process=16), waiting)
    assert [(c.micro_batch, c.dataloader_num_workers) for c in waiting.calls] == [(16, 0), (8, 0), (16, 2)]
    assert choice.winner.candidate.dataloader_num_workers == 2

    fed = Machine(oom_above=64)
    outcome, choice = search(space(per_process=16), fed)
    assert [c.dataloader_num_workers for c in fed.calls] == [0, 0]
    assert any("workers: not tried: the best candidate waited 0.0%" in n for n in outcome.notes)


def test_a_precision_that_is_faster_only_by_noise_does_not_win():
    for gain, expected in ((0.02, "bf16"), (0.2, "fp16")):
        m = Machine(oom_above=64, fp16_gain=gain)
        sp = space(per_process=16, precision="bf16", on_cuda=True, axes=("micro_batch", "precision"))
        _, choice = search(sp, m)
        assert [c.precision for c in m.calls] == ["bf16", "bf16", "fp16"]
        assert choice.winner.candidate.precision == expected


def test_the_budget_stops_trials_it_cannot_afford_and_says_so():
    m = Machine(oom_above=4, half_speed_micro=1.0, trial_seconds=20.0)
    outcome = run_search(space(per_process=32), 50.0, m.run)
    assert [r.status for r in outcome.results][:3] == ["oom", "ok", SKIPPED]
    assert outcome.results[2].reason == "budget: 10 s of 50 s left, this trial needs about 20 s (raise --budget-s)"
    assert len(m.calls) == 2 and outcome.spent_s == 40.0


def test_a_rerun_replays_the_saved_measurements_without_a_trial_and_a_larger_budget_asks_for_more():
    sp = space(per_process=32)
    m = Machine(oom_above=4, half_speed_micro=1.0, trial_seconds=20.0)
    first = run_search(sp, 50.0, m.run)
    saved = {r.candidate.key: r for r in first.results if r.ran}
    again = run_search(sp, 50.0, None, saved)
    assert not again.needs_trials
    assert [r.candidate for r in again.results] == [r.candidate for r in first.results]
    assert [r.from_cache for r in again.results if r.ran] == [True, True]
    assert choose(again.results, sp.metric, sp.base).winner.candidate == choose(first.results, sp.metric, sp.base).winner.candidate
    assert run_search(sp, 500.0, None, saved).needs_trials


def test_the_grid_is_every_candidate_the_planner_allows_with_the_same_trial_runner():
    from hf_gpu_train.tune.search import grid, run_grid

    sp = space(per_process=8, workers=0)
    candidates = grid(sp)
    assert len(candidates) == 4 * 2 * 2 == len({c.key for c in candidates})  # micro 1,2,4,8 x checkpointing x workers 0,2
    assert all(c.micro_batch * c.accumulation == 8 for c in candidates)
    m = Machine(oom_above=4)
    outcome = run_grid(sp, m.run)
    assert [r.candidate for r in outcome.results] == candidates == m.calls


# (factor on the memory limit, cost); "all": 4, 0.25
POLICIES = {"selective": (2, 0.03), "every-2": (3, 0.12), "selective-lean": (3.5, 0.15)}


def levers(machine: Machine) -> list[tuple]:
    return [(c.micro_batch, c.checkpointing, c.offload_activations) for c in machine.calls]


def test_the_cheapest_checkpointing_policy_goes_first_and_a_costlier_one_starts_where_it_ran_out():
    """Issue 19: memory stops the ladder at 16; selective checkpointing fits 16 and pays; one layer in two (limit 24)
    starts where selective ran out (32) and does not fit, nor does lean selective (limit 28); every layer fits 32 and
    pays more than selective's 16."""
    m = Machine(oom_above=8, ckpt_factor=4, ckpt_cost=0.25, half_speed_micro=32.0, policies=POLICIES)
    outcome, choice = search(space(per_process=64, start=8, layered=True), m)
    assert levers(m)[:3] == [(8, "off", False), (16, "off", False), (4, "off", False)]
    assert levers(m)[3:] == [(16, "selective", False), (32, "selective", False), (32, "every-2", False),
                             (32, "selective-lean", False), (32, "all", False), (64, "all", False)]
    assert (choice.winner.candidate.micro_batch, choice.winner.candidate.checkpointing) == (32, "all")
    assert any(n.startswith("checkpointing selective:") for n in outcome.notes)


def test_when_the_cheapest_policy_lifts_the_memory_limit_the_costlier_ones_are_not_measured():
    m = Machine(oom_above=8, half_speed_micro=32.0, policies={"selective": (8, 0.03), "every-2": (8, 0.12), "selective-lean": (8, 0.2)})
    outcome, choice = search(space(per_process=64, start=8, layered=True), m)
    assert {c.checkpointing for c in m.calls} == {"off", "selective"}
    assert choice.winner.candidate.checkpointing == "selective" and choice.winner.candidate.micro_batch == 64
    assert "checkpointing: memory no longer stops the ladder: the costlier policies are not tried" in outcome.notes


def test_offloading_is_measured_on_cuda_only_where_checkpointing_still_meets_memory():
    m = Machine(oom_above=2, ckpt_factor=4, ckpt_cost=0.25, half_speed_micro=32.0, policies=POLICIES, offload=(2.0, 0.05))
    outcome, choice = search(space(per_process=32, start=2, layered=True, on_cuda=True), m)
    assert [x for x in levers(m) if x[2]] and all(x[1] != "off" for x in levers(m) if x[2])  # with checkpointing
    assert choice.winner.candidate.offload_activations and choice.winner.candidate.micro_batch == 16
    cpu = Machine(oom_above=2, half_speed_micro=32.0, policies=POLICIES)
    outcome, _ = search(space(per_process=32, start=2, layered=True), cpu)
    assert not any(c.offload_activations for c in cpu.calls)
    assert "offload: not tried on the CPU (the activations are in host memory already)" in space(layered=True).notes


def test_with_a_memory_budget_the_fastest_candidate_under_it_wins():
    """--memory-budget-gib: nothing runs out of memory here, but every candidate above 3 GiB (a sample costs 0.25 GiB
    without checkpointing) is over the budget: the winner is the fastest that stays under it, with checkpointing."""
    m = Machine(oom_above=1000, half_speed_micro=32.0, policies=POLICIES, gib_per_sample=0.25)
    outcome, choice = search(space(per_process=64, start=64, layered=True, memory_budget_bytes=3 * 2**30), m)
    over = [r for r in outcome.results if r.status == "ok" and not r.fits]
    assert over and all("over the memory budget (3.00 GiB)" == r.verdict() for r in over)
    winner = choice.winner
    assert winner.peak_memory_bytes <= 3 * 2**30 and winner.candidate.gradient_checkpointing
    fitting = [r for r in outcome.results if r.fits]
    assert winner.samples_per_s == max(r.samples_per_s for r in fitting)
    unbudgeted, plain = search(space(per_process=64, start=64, layered=True), Machine(oom_above=1000, half_speed_micro=32.0))
    assert not plain.winner.candidate.gradient_checkpointing and plain.winner.candidate.micro_batch == 64


def test_offloading_never_turns_on_checkpointing_the_user_fixed_and_compile_never_joins_it():
    """Review of issue 19: with gradient_checkpointing fixed on the command line, the offload ladder keeps it as fixed
    (a winner with checkpointing on was written without it: an unmeasured run); torch.compile is never tried beside
    offloading (the run refuses the pair)."""
    m = Machine(oom_above=2, ckpt_factor=4, half_speed_micro=32.0, policies=POLICIES, offload=(4.0, 0.05))
    sp = space(per_process=32, start=2, layered=True, on_cuda=True, fixed=frozenset({"gradient_checkpointing"}))
    _, choice = search(sp, m)
    assert not any(c.gradient_checkpointing for c in m.calls)
    assert any(c.offload_activations for c in m.calls) and not any(c.offload_activations and c.torch_compile for c in m.calls)
    assert choice.winner.candidate.offload_activations and not choice.winner.candidate.gradient_checkpointing


def test_a_run_with_checkpointing_on_still_gets_offloading_and_one_with_offloading_tries_it_off():
    m = Machine(oom_above=4, ckpt_factor=4, half_speed_micro=32.0, policies=POLICIES, offload=(2.0, 0.05))
    outcome, _ = search(space(per_process=64, start=8, layered=True, on_cuda=True, gradient_checkpointing=True,
                              checkpoint_layers="all"), m)
    assert any(c.offload_activations for c in m.calls), outcome.notes  # memory stopped "all" at 32: offloading fits more
    lean = Machine(oom_above=1000, half_speed_micro=8.0, policies=POLICIES, offload=(2.0, 0.3))
    outcome, choice = search(space(per_process=16, start=16, layered=True, on_cuda=True, offload_activations=True), lean)
    assert [c.offload_activations for c in lean.calls][:1] == [True] and False in [c.offload_activations for c in lean.calls]
    assert not choice.winner.candidate.offload_activations  # 30% slower and not needed: off wins
