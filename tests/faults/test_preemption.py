"""Preemption in anyone's Trainer (issue 30, item 1): a stop signal at any point of a step (the middle of a
gradient-accumulation step, an evaluation, a save) ends in a complete checkpoint at the next step boundary and exit
75, and the same command resumes to the weights of the run that was never interrupted: equality, not "it finished".

The trainers are the integration matrix's (tests/integrations/peers.py): the plain Trainer on a tiny Llama with rows
of different lengths, and TRL's SFTTrainer with a LoRA adapter. Two processes: tests/faults/test_preemption_processes.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch
from transformers import TrainerCallback

from hf_gpu_train.faults import preemption as preemption_module
from hf_gpu_train.faults.checkpoint_marker import COMPLETE_MARKER, complete_checkpoints
from hf_gpu_train.faults.preemption import DUPLICATE_WINDOW_S, StopRequest, attach_preemption
from hf_gpu_train.launch.grace import RECORD, measured_save_seconds
from hf_gpu_train.launch.rank_report import PREEMPTED_EXIT_CODE
from tests.integrations.peers import build
from tests.scaling.equivalence import assert_same_params

pytestmark = pytest.mark.slow
STEPS = 6


class SignalAt(TrainerCallback):
    """Sends ``signum`` to this process once, during step ``step`` (1-based): in the middle of its gradient
    accumulation (``where="accumulation"``), during the evaluation after it (``"evaluation"``)."""

    def __init__(self, step: int, where: str, signum=signal.SIGTERM):
        self.step, self.where, self.signum, self.sent = step, where, signum, False

    def _send(self) -> None:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)

    def on_substep_end(self, args, state, control, **kwargs):
        if self.where == "accumulation" and state.global_step == self.step - 1:
            self._send()

    def on_prediction_step(self, args, state, control, **kwargs):
        if self.where == "evaluation" and state.global_step == self.step:
            self._send()


def signal_during_save(trainer, step: int, signum=signal.SIGUSR1) -> None:
    """The signal arrives while ``_save_checkpoint`` of ``step`` writes (after the marker says it began)."""
    original = trainer._save_checkpoint

    def saving(*args, **kwargs):
        if trainer.state.global_step == step:
            os.kill(os.getpid(), signum)
        return original(*args, **kwargs)

    trainer._save_checkpoint = saving


def trainer_for(kind: str, out, **changes):
    trainer = build(kind, str(out), per_device=2, accumulation=2)
    trainer.args.max_steps = STEPS
    for key, value in changes.items():
        setattr(trainer.args, key, value)
    return trainer


def weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """Each trainer kind run whole, with preemption attached and no signal: the weights every resumed run must end with."""
    found = {}
    for kind in ("Trainer", "SFTTrainer"):
        trainer = trainer_for(kind, tmp_path_factory.mktemp(kind))
        attach_preemption(trainer)
        trainer.train()
        found[kind] = weights(trainer)
    return found


def preempt_then_resume(tmp_path, kind: str, arm, **changes) -> tuple[object, object]:
    """Train with the signal ``arm(trainer)`` places; the process would exit 75; then the same command again
    (a new Trainer, ``resume_from_checkpoint=True``). Returns (the preempted run's Preemption, the resumed Trainer)."""
    out = tmp_path / "out"
    trainer = trainer_for(kind, out, **changes)
    arm(trainer)
    stopped = attach_preemption(trainer)
    with pytest.raises(SystemExit) as ended:
        trainer.train()
    assert ended.value.code == PREEMPTED_EXIT_CODE
    assert stopped.preempted and signal.getsignal(signal.SIGTERM) == stopped.request._handle  # still ours until exit
    stopped.done()
    again = trainer_for(kind, out, **changes)
    attach_preemption(again)
    again.train(resume_from_checkpoint=True)
    return stopped, again


@pytest.mark.parametrize("kind", ["Trainer", "SFTTrainer"])
def test_a_signal_in_the_middle_of_accumulation_finishes_the_step_saves_and_resumes_exactly(tmp_path, kind, uninterrupted):
    stopped, resumed = preempt_then_resume(tmp_path, kind, lambda t: t.add_callback(SignalAt(3, "accumulation")))
    assert stopped.stopped_at_step == 3  # the step in flight was finished: no step lost
    out = tmp_path / "out"
    assert [c.name for c in complete_checkpoints(out)] == ["checkpoint-3"]
    assert (out / "checkpoint-3" / COMPLETE_MARKER).is_file()
    assert resumed.state.global_step == STEPS
    assert_same_params(weights(resumed), uninterrupted[kind])
    assert measured_save_seconds(out) > 0  # the record `hf-gpu-train config --save-time-from` reads


def test_a_signal_during_an_evaluation_lets_it_finish_then_saves_that_step(tmp_path, uninterrupted):
    changes = {"eval_strategy": "steps", "eval_steps": 2}
    from transformers.trainer_utils import IntervalStrategy

    changes["eval_strategy"] = IntervalStrategy.STEPS
    stopped, resumed = preempt_then_resume(tmp_path, "Trainer", lambda t: t.add_callback(SignalAt(4, "evaluation")), **changes)
    assert stopped.stopped_at_step == 4 and len(stopped.evaluation_seconds) == 2  # the evaluation at step 4 finished
    assert_same_params(weights(resumed), uninterrupted["Trainer"])


def test_a_signal_during_a_save_lets_it_finish_and_stops_there(tmp_path, uninterrupted):
    from transformers.trainer_utils import SaveStrategy

    stopped, resumed = preempt_then_resume(tmp_path, "Trainer", lambda t: signal_during_save(t, 2),
                                           save_strategy=SaveStrategy.STEPS, save_steps=2)
    assert stopped.stopped_at_step == 2 and len(stopped.save_seconds) == 1  # no second save of the same step
    record = json.loads((tmp_path / "out" / RECORD).read_text())
    assert record["save_seconds_max"] == max(record["save_seconds"]) > 0
    assert_same_params(weights(resumed), uninterrupted["Trainer"])


def test_exit_false_returns_and_says_it_stopped_early(tmp_path):
    trainer = trainer_for("Trainer", tmp_path / "out")
    trainer.add_callback(SignalAt(2, "accumulation", signal.SIGUSR2))
    stopped = attach_preemption(trainer, exit=False)
    trainer.train()
    assert stopped.preempted and trainer.state.global_step == 2
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # the handlers as they were before


def test_a_finished_run_is_not_preempted_and_gives_the_handlers_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    trainer = trainer_for("Trainer", tmp_path / "out")
    stopped = attach_preemption(trainer)
    trainer.train()
    assert not stopped.preempted and trainer.state.global_step == STEPS
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_same_request_twice_is_one_a_second_later_one_exits_at_once(monkeypatch):
    clock = [100.0]
    exits = []
    monkeypatch.setattr(preemption_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(preemption_module, "_exit_now", lambda *a: exits.append(clock[0]))
    request = StopRequest()
    request._pid = os.getpid()
    request._handle(signal.SIGTERM, None)
    clock[0] += DUPLICATE_WINDOW_S / 2  # the launcher forwarding what the scheduler sent this process too
    request._handle(signal.SIGTERM, None)
    assert request.signum == signal.SIGTERM and exits == []
    clock[0] += DUPLICATE_WINDOW_S
    request._handle(signal.SIGUSR1, None)
    assert exits == [clock[0]]


def test_a_forked_child_ignores_the_signal_its_parent_handles():
    request = StopRequest()
    request._pid = os.getpid() + 1  # as in a DataLoader worker forked after the handler was installed
    request._handle(signal.SIGTERM, None)
    assert not request.requested


def test_a_save_longer_than_the_grace_is_said_at_the_start(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_GPU_TRAIN_GRACE_SECONDS", "0.000001")
    trainer = trainer_for("Trainer", tmp_path / "out", max_steps=1)
    attach_preemption(trainer)
    trainer.train()
    err = capsys.readouterr().err
    assert "a checkpoint save takes about" in err and "more than the 0 s grace (HF_GPU_TRAIN_GRACE_SECONDS)" in err
    assert "--signal=B:USR1@SECONDS" in err


def test_off_the_main_thread_it_steps_aside_with_the_reason(tmp_path):
    import threading

    trainer = trainer_for("Trainer", tmp_path / "out")
    found = []
    thread = threading.Thread(target=lambda: found.append(attach_preemption(trainer)))
    thread.start()
    thread.join()
    assert "not on the main thread" in found[0].inactive_reason
    assert torch.is_tensor(next(iter(trainer.model.state_dict().values())))


def test_a_signal_before_training_began_exits_75_with_nothing_saved(tmp_path):
    trainer = trainer_for("Trainer", tmp_path / "out")
    stopped = attach_preemption(trainer)
    os.kill(os.getpid(), signal.SIGTERM)  # while the model loads, in a real run
    with pytest.raises(SystemExit) as ended:
        trainer.train()
    stopped.done()
    assert ended.value.code == PREEMPTED_EXIT_CODE and not list((tmp_path / "out").glob("checkpoint-*"))


def test_dataloader_workers_signalled_with_their_parent_do_not_fail_the_step(tmp_path, uninterrupted):
    """SLURM signals every process of a job: the DataLoader workers too. torch ends a worker on a SIGTERM from anyone
    but its parent; the step the checkpoint waits for would then fail ("DataLoader worker exited unexpectedly")."""
    from hf_gpu_train.launch.signals import children_of

    class SignalEveryProcess(TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            if state.global_step == 2 and not (tmp_path / "sent").exists():
                (tmp_path / "sent").write_text("")
                workers = children_of(os.getpid())
                assert workers, "no DataLoader worker to signal"
                # from another process, as slurmstepd sends it: torch's worker tells its parent's SIGTERM from others'
                subprocess.run(["kill", "-TERM", *map(str, [os.getpid(), *workers])], check=True)

    stopped, resumed = preempt_then_resume(tmp_path, "Trainer", lambda t: t.add_callback(SignalEveryProcess()),
                                           dataloader_num_workers=2)
    assert stopped.stopped_at_step == 3
    assert_same_params(weights(resumed), uninterrupted["Trainer"])


def test_train_twice_handles_signals_both_times_and_forgets_the_first_request(tmp_path):
    trainer = trainer_for("Trainer", tmp_path / "out")
    trainer.add_callback(SignalAt(2, "accumulation"))
    stopped = attach_preemption(trainer, exit=False)
    trainer.train()
    assert stopped.preempted and trainer.state.global_step == 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    trainer.train(resume_from_checkpoint=True)  # the same Trainer again: handlers back, the old request gone
    assert not stopped.preempted and trainer.state.global_step == STEPS


def test_an_epoch_end_save_after_the_stop_does_not_write_the_same_step_again(tmp_path):
    from transformers.trainer_utils import SaveStrategy

    trainer = trainer_for("Trainer", tmp_path / "out", max_steps=-1, num_train_epochs=1, save_strategy=SaveStrategy.EPOCH)
    trainer.add_callback(SignalAt(2, "accumulation"))
    stopped = attach_preemption(trainer, exit=False)
    trainer.train()
    assert stopped.preempted and stopped.stopped_at_step == 2 and len(stopped.save_seconds) == 1


def test_a_stop_whose_save_something_else_called_off_is_saved_after_train(tmp_path, uninterrupted):
    """save_strategy="best" sets should_save from the metric after an evaluation, over the stop's save; any callback
    after ours may clear it too. The stop still ends in a checkpoint of its step, and the resume is exact."""

    class CallsSavesOff(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = False

    def arm(trainer):
        trainer.add_callback(SignalAt(3, "accumulation"))

    out = tmp_path / "out"
    trainer = trainer_for("Trainer", out)
    arm(trainer)
    stopped = attach_preemption(trainer, exit=False)
    trainer.add_callback(CallsSavesOff())  # after ours: its word is the last
    trainer.train()
    stopped.done()
    assert stopped.preempted and [c.name for c in complete_checkpoints(out)] == ["checkpoint-3"]
    again = trainer_for("Trainer", out)
    attach_preemption(again)
    again.train(resume_from_checkpoint=True)
    assert_same_params(weights(again), uninterrupted["Trainer"])


# -- issue 36, items 2 and 4 ------------------------------------------------------------------------------------------


def test_save_only_model_still_leaves_a_checkpoint_that_resumes_exactly(tmp_path, uninterrupted, caplog):
    """Before: "checkpoint-3 is complete; the same command resumes from it", a folder without optimizer, scheduler or
    RNG state, and the resumed weights 4.8e-2 off the run never stopped. A stop's checkpoint now holds them."""
    from transformers.trainer_utils import SaveStrategy

    with caplog.at_level("WARNING", logger="hf_gpu_train.preemption"):
        stopped, resumed = preempt_then_resume(tmp_path, "Trainer", lambda t: t.add_callback(SignalAt(3, "accumulation")),
                                               save_only_model=True, save_strategy=SaveStrategy.STEPS, save_steps=2)
    folder = tmp_path / "out" / "checkpoint-3"
    assert stopped.stopped_at_step == 3 and (folder / "optimizer.pt").is_file() and (folder / "scheduler.pt").is_file()
    assert (folder / "rng_state.pth").is_file()
    assert not (tmp_path / "out" / "checkpoint-2" / "optimizer.pt").exists()  # the scheduled save: as the user asked
    assert any("save_only_model=True: the scheduled checkpoints hold the model only" in r.getMessage() for r in caplog.records)
    assert_same_params(weights(resumed), uninterrupted["Trainer"])


def test_the_grace_advice_never_recommends_save_only_model():
    from hf_gpu_train.faults.preemption import Preemption

    assert "save_only_model" not in Preemption._fix(None)


class SlowEvaluation(TrainerCallback):
    """An evaluation that takes ``seconds`` a batch (standing in for generation); records when it ran and when saves
    began, in this process's monotonic clock."""

    def __init__(self, seconds: float):
        self.seconds, self.evaluated_at, self.saved_at = seconds, [], []

    def on_prediction_step(self, args, state, control, **kwargs):
        import time

        time.sleep(self.seconds)

    def on_evaluate(self, args, state, control, **kwargs):
        import time

        self.evaluated_at.append((state.global_step, time.monotonic()))


def test_a_stop_saves_before_a_due_evaluation_and_the_resumed_run_evaluates_first(tmp_path, uninterrupted, capsys):
    """Before: SIGTERM during step 3 with eval_steps=3 and an evaluation of 1 s a batch: the checkpoint was written 17.6 s
    after the signal, after the evaluation. Now the save comes first; the evaluation is put off to the resumed run,
    which runs it before its first step: the same evaluations, at the same steps, as the run never stopped."""
    import time

    from transformers.trainer_utils import IntervalStrategy

    changes = dict(eval_strategy=IntervalStrategy.STEPS, eval_steps=3, per_device_eval_batch_size=4)
    slow = SlowEvaluation(0.25)
    sent = []

    class SignalDuringStep3(SignalAt):
        def _send(self):
            if not self.sent:
                sent.append(time.monotonic())
            super()._send()

    def arm(t):
        t.add_callback(SignalDuringStep3(3, "accumulation"))
        t.add_callback(slow)
        original = t._save_checkpoint

        def saving(*args, **kwargs):
            slow.saved_at.append(time.monotonic())
            return original(*args, **kwargs)

        t._save_checkpoint = saving

    stopped, resumed = preempt_then_resume(tmp_path, "Trainer", arm, **changes)
    err = capsys.readouterr().err
    assert stopped.stopped_at_step == 3 and slow.evaluated_at == []  # no evaluation between the signal and the save
    assert slow.saved_at and slow.saved_at[0] - sent[0] < 2.0, f"the save began {slow.saved_at[0] - sent[0]:.1f} s after"
    assert "the evaluation due at step 3 was put off" in err
    evaluations = [h["step"] for h in resumed.state.log_history if "eval_loss" in h]
    assert evaluations == [3, 6]  # the resumed run ran step 3's first, as the uninterrupted run did
    whole = trainer_for("Trainer", tmp_path / "whole", **changes)
    attach_preemption(whole)
    whole.train()
    expected = {h["step"]: h["eval_loss"] for h in whole.state.log_history if "eval_loss" in h}
    assert {h["step"]: h["eval_loss"] for h in resumed.state.log_history if "eval_loss" in h} == pytest.approx(expected)
    assert_same_params(weights(resumed), uninterrupted["Trainer"])


@pytest.mark.parametrize("strategy, data_seed", [("group_by_length", 0), ("group_by_length", None), ("random", 5)])
def test_a_resume_in_a_later_epoch_reads_the_order_the_run_never_stopped_reads(tmp_path, strategy, data_seed):
    """issue 36, item 3. Before: train_sampling_strategy="group_by_length" and a stop signal in the second epoch: the
    resumed weights 1.2e-2 off the run never stopped (the random sampler: 0). transformers' LengthGroupedSampler draws
    each epoch's order from the global generator, before the Trainer restores the random state from the checkpoint.
    48 rows, 4 a step: 12 steps an epoch, the signal in step 14."""
    def make(out):
        return build("Trainer", str(out), per_device=2, accumulation=2, train_sampling_strategy=strategy,
                     data_seed=data_seed, max_steps=16)

    whole = make(tmp_path / "whole")
    attach_preemption(whole)
    whole.train()
    out = tmp_path / "out"
    stopped = make(out)
    stopped.add_callback(SignalAt(14, "accumulation"))
    preemption = attach_preemption(stopped)
    with pytest.raises(SystemExit):
        stopped.train()
    preemption.done()
    assert preemption.stopped_at_step == 14
    again = make(out)
    attach_preemption(again)
    again.train(resume_from_checkpoint=True)
    assert_same_params(weights(again), weights(whole))


def test_a_warning_forwarded_before_a_process_listens_is_taken_when_it_does(tmp_path, monkeypatch):
    """Also reported in issue 36: hf-gpu-train launch starts the training processes with SIGUSR1 ignored, so SLURM's one
    warning that reaches a process before it listens (importing, loading its model) was lost. The launcher notes each
    signal it forwards; a process takes the noted request once when it begins to listen, and never again."""
    from hf_gpu_train.launch.rank_report import PROGRESS_DIR_ENV
    from hf_gpu_train.launch.signals import SignalForwarder

    progress = tmp_path / "progress"
    progress.mkdir()
    monkeypatch.setenv(PROGRESS_DIR_ENV, str(progress))
    child = subprocess.Popen(["sleep", "30"], preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN))
    try:
        forwarder = SignalForwarder(os.getpid(), progress)
        forwarder.targets = lambda: [child.pid]  # a training process that does not listen yet: it ignores the warning
        forwarder._forward(signal.SIGUSR1, None)
        assert child.poll() is None  # the warning reached it and was ignored: lost, until now
    finally:
        child.kill()
    request = StopRequest()
    request.install(signals=())
    assert request.requested and request.signum == signal.SIGUSR1
    request.reset()
    request.install(signals=())
    assert not request.requested  # taken once
    forwarder._forward(signal.SIGTERM, None)  # a second request, later: taken too
    request.install(signals=())
    assert request.signum == signal.SIGTERM


def test_a_resume_from_a_model_only_checkpoint_says_it_is_not_exact(tmp_path, caplog):
    from transformers.trainer_utils import SaveStrategy

    first = trainer_for("Trainer", tmp_path / "out", save_only_model=True, save_strategy=SaveStrategy.STEPS, save_steps=2,
                        max_steps=2)
    attach_preemption(first)
    first.train()
    again = trainer_for("Trainer", tmp_path / "out", save_only_model=True, max_steps=3)
    attach_preemption(again)
    with caplog.at_level("WARNING", logger="hf_gpu_train.checkpoints"):
        again.train(resume_from_checkpoint=True)
    said = [r.getMessage() for r in caplog.records if "holds the model but not" in r.getMessage()]
    assert len(said) == 1 and "the optimizer's state" in said[0] and "checkpoint-2" in said[0]


def test_a_signal_during_a_model_only_save_still_ends_in_a_checkpoint_that_resumes_exactly(tmp_path, uninterrupted):
    """Review finding: the signal reached the run while save_only_model wrote its scheduled checkpoint-2: the save after
    train() returned was model-only again (training had ended), and the run called it complete."""
    from transformers.trainer_utils import SaveStrategy

    stopped, resumed = preempt_then_resume(tmp_path, "Trainer", lambda t: signal_during_save(t, 2), save_only_model=True,
                                           save_strategy=SaveStrategy.STEPS, save_steps=2)
    folder = tmp_path / "out" / "checkpoint-2"
    assert stopped.stopped_at_step == 2 and (folder / "optimizer.pt").is_file() and (folder / "rng_state.pth").is_file()
    assert_same_params(weights(resumed), uninterrupted["Trainer"])
