"""The preflight at the start of a launch of several processes, and the entry gate's evidence that a rank will not come (``collective_gate.not_coming``): only what a late position
cannot undo counts, so a rank seen late is never taken for a rank that went elsewhere."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from hf_gpu_train.collectives.control_flags import FLAGS, agree_flags
from hf_gpu_train.faults.collective_gate import not_coming
from hf_gpu_train.faults.preflight_collective import _ranges, local_pairs


def where(step, phase, collectives=0, in_collective=None):
    return {"step": step, "phase": phase, "collectives": collectives, "in_collective": in_collective}


def test_a_rank_that_began_a_later_step_or_waits_in_a_collective_not_entered_here_is_not_coming():
    assert "went on to step 4 (forward)" in not_coming(where(3, "forward"), step=3, collectives=7)
    assert "went on to step 6" in not_coming(where(5, "data"), step=3, collectives=7)
    assert "waits in all_reduce instead (its collective 8; this rank entered 7)" in not_coming(
        where(3, "data", 8, "all_reduce"), step=3, collectives=7)


def test_a_position_seen_late_is_no_evidence():
    assert not_coming(None, step=3, collectives=7) is None  # never published yet
    assert not_coming(where(3, "data"), step=3, collectives=7) is None  # on its way to the call
    assert not_coming(where(2, "optimizer"), step=3, collectives=7) is None  # seen a step ago
    # seen inside the collective both ranks left since (the flags all-reduce before an evaluation): the same count
    assert not_coming(where(3, "data", 7, "all_reduce"), step=3, collectives=7) is None
    assert not_coming(where(3, "evaluation"), step=3, collectives=7) is None


def test_one_process_keeps_its_flags():
    control = SimpleNamespace(**{**dict.fromkeys(FLAGS, False), "should_save": True})
    agree_flags(control)
    assert control.should_save and not control.should_evaluate


def _torchrun_environment(monkeypatch, rank: int, world: int, port: int) -> None:
    for name, value in dict(RANK=str(rank), WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)


def test_a_rank_that_cannot_reach_the_rendezvous_names_itself_in_seconds(monkeypatch):
    """Issue 18, item 4: without the preflight it would wait in init_process_group for 30 minutes."""
    from hf_gpu_train.faults.preflight_collective import PreflightError, check_ranks_join
    from tests.launching import free_port

    _torchrun_environment(monkeypatch, 1, 2, free_port())  # nobody listens there: a wrong port, a firewall
    start = time.monotonic()
    with pytest.raises(PreflightError) as raised:
        check_ranks_join(3.0)
    assert "rank 1 on " in str(raised.value) and "cannot reach the rendezvous at 127.0.0.1:" in str(raised.value)
    assert "MASTER_ADDR=127.0.0.1" in str(raised.value) and "NCCL_SOCKET_IFNAME" in str(raised.value)  # the fix, this run's values
    assert time.monotonic() - start < 3.0  # before the others give up on it (they would end the run first)


def test_the_preflight_names_ranks_as_ranges_and_copies_each_local_pair_once_in_one_order():
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert local_pairs([4, 5, 6]) == [(4, 5), (4, 6), (5, 6)]


def test_the_ranks_that_never_join_are_named_by_those_that_did(monkeypatch):
    from datetime import timedelta

    import torch.distributed as dist

    from hf_gpu_train.faults.preflight_collective import PreflightError, check_ranks_join
    from tests.launching import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    store.set("hf_gpu_train/preflight/run/0/joined/1", "other-host")  # rank 1 joined; 2 and 3 never do
    _torchrun_environment(monkeypatch, 0, 4, port)
    with pytest.raises(PreflightError, match=r"rank\(s\) 2-3 of 4 did not join within 1 s \(joined: 0-1 on other-host, "):
        check_ranks_join(1.0)


def test_a_forward_between_steps_is_not_the_next_step():
    """A rank-0 callback that runs the model in on_log (samples) must not read as "went on to step N+1" to the gates."""
    from hf_gpu_train.faults.watchdog import Limits, Watchdog, WatchdogCallback

    callback = WatchdogCallback(Watchdog("/nonexistent", Limits()))
    state = SimpleNamespace(global_step=3)
    callback.on_step_begin(None, state, None)
    callback._training("backward")
    assert callback.watchdog.progress.phase == "backward"
    callback.on_step_end(SimpleNamespace(process_index=0), state, None)
    callback._training("forward")  # the model run by a callback after the step
    assert callback.watchdog.progress.position()["phase"] == "data"
    assert not_coming(callback.watchdog.progress.position(), step=3, collectives=0) is None


def test_save_model_is_gated_only_where_it_gathers_and_only_when_the_user_calls_it():
    from hf_gpu_train.faults.collective_gate import _user_call, gathers_in_save_model

    def trainer(fsdp=None, zero=None):
        return SimpleNamespace(is_fsdp_enabled=fsdp is not None, is_deepspeed_enabled=zero is not None,
                               accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(state_dict_type=fsdp))),
                               deepspeed=SimpleNamespace(config={"zero_optimization": {"stage": zero}}))

    assert not gathers_in_save_model(trainer())  # plain DDP: rank 0 alone may save
    assert gathers_in_save_model(trainer(fsdp="StateDictType.FULL_STATE_DICT"))
    assert not gathers_in_save_model(trainer(fsdp="StateDictType.SHARDED_STATE_DICT"))
    assert gathers_in_save_model(trainer(zero=3)) and not gathers_in_save_model(trainer(zero=2))
    # save_model(output_dir, _internal_call): the Trainer's own call from _save_checkpoint is gated there
    assert _user_call("dir") and not _user_call("dir", _internal_call=True) and not _user_call("dir", True)


def test_the_flags_are_agreed_only_where_a_callback_may_set_one_alone():
    """Issue 28, item 4: with only callbacks that set their flags from what every rank sees (the Trainer's own, ours, the
    report_to sinks) the per-step all-reduce is left out; any other callback (a user's, a subclass, transformers'
    JITCheckpointCallback) turns it on."""
    from transformers import Trainer, TrainerCallback
    from transformers.integrations.integration_utils import CodeCarbonCallback
    from transformers.trainer_callback import DefaultFlowCallback

    from hf_gpu_train.callbacks import attach_telemetry
    from hf_gpu_train.collectives.control_flags import needs_agreement
    from hf_gpu_train.faults.watchdog import attach_watchdog
    from tests.callbacks.tiny import TokenDataset, tiny_args, tiny_bert

    trainer = Trainer(model=tiny_bert(), args=tiny_args("/tmp/unused"), train_dataset=TokenDataset(n=8))
    trainer.add_callback(object.__new__(CodeCarbonCallback))  # a report_to sink (not started here)
    attach_telemetry(trainer)
    attach_watchdog(trainer)
    assert not needs_agreement(trainer), [type(c).__name__ for c in trainer.callback_handler.callbacks]

    class Mine(TrainerCallback):
        pass

    class MyFlow(DefaultFlowCallback):
        pass

    for extra in (Mine(), MyFlow()):
        trainer.add_callback(extra)
        assert needs_agreement(trainer)
        trainer.remove_callback(extra)

    class MyMeter(TrainerCallback):  # says it sets no flag: no all-reduce per step for it
        hf_gpu_train_sets_flags_alike = True

    class ItsSubclass(MyMeter):  # a subclass may set flags: it says so itself, or it counts as any callback
        pass

    trainer.add_callback(MyMeter())
    assert not needs_agreement(trainer)
    trainer.add_callback(ItsSubclass())
    assert needs_agreement(trainer)
