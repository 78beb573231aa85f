"""What fits, what is faster than the noise, and which candidate wins."""

from __future__ import annotations

from dataclasses import replace

from hf_gpu_train.tune.candidates import Candidate
from hf_gpu_train.tune.results import OK, OOM, TrialResult, choose, faster, paired_noise_pct

BASE = Candidate(micro_batch=8, accumulation=4, gradient_checkpointing=False, dataloader_num_workers=4, precision="bf16")
GIB = 2**30
STEPS = (1.0, 1.5, 2.0, 1.0, 1.5, 2.0)  # the batches differ from step to step; every trial sees the same ones


def result(candidate=BASE, speed=100.0, status=OK, peak_gib=None, steps=STEPS, **kw) -> TrialResult:
    scale = sum(steps) / len(steps) / (100.0 / speed)  # step times of a run at this speed
    times = tuple(t / scale for t in steps)
    return TrialResult(candidate, status, samples_per_s=speed, tokens_per_s=speed * 30, step_times_s=times,
                       peak_memory_bytes=None if peak_gib is None else int(peak_gib * GIB),
                       device_memory_bytes=None if peak_gib is None else 80 * GIB, **kw)


def test_fits_means_no_out_of_memory_and_a_peak_within_90_percent():
    assert result(peak_gib=72.0).fits and not result(peak_gib=72.1).fits
    assert result(peak_gib=72.1).verdict() == "over 90% of memory"
    rescued = result(status=OOM, rescued_micro_batch=4, failed_micro_batch=8)
    assert not rescued.fits and rescued.verdict() == "oom (rescued at 4)"
    assert result().fits  # the CPU: no device memory, only the out-of-memory rule


def test_paired_noise_ignores_the_batches_own_variation_and_sees_the_jitter():
    steady = result(speed=100.0)
    assert paired_noise_pct(steady, result(speed=110.0)) == 0.0  # per-step ratios all 1.1: no noise at all
    jittered = result(speed=100.0, steps=tuple(t * f for t, f in zip(STEPS, (1.1, 0.9, 1.1, 0.9, 1.1, 0.9))))
    assert 8.0 < paired_noise_pct(jittered, result(speed=104.0)) < 10.0
    assert paired_noise_pct(steady, result(steps=STEPS[:5])) is None  # another step count: no pairs
    assert faster(result(speed=104.0), steady, "tokens/s") and not faster(result(speed=102.0), steady, "tokens/s")
    assert not faster(result(speed=104.0), jittered, "tokens/s")  # 4% is within that noise


def test_the_winner_is_the_fastest_that_fits_and_never_one_that_ran_out_of_memory():
    oom = result(replace(BASE, micro_batch=32, accumulation=1), speed=150.0, status=OOM, rescued_micro_batch=16)
    big = result(replace(BASE, micro_batch=16, accumulation=2), speed=140.0, peak_gib=75.0)  # over the headroom
    good = result(speed=120.0, peak_gib=40.0)
    choice = choose([oom, big, good], "tokens/s", BASE)
    assert choice.winner is good
    assert choice.reasons[0] == ("fastest that fits: 3,600 tokens/s with micro-batch 8 x 4, checkpointing off, 4 worker(s), "
                                 "bf16")
    assert choice.reasons[-1].startswith("not eligible: micro-batch 32 x 1") and "over 90% of memory" in choice.reasons[-1]


def test_within_the_noise_the_candidate_that_asks_less_of_the_run_wins():
    fp16 = result(replace(BASE, precision="fp16"), speed=102.0)
    bf16 = result(speed=100.0)
    choice = choose([fp16, bf16], "tokens/s", BASE)
    assert choice.winner is bf16 and "within the noise (3.0%)" in choice.reasons[1] and "fp16 instead of bf16" in choice.reasons[1]
    clearly = result(replace(BASE, precision="fp16"), speed=110.0)
    assert choose([clearly, bf16], "tokens/s", BASE).winner is clearly


def test_nothing_fits_is_said_with_what_happened():
    choice = choose([result(status=OOM, rescued_micro_batch=1)], "tokens/s", BASE)
    assert choice.winner is None and choice.reasons[0].startswith("no candidate fits: every one that ran oom (rescued at 1)")


def test_a_result_travels_as_json():
    import json

    r = result(peak_gib=10.0, rescued_micro_batch=4)
    assert TrialResult.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_other_worker_counts_do_not_pair_steps_so_a_much_faster_loader_is_not_lost_in_step_jitter():
    """The CI run that found it: 0 workers at 226 tokens/s (every step waits for collation), 2 workers at 409 (steps
    alternate between prefetched and waiting) were called 'within the noise (342.9%)'. A loader that prefetches
    changes which steps wait, so step i of one trial is not step i of the other: the windows' totals are compared."""
    waiting = replace(BASE, dataloader_num_workers=0)
    prefetching = replace(BASE, dataloader_num_workers=2)
    slow = result(waiting, speed=100.0, steps=(1.0,) * 6)
    bursty = result(prefetching, speed=180.0, steps=(0.1, 1.0, 0.1, 1.0, 0.1, 1.0))
    assert paired_noise_pct(bursty, slow) is None
    assert faster(bursty, slow, "tokens/s")
    assert choose([slow, bursty], "tokens/s", waiting).winner is bursty
    same_loader = result(waiting, speed=180.0, steps=(0.1, 1.0, 0.1, 1.0, 0.1, 1.0))
    assert paired_noise_pct(same_loader, slow) > 80.0  # the same loader: its steps pair, and such jitter is noise
