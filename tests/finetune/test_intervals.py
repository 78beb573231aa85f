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


def run_with_saves(callback, steps, seconds_per_step, save_seconds, monkeypatch, world_size: int = 1):
    """As ``run``, with each save taking ``save_seconds`` of blocked time, measured by the run's CheckpointCosts."""
    from hf_gpu_train.faults import checkpoint_costs

    clock = [100.0]
    monkeypatch.setattr(intervals.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(checkpoint_costs.time, "perf_counter", lambda: clock[0])
    costs = callback.costs
    state = SimpleNamespace(global_step=0)
    args = SimpleNamespace(world_size=world_size, device="cpu", process_index=1, output_dir="unused")
    callback.on_train_begin(args, state, TrainerControl())
    saved = []
    for step in range(1, steps + 1):
        costs.on_step_begin(args, state, TrainerControl())
        callback.on_step_begin(args, state, TrainerControl())
        clock[0] += seconds_per_step
        state.global_step = step
        costs.on_step_end(args, state, TrainerControl())
        control = callback.on_step_end(args, state, TrainerControl())
        if control.should_save:
            clock[0] += save_seconds
            costs.on_save(args, state, TrainerControl())
            callback.on_save(args, state, TrainerControl())
            saved.append(step)
    return saved


def test_auto_plans_the_interval_from_the_estimate_then_from_each_measured_save(monkeypatch):
    """mtbf 1 h, 1 s steps. The estimate (a model of no parameters: a free save) gives the floor of one step; the first
    measured save (8 s) gives sqrt(2 x 8 x 3600) ~ 240 s (Daly: 232 s) = 232 steps from there on."""
    from hf_gpu_train.plan.checkpoint_interval import optimal_interval_s

    said = []
    callback = EveryFewMinutes(None, evaluate=False, save=True, mtbf_hours=1.0, say=said.append)
    saved = run_with_saves(callback, 700, 1.0, 8.0, monkeypatch)
    every = round(optimal_interval_s(8.0, 3600.0))
    assert saved[0] == CALIBRATION_STEPS and callback.every == every
    assert saved[1:] == [s for s in range(CALIBRATION_STEPS + 1, 701) if s % every == 0]
    assert callback.costs.blocked_s[0] == 8.0 and callback.costs.plan.save_cost_s == 8.0
    assert said == []  # only the main process says it (process_index 1 here)


def test_a_faster_save_checkpoints_more_often(monkeypatch):
    slow = EveryFewMinutes(None, evaluate=False, save=True, mtbf_hours=10.0)
    fast = EveryFewMinutes(None, evaluate=False, save=True, mtbf_hours=10.0)
    run_with_saves(slow, 40, 1.0, 10.0, monkeypatch)
    run_with_saves(fast, 40, 1.0, 0.1, monkeypatch)
    assert fast.every < slow.every / 5  # sqrt(100) = 10 times more often, by Young's rule


def test_the_interval_is_said_once_with_its_inputs_on_the_main_process(monkeypatch):
    said = []
    callback = EveryFewMinutes(None, evaluate=True, save=True, say=said.append)
    clock = [0.0]
    monkeypatch.setattr(intervals.time, "perf_counter", lambda: clock[0])
    state, args = SimpleNamespace(global_step=0), SimpleNamespace(world_size=8, device="cpu", process_index=0)
    callback.on_train_begin(args, state, TrainerControl())
    for step in range(1, CALIBRATION_STEPS + 1):
        callback.on_step_begin(args, state, TrainerControl())
        clock[0] += 2.0
        state.global_step = step
        callback.on_step_end(args, state, TrainerControl())
    assert len(said) == 1 and "checkpoints every" in said[0] and "the default for 8 GPUs" in said[0], said
    assert "estimated save" in said[0]


def test_checkpoint_minutes_auto_is_the_default_and_a_number_still_fixes_it():
    from hf_gpu_train.finetune.config import FinetuneConfig

    assert FinetuneConfig.checkpoint_minutes == "auto"
    (fixed,) = interval_callbacks("auto", "auto", 30)
    (planned,) = interval_callbacks("auto", "auto", "auto", mtbf_hours=5.0)
    assert fixed.minutes == 30.0 and planned.minutes is None and planned.mtbf_hours == 5.0
