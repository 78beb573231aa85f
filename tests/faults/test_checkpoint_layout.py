"""Which engine wrote a checkpoint, read from its files, and the resumes the Trainer would get wrong refused before the
first step (issue 38, item 3). The resumes that work on another number of processes are run in
tests/scaling/test_deepspeed_equivalence.py and test_fsdp_equivalence.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_gpu_train.errors import UsageError
from hf_gpu_train.faults.checkpoint_layout import DEEPSPEED, FSDP, WHOLE, CheckpointLayout, check_resume, layout_of


def folder(root: Path, name: str, *files: str) -> Path:
    path = root / name
    for file in files:
        (path / file).parent.mkdir(parents=True, exist_ok=True)
        (path / file).write_bytes(b"")
    return path


def trainer(deepspeed=False, fsdp=False):
    return SimpleNamespace(is_deepspeed_enabled=deepspeed, is_fsdp_enabled=fsdp)


def test_the_layout_is_read_from_the_files(tmp_path):
    zero = folder(tmp_path, "checkpoint-4", "model.safetensors", "global_step4/mp_rank_00_model_states.pt",
                  "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt", "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt",
                  "global_step4/zero_pp_rank_2_mp_rank_00_optim_states.pt")
    assert layout_of(zero) == CheckpointLayout(DEEPSPEED, 3)
    bf16 = folder(tmp_path, "checkpoint-5", "global_step5/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                  "global_step5/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert layout_of(bf16) == CheckpointLayout(DEEPSPEED, 2)
    assert layout_of(folder(tmp_path, "checkpoint-6", "pytorch_model_fsdp_0/__0_0.distcp", "optimizer_0/__1_0.distcp")) == \
        CheckpointLayout(FSDP)
    assert layout_of(folder(tmp_path, "checkpoint-7", "model.safetensors", "optimizer.pt", "scheduler.pt")) == CheckpointLayout(WHOLE)
    assert layout_of(folder(tmp_path, "checkpoint-8", "model.safetensors")) is None  # save_only_model: said elsewhere
    assert layout_of(tmp_path / "absent") is None


def test_a_deepspeed_checkpoint_resumed_without_deepspeed_is_refused_with_the_strategy_that_resumes_it(tmp_path):
    """Measured before: weights 2.0e-3 from the uninterrupted run, the optimizer started afresh without a word."""
    zero = folder(tmp_path, "checkpoint-4", "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                  "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(UsageError) as refused:
        check_resume(trainer(), str(zero), 1)
    message = str(refused.value)
    assert "checkpoint-4 was written under DeepSpeed and this run is DDP or one process" in message
    assert "start the optimizer afresh, without a word" in message and "--strategy deepspeed-zero2 or -zero3" in message
    with pytest.raises(UsageError, match="under DeepSpeed and this run is FSDP"):
        check_resume(trainer(fsdp=True), zero, 2)


def test_fsdp_and_whole_checkpoints_resume_under_their_own_engine_on_any_count(tmp_path):
    sharded = folder(tmp_path, "checkpoint-6", "pytorch_model_fsdp_0/__0_0.distcp")
    whole = folder(tmp_path, "checkpoint-7", "optimizer.pt")
    for processes in (1, 2, 3):
        check_resume(trainer(fsdp=True), sharded, processes)
        check_resume(trainer(), whole, processes)
    with pytest.raises(UsageError, match="written under FSDP and this run is DDP or one process.*only supported when using"):
        check_resume(trainer(), sharded, 2)
    with pytest.raises(UsageError, match="written under DDP or one process and this run is DeepSpeed"):
        check_resume(trainer(deepspeed=True), whole, 2)
    check_resume(trainer(), None, 2)  # nothing to resume
    check_resume(trainer(), True, 2)  # not resolved to a folder: the Trainer's own error stands
