"""Checkpoints written in the background (issue 38, item 1), in a plain Trainer on one process: the staged state is the
state at the save's step whatever training does next, the marker waits for the write, a write that fails or a process
that dies during it leaves no checkpoint that looks complete, and a resume from a background checkpoint ends with the
weights of the run never interrupted. Two processes (background_saves=true, the default on a GPU):
tests/finetune/test_resume.py, tests/faults/test_preemption_processes.py and the ZeRO-3 and FSDP kill-and-resume tests
of tests/scaling/; a rank killed during a background write on 2 processes: benchmarks/resilience.py's events."""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainerCallback

from hf_gpu_train.faults import background_save
from hf_gpu_train.faults.background_save import StagedFile, stage, staged
from hf_gpu_train.faults.checkpoint_marker import COMPLETE_MARKER, SAVING, SET_ASIDE_DIR, complete_checkpoints
from hf_gpu_train.faults.disk_full import guard_saves
from tests.callbacks.tiny import TokenDataset, tiny_args, tiny_bert

STEPS = 6


def plain_trainer(out, eval_dataset=None, **changes) -> Trainer:
    settings = dict(max_steps=STEPS, per_device_train_batch_size=8, logging_steps=1, save_strategy="steps", save_steps=2,
                    learning_rate=1e-3)
    settings.update(changes)
    return Trainer(model=tiny_bert(), args=tiny_args(out, **settings), train_dataset=TokenDataset(n=64),
                   eval_dataset=eval_dataset)


def weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    trainer = plain_trainer(tmp_path_factory.mktemp("whole"), save_strategy="no")
    trainer.train()
    return weights(trainer)


def test_staging_copies_the_tensors_and_keeps_their_structure_and_ties():
    shared = torch.arange(6.0)
    state = collections.OrderedDict(a=shared, tied=shared, view=shared[2:4], nested={"x": [shared, (1, "b")]})
    state._metadata = {"": {"version": 1}}
    Point = collections.namedtuple("Point", "x y")
    copied = stage({"state": state, "point": Point(torch.ones(2), 3), "number": 1.5})
    shared.add_(100)  # training goes on: the staged copy keeps the values of the save
    got = copied["state"]
    assert torch.equal(got["a"], torch.arange(6.0)) and torch.equal(got["view"], torch.tensor([2.0, 3.0]))
    assert got["a"] is got["tied"] and got["nested"]["x"][0] is got["a"]  # tied stays tied (one copy)
    assert type(got) is collections.OrderedDict and got._metadata == {"": {"version": 1}}
    assert type(copied["point"]) is Point and copied["point"].y == 3 and copied["number"] == 1.5


def test_a_dcp_saves_host_copy_is_made_once_and_copied_into_while_the_layout_holds():
    """FSDP's DCP saves (background_save.StagingBuffers.dcp_stager): the second save of the same layout copies into
    the first's host copy (DCP's own staging made a new one every time); another layout gets a new one."""
    buffers = background_save.StagingBuffers()
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, "step": 1}
    stager = buffers.dcp_stager(0, state)
    first = stager.stage(state)
    assert torch.equal(first["model"]["w"], state["model"]["w"]) and buffers.bytes == 9 * 4
    state["model"]["w"].add_(1.0)
    assert buffers.dcp_stager(0, state) is stager
    second = stager.stage(state)
    assert second["model"]["w"] is first["model"]["w"] and torch.equal(second["model"]["w"], state["model"]["w"])
    assert buffers.dcp_stager(1, state) is not stager  # the optimizer's save: its own copy
    grown = {"model": {"w": torch.zeros(4, 3), "b": torch.ones(3)}, "step": 1}
    assert buffers.dcp_stager(0, grown) is not stager


def test_inside_staged_every_name_of_the_writers_stages_and_outside_they_write(tmp_path):
    import safetensors.torch
    import transformers.modeling_utils

    files: list[StagedFile] = []
    with staged(files):
        torch.save({"w": torch.ones(3)}, tmp_path / "a.pt")
        safetensors.torch.save_file({"w": torch.ones(3)}, str(tmp_path / "b.safetensors"))
        transformers.modeling_utils.safe_save_file({"w": torch.ones(3)}, str(tmp_path / "c.safetensors"), metadata={"format": "pt"})
    assert not list(tmp_path.iterdir()) and [Path(f.path).name for f in files] == ["a.pt", "b.safetensors", "c.safetensors"]
    assert torch.save is not None and transformers.modeling_utils.safe_save_file is safetensors.torch.save_file
    for staged_file in files:
        staged_file.write()
    assert torch.equal(torch.load(tmp_path / "a.pt")["w"], torch.ones(3))
    assert safetensors.torch.load_file(tmp_path / "c.safetensors")["w"].sum() == 3


class SlowWrites:
    """Each background file write takes ``seconds`` longer (a slow disk); ``fail_at``: the step whose write fails."""

    def __init__(self, monkeypatch, seconds: float, fail_at: int | None = None):
        self.seconds, self.fail_at = seconds, fail_at
        real = StagedFile.write
        slow = self

        def write(staged_file):
            time.sleep(slow.seconds)
            if slow.fail_at is not None and f"checkpoint-{slow.fail_at}" in staged_file.path:
                raise OSError(5, "Input/output error (injected)")
            return real(staged_file)

        monkeypatch.setattr(StagedFile, "write", write)


class WatchCheckpoints(TrainerCallback):
    """Records, at each step's start, which checkpoints are complete and which are still being written."""

    def __init__(self, out: Path):
        self.out, self.seen = out, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen[state.global_step] = (
            [c.name for c in complete_checkpoints(self.out)],
            sorted(p.parent.name for p in self.out.glob(f"checkpoint-*/{SAVING}")))


def test_training_goes_on_while_a_checkpoint_is_written_and_it_is_marked_only_after(tmp_path, monkeypatch, uninterrupted):
    SlowWrites(monkeypatch, seconds=0.3)
    out = tmp_path / "out"
    trainer = plain_trainer(out)
    watch = WatchCheckpoints(out)
    trainer.add_callback(watch)
    guard_saves(trainer, background=True)
    saves = trainer._hf_gpu_train_background_saves
    trainer.train()
    assert watch.seen[2] == ([], ["checkpoint-2"])  # step 3 began while checkpoint-2 was still being written
    assert all((out / f"checkpoint-{s}" / COMPLETE_MARKER).is_file() for s in (2, 4, 6))  # all marked once written
    assert len(saves.blocked_seconds) == 3 and len(saves.write_seconds) == 3
    # the model, optimizer, scheduler and RNG files: 4 writes of >= 0.3 s each, none of it blocking training
    assert min(saves.write_seconds) >= 1.2 and max(saves.blocked_seconds) < min(saves.write_seconds) / 2
    # the staging buffers of the first save are the second's and third's: host memory of one checkpoint, not three
    assert saves.staged_bytes[0] > 0 and saves.buffers.bytes == saves.staged_bytes[0] and not saves.buffers.lent
    got, expected = weights(trainer), uninterrupted
    assert all(torch.equal(got[k], expected[k]) for k in expected)  # saving in the background changes nothing


def test_a_save_while_the_previous_write_goes_on_waits_for_it_said_once(tmp_path, monkeypatch, caplog):
    SlowWrites(monkeypatch, seconds=0.3)
    out = tmp_path / "out"
    trainer = plain_trainer(out, save_steps=1, max_steps=3)
    guard_saves(trainer, background=True)
    with caplog.at_level(logging.WARNING, logger="hf_gpu_train"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "still being written" in r.getMessage()]
    assert len(said) == 1 and "the save at step 2 came while checkpoint-1 was still being written" in said[0], said
    assert [c.name for c in complete_checkpoints(out)] == ["checkpoint-3", "checkpoint-2", "checkpoint-1"]
    assert trainer._hf_gpu_train_background_saves.waited_seconds > 0.5


def test_the_rotation_waits_for_the_marker_of_a_background_checkpoint(tmp_path, monkeypatch):
    SlowWrites(monkeypatch, seconds=0.2)
    out = tmp_path / "out"
    trainer = plain_trainer(out, save_total_limit=1)
    watch = WatchCheckpoints(out)
    trainer.add_callback(watch)
    guard_saves(trainer, background=True)
    trainer.train()
    # while checkpoint-4 was written, checkpoint-2 (complete) was still there; afterwards only the newest is kept
    assert watch.seen[4] == (["checkpoint-2"], ["checkpoint-4"])
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-6"]


def test_a_failed_background_write_stops_the_run_and_the_resume_takes_the_complete_one(tmp_path, monkeypatch, uninterrupted):
    SlowWrites(monkeypatch, seconds=0.0, fail_at=4)
    out = tmp_path / "out"
    first = plain_trainer(out)
    guard_saves(first, background=True)
    with pytest.raises(OSError, match="Input/output error"):
        first.train()
    assert [c.name for c in complete_checkpoints(out)] == ["checkpoint-2"]
    assert (out / "checkpoint-4" / SAVING).exists() and not (out / "checkpoint-4" / COMPLETE_MARKER).exists()
    monkeypatch.undo()
    again = plain_trainer(out)
    guard_saves(again, background=True)
    again.train(resume_from_checkpoint=True)
    assert [p.name.split(".")[0] for p in (out / SET_ASIDE_DIR).iterdir()] == ["checkpoint-4"]
    got = weights(again)
    assert all(torch.equal(got[k], uninterrupted[k]) for k in uninterrupted)


def test_off_the_saves_are_synchronous_as_the_trainers(tmp_path, monkeypatch):
    monkeypatch.setenv(background_save.BACKGROUND_ENV, "0")
    trainer = plain_trainer(tmp_path / "out", max_steps=2)
    guard_saves(trainer)
    assert trainer._hf_gpu_train_background_saves is None
    trainer.train()
    assert [c.name for c in complete_checkpoints(tmp_path / "out")] == ["checkpoint-2"]


def test_the_best_model_is_loaded_once_its_checkpoint_is_written(tmp_path, monkeypatch):
    """The best checkpoint here is the last one, still being written when the Trainer loads it (a missing file is only a
    warning there, and the weights would stay the last step's whatever the best was)."""
    SlowWrites(monkeypatch, seconds=0.2)
    found = []
    real = Trainer._load_best_model

    def load_best(self):
        best = Path(self.state.best_model_checkpoint)
        found.append((best.name, (best / COMPLETE_MARKER).is_file(), (best / "model.safetensors").is_file()))
        return real(self)

    monkeypatch.setattr(Trainer, "_load_best_model", load_best)
    trainer = plain_trainer(tmp_path / "out", TokenDataset(n=16), eval_strategy="steps", eval_steps=2,
                            load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=False)
    guard_saves(trainer, background=True)
    trainer.train()
    assert found == [("checkpoint-6", True, True)]


KILLED_DURING_WRITE = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from hf_gpu_train.faults.background_save import StagedFile
from hf_gpu_train.faults.disk_full import guard_saves
from tests.faults.test_background_save import plain_trainer
real = StagedFile.write
def write(staged_file):
    if "checkpoint-4" in staged_file.path and "optimizer" in staged_file.path:
        os.kill(os.getpid(), signal.SIGKILL)  # the machine goes away in the middle of the background write
    return real(staged_file)
StagedFile.write = write
trainer = plain_trainer({out!r})
guard_saves(trainer, background=True)
trainer.train()
"""


def test_a_process_killed_during_a_background_write_leaves_no_checkpoint_that_looks_complete(tmp_path, uninterrupted):
    out = tmp_path / "out"
    root = str(Path(__file__).resolve().parents[2])
    died = subprocess.run([sys.executable, "-c", KILLED_DURING_WRITE.format(root=root, out=str(out))], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
    assert [c.name for c in complete_checkpoints(out)] == ["checkpoint-2"]
    assert (out / "checkpoint-4").is_dir() and not (out / "checkpoint-4" / COMPLETE_MARKER).exists()
    again = plain_trainer(out)
    guard_saves(again, background=True)
    again.train(resume_from_checkpoint=True)
    got = weights(again)
    assert all(torch.equal(got[k], uninterrupted[k]) for k in uninterrupted)


def test_a_write_thread_outlives_no_train_call(tmp_path):
    trainer = plain_trainer(tmp_path / "out", max_steps=2, save_steps=1)
    guard_saves(trainer, background=True)
    trainer.train()
    assert not [t for t in threading.enumerate() if t.name.startswith("hf_gpu_train-save")]
    assert trainer._hf_gpu_train_background_saves.in_flight is None


class ReadsTheCheckpointAtOnSave(TrainerCallback):
    """What MLflow's, W&B's and Ray's callbacks do: read ``checkpoint-{state.global_step}`` in ``on_save``."""

    def __init__(self):
        self.found, self.states = [], []

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self.found.append((folder.name, (folder / "model.safetensors").is_file(), (folder / COMPLETE_MARKER).is_file()))
        self.states.append((state.epoch, len(state.log_history)))


class TimesOnSave(TrainerCallback):
    hears_of_staged_saves = True

    def __init__(self):
        self.steps, self.states = [], []

    def on_save(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)
        self.states.append((state.epoch, len(state.log_history)))


def test_callbacks_hear_of_a_save_once_its_files_are_written_and_of_its_own_step(tmp_path, monkeypatch):
    SlowWrites(monkeypatch, seconds=0.1)
    trainer = plain_trainer(tmp_path / "out")
    reader, clock = ReadsTheCheckpointAtOnSave(), TimesOnSave()
    trainer.add_callback(reader)
    trainer.add_callback(clock)
    guard_saves(trainer, background=True)
    trainer.train()
    assert reader.found == [(f"checkpoint-{s}", True, True) for s in (2, 4, 6)]
    assert clock.steps == [2, 4, 6]  # told at once, at the save's own step
    assert reader.states == clock.states  # told later, of the state as it was at the save



def test_by_default_on_a_gpu_and_off_on_the_cpu_and_the_environment_or_the_caller_decides(monkeypatch):
    from hf_gpu_train.faults.background_save import BACKGROUND_ENV, background_saves_wanted

    monkeypatch.delenv(BACKGROUND_ENV, raising=False)
    assert background_saves_wanted(None, on_gpu=True) and not background_saves_wanted("auto", on_gpu=False)
    monkeypatch.setenv(BACKGROUND_ENV, "1")
    assert background_saves_wanted(None, on_gpu=False)
    monkeypatch.setenv(BACKGROUND_ENV, "0")
    assert not background_saves_wanted("auto", on_gpu=True)
    assert background_saves_wanted(True, on_gpu=False) and not background_saves_wanted(False, on_gpu=True)


def test_the_trainers_end_of_training_cleanup_waits_for_the_last_write(tmp_path, monkeypatch):
    """Review finding (issue 38): save_total_limit=1 with a best checkpoint: the Trainer deletes every checkpoint but
    the best after the loop, before on_train_end, while the last one was still being written (a SafetensorError from
    the writer, in a run that succeeds with synchronous saves)."""
    SlowWrites(monkeypatch, seconds=0.3)
    out = tmp_path / "out"
    trainer = plain_trainer(out, TokenDataset(n=16), eval_strategy="steps", eval_steps=2, save_total_limit=1,
                            metric_for_best_model="loss", greater_is_better=True)
    guard_saves(trainer, background=True)
    trainer.train()
    best = Path(trainer.state.best_model_checkpoint)
    assert [p.name for p in out.glob("checkpoint-*")] == [best.name] and (best / COMPLETE_MARKER).is_file()


def _dcp_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    from hf_gpu_train.faults.background_save import DistributedCheckpointWrite, staged
    from tests.launching import gloo_process_group

    with gloo_process_group(rank, port):
        state = {"model": {"w": torch.full((4,), float(rank + 1))}, "optimizer": {"m": torch.arange(3.0)}}
        files: list = []
        with staged(files):
            dcp.save({"model": state["model"]}, checkpoint_id=f"{out}/model")  # accelerate's two saves of a checkpoint
            dcp.save({"optimizer": state["optimizer"]}, checkpoint_id=f"{out}/optimizer")
        asynchronous = [type(f) is DistributedCheckpointWrite for f in files]
        state["model"]["w"].add_(100.0)  # training goes on: the checkpoint holds the state at the save
        for written in files:
            written.write()
        back = {"model": {"w": torch.zeros(4)}}
        dcp.load(back, checkpoint_id=f"{out}/model")
        torch.save({"asynchronous": asynchronous, "w": back["model"]["w"], "plain_save_is_back": dcp.save.__name__},
                   f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_a_distributed_checkpoint_save_becomes_dcps_async_save_and_holds_the_state_at_the_save(tmp_path):
    """FSDP's sharded files (accelerate's dist_cp.save of the model, then of the optimizer) go to DCP's async_save,
    each on a gloo group of its own (one shared group hung the two saves' planning threads)."""
    import torch.multiprocessing as mp

    from tests.launching import free_port

    mp.spawn(_dcp_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["asynchronous"] == [True, True] and got["plain_save_is_back"] == "save"
        assert torch.equal(got["w"], torch.full((4,), 1.0))  # rank 0's replicated tensor as it was at the save
