from types import SimpleNamespace

from transformers import TrainerControl

from hf_gpu_train.finetune import intervals
from hf_gpu_train.finetune.intervals import CALIBRATION_STEPS, EveryFewMinutes, interval_callbacks, steps_for


def test_steps_for_an_interval():
    assert steps_for(30, 2.0) == 900 and steps_for(1, 120.0) == 1 and steps_for(0.5, 3.0) == 10


def run(callback, steps, seconds_per_step, monkeypatch, at_train_begin_s: float = 0.0):
    """The Trainer's events in order; ``at_train_begin_s``: what another callback's on_train_begin takes after this
    one's (the evaluation before training)."""
    clock = [100.0]
    monkeypatch.setattr(intervals.time, "perf_counter", lambda: clock[0])
    state = SimpleNamespace(global_step=0)
    args = SimpleNamespace(world_size=1, device="cpu")
    callback.on_train_begin(args, state, TrainerControl())
    clock[0] += at_train_begin_s
    marked = []
    for step in range(1, steps + 1):
        callback.on_step_begin(args, state, TrainerControl())
        clock[0] += seconds_per_step
        state.global_step = step
        control = callback.on_step_end(args, state, TrainerControl())
        if control.should_save or control.should_evaluate:
            marked.append((step, control.should_evaluate, control.should_save))
    return marked


def test_checkpoints_and_evaluations_every_few_minutes_of_training(monkeypatch):
    # 6 s per step, one minute: every 10 steps, decided after the calibration steps
    marked = run(EveryFewMinutes(minutes=1.0, evaluate=True, save=True), 35, 6.0, monkeypatch)
    assert CALIBRATION_STEPS == 10 and marked == [(10, True, True), (20, True, True), (30, True, True)]
    assert run(EveryFewMinutes(minutes=1.0, evaluate=False, save=True), 20, 6.0, monkeypatch) == [(10, False, True), (20, False, True)]


def test_an_evaluation_at_train_begin_does_not_shorten_the_interval(monkeypatch):
    """The evaluation before training runs in on_train_begin, after this callback's: a 10-minute evaluation counted
    as the first steps' time would make the 30-minute interval a few steps (a checkpoint every few minutes)."""
    plain = run(EveryFewMinutes(minutes=1.0, evaluate=True, save=True), 35, 6.0, monkeypatch)
    assert run(EveryFewMinutes(minutes=1.0, evaluate=True, save=True), 35, 6.0, monkeypatch, at_train_begin_s=600.0) == plain


def test_a_run_shorter_than_the_interval_saves_nothing_on_the_way(monkeypatch):
    assert run(EveryFewMinutes(minutes=30.0, evaluate=True, save=True), 200, 0.5, monkeypatch) == []


def test_only_auto_strategies_get_the_callback():
    assert interval_callbacks("epoch", "steps", 30) == []
    (callback,) = interval_callbacks("auto", "no", 30)
    assert callback.evaluate and not callback.save
