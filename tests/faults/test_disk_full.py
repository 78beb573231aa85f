"""A disk that fills up while a checkpoint is written (issue 18, item 5): the run stops with exit 2 and a message naming
the directory, the free space and the checkpoint's size; the half-written checkpoint is set aside; every earlier
checkpoint and the config survive; the same command again (with space) resumes from the last complete one."""

from __future__ import annotations

import errno
import json
import subprocess
import uuid

import pytest
import torch

from hf_gpu_train.faults.disk_full import is_disk_full
from hf_gpu_train.finetune.checkpoints import COMPLETE_MARKER, SET_ASIDE_DIR
from hf_gpu_train.finetune.run import main
from tests.finetune.test_resume import args, case  # noqa: F401 (the module's small text case, a fixture)

pytestmark = pytest.mark.slow


def test_a_full_disk_is_recognised_however_the_writer_wrapped_it():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(RuntimeError("SafetensorError: IoError(Os { code: 28, kind: StorageFull, message: ... })"))
    # torch.save's writer without the errno ("unexpected pos") counts when the space left is less than the save needs:
    # tests/faults/test_disk_full.py's tmpfs case, and benchmarks/faults.py's 2-process one (MiniLM's optimizer.pt)
    try:
        try:
            raise OSError(errno.EDQUOT, "quota")
        except OSError as inner:
            raise RuntimeError("[enforce fail at inline_container.cc:664] PytorchStreamWriter failed writing file") from inner
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))


def _assert_stopped_cleanly(out, err: str, failed_step: int) -> None:
    assert f"the disk holding {out} is full: writing a checkpoint to {out / f'checkpoint-{failed_step}'} failed with" in err
    assert "free of" in err and "it needs about" in err and "Kept: checkpoint-2, and the config." in err
    assert f"The half-written checkpoint-{failed_step} has no completion marker: the next run sets it aside" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", f"checkpoint-{failed_step}"]
    assert (out / "checkpoint-2" / COMPLETE_MARKER).is_file() and (out / "finetune_config.yaml").is_file()
    assert not (out / f"checkpoint-{failed_step}" / COMPLETE_MARKER).exists()


def disk_full_at_step(monkeypatch, step: int, message: str):
    """The Trainer's optimizer save fails at ``step`` as a full disk makes it fail (the library's own error, raised from
    ENOSPC); returns the original method, to give the space back."""
    from transformers import Trainer

    original = Trainer._save_optimizer_and_scheduler

    def fills_up(self, output_dir):
        if self.state.global_step == step:
            raise RuntimeError(message) from OSError(errno.ENOSPC, "No space left on device")
        return original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", fills_up)
    return original


def test_an_injected_full_disk_at_the_second_checkpoint(tmp_path, case, capsys, monkeypatch):  # noqa: F811
    from transformers import Trainer

    original = disk_full_at_step(monkeypatch, 4, "[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0: "
                                                 "file write failed")
    out = tmp_path / "out"
    command = args(case, out, "save_strategy=steps", "save_steps=2")
    assert main(command) == 2
    _assert_stopped_cleanly(out, capsys.readouterr().err, 4)
    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", original)
    assert main(command) == 0  # space again: the same command resumes from checkpoint-2
    assert f"resuming from {out / 'checkpoint-2'}" in capsys.readouterr().out
    assert [p.name.split(".")[0] for p in (out / SET_ASIDE_DIR).iterdir()] == ["checkpoint-4"]  # the half-written one


@pytest.fixture
def small_tmpfs(tmp_path):
    folder = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'mount failed'}): needs root or CAP_SYS_ADMIN")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_a_real_disk_that_fills_up_on_a_small_tmpfs(small_tmpfs, case, capsys):  # noqa: F811
    """16 MiB: the config and one checkpoint (model + AdamW state, ~12 MiB) fit; the second does not."""
    out = small_tmpfs / "out"
    assert main(args(case, out, "save_strategy=steps", "save_steps=2", "save_total_limit=3")) == 2
    _assert_stopped_cleanly(out, capsys.readouterr().err, 4)


def _plain_trainer(out, max_steps=4):
    from transformers import Trainer

    from tests.callbacks.tiny import TokenDataset, tiny_args, tiny_bert

    return Trainer(model=tiny_bert(), args=tiny_args(out, max_steps=max_steps, per_device_train_batch_size=8, logging_steps=1,
                                                     save_strategy="steps", save_steps=1),
                   train_dataset=TokenDataset(n=64))


def _weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("resume", ["newest", "the half-written path"])
def test_guard_saves_in_a_plain_trainer_keeps_checkpoint_1_and_resumes_from_it(tmp_path, monkeypatch, caplog, resume):
    """Issue 28, item 5: in anyone's Trainer, guard_saves marks each complete checkpoint, so a disk that fills up at the
    second checkpoint names checkpoint-1 as kept, and train(resume_from_checkpoint=True) (or the half-written
    checkpoint's own path) sets checkpoint-2 aside and resumes from checkpoint-1, to the weights of an uninterrupted
    run."""
    from transformers import Trainer

    from hf_gpu_train.faults.disk_full import DiskFullError, guard_saves

    reference = _plain_trainer(tmp_path / "reference")
    reference.train()
    out = tmp_path / "out"
    original = disk_full_at_step(monkeypatch, 2, "SafetensorError: IoError(Os { code: 28, kind: StorageFull, message: ... })")
    first = _plain_trainer(out)
    guard_saves(first)
    with pytest.raises(DiskFullError) as raised:
        first.train()
    message = str(raised.value)
    assert f"writing a checkpoint to {out / 'checkpoint-2'} failed with" in message
    assert "Kept: checkpoint-1." in message and "no complete checkpoint" not in message and "config" not in message
    assert "train(resume_from_checkpoint=True) resumes from checkpoint-1" in message
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", original)

    second = _plain_trainer(out)
    guard_saves(second)
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_gpu_train"):
        second.train(resume_from_checkpoint=True if resume == "newest" else str(out / "checkpoint-2"))
    said = [r.getMessage() for r in caplog.records if r.name.startswith("hf_gpu_train")]
    assert len(said) == 1 and f"resuming from {out / 'checkpoint-1'}" in said[0] and "checkpoint-2" in said[0], said
    aside = list((out / SET_ASIDE_DIR).iterdir())
    assert [p.name.split(".")[0] for p in aside] == ["checkpoint-2"]  # set aside, not deleted
    assert second.state.global_step == 4
    got, expected = _weights(second), _weights(reference)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    # every checkpoint the resumed run wrote is complete, the one it wrote again at step 2 included
    assert all((p / COMPLETE_MARKER).is_file() for p in out.glob("checkpoint-*"))


def test_the_trainers_rotation_waits_for_the_marker_of_the_checkpoint_that_replaces(tmp_path):
    """save_total_limit=1: the Trainer deletes checkpoint-1 at the end of its own save of checkpoint-2, before every rank
    has written and the marker is set. A full disk after that (the caller's files, another rank's RNG state) would leave
    no complete checkpoint at all: the rotation waits until checkpoint-2 is marked complete."""
    from hf_gpu_train.faults.checkpoint_marker import COMPLETE_MARKER
    from hf_gpu_train.faults.disk_full import DiskFullError, guard_saves

    out = tmp_path / "out"
    trainer = _plain_trainer(out)
    trainer.args.save_total_limit = 1

    def label_map(folder):  # the caller's own files, written just before the marker
        if folder.name == "checkpoint-2":
            raise OSError(errno.ENOSPC, "No space left on device")

    guard_saves(trainer, before_marker=label_map)
    with pytest.raises(DiskFullError):
        trainer.train()
    assert (out / "checkpoint-1" / COMPLETE_MARKER).is_file()  # still there, complete
    assert not (out / "checkpoint-2" / COMPLETE_MARKER).exists()


def test_with_save_on_each_node_nodes_that_would_resume_from_different_steps_stop_with_the_fix(tmp_path, monkeypatch):
    """Review finding (issue 36): each node picks the newest complete checkpoint of its own disk; a node stopped between
    two nodes' saves holds another step. The ranks compare the step (one all-reduce); here the other node has step 2."""
    from transformers import Trainer, TrainingArguments

    from hf_gpu_train.errors import UsageError
    from hf_gpu_train.faults import disk_full
    from hf_gpu_train.faults.checkpoint_marker import COMPLETE_MARKER
    from tests.callbacks.tiny import TokenDataset, tiny_bert

    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    (folder / "trainer_state.json").write_text("{}")
    (folder / COMPLETE_MARKER).write_text("{}")
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to="none", use_cpu=True,
                             save_on_each_node=True, disable_tqdm=True)
    trainer = Trainer(model=tiny_bert(), args=args, train_dataset=TokenDataset(n=8))
    disk_full.guard_saves(trainer)
    monkeypatch.setattr(disk_full, "lowest_and_highest", lambda step: (2, step))
    with pytest.raises(UsageError, match="resume from different checkpoints.*checkpoint-2"):
        trainer.train(resume_from_checkpoint=True)


def test_a_resume_with_a_stateful_callback_the_checkpoint_did_not_know_saves(tmp_path):
    """transformers' _save_checkpoint reads state.stateful_callbacks[name] for every stateful callback; a state resumed
    from a checkpoint written without one (a DeepSpeed run, where OOM recovery is off, resumed on one process, where it
    is on; a callback added since) raised KeyError: 'OOMRecoveryState' at the first save of the resumed run."""
    from hf_gpu_train.faults.disk_full import guard_saves
    from hf_gpu_train.oom import enable_oom_recovery

    out = tmp_path / "out"
    first = _plain_trainer(out, max_steps=2)
    guard_saves(first)
    first.train()
    second = _plain_trainer(out, max_steps=4)
    guard_saves(second)
    enable_oom_recovery(second)
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 4
    saved = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert "OOMRecoveryState" in saved
