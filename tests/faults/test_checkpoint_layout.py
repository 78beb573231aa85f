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


def test_the_step_deepspeed_loads_is_the_one_latest_names_else_the_highest(tmp_path):
    from hf_gpu_train.faults.deepspeed_resharding import latest_step_folder

    checkpoint = folder(tmp_path, "checkpoint-10", "global_step9/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                        "global_step10/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                        "global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt", "global_step10_universal/zero/x.pt")
    assert latest_step_folder(checkpoint).name == "global_step10"  # not "global_step9" by string order
    assert layout_of(checkpoint) == CheckpointLayout(DEEPSPEED, 2)  # that step's partitions only
    (checkpoint / "latest").write_text("global_step9")
    assert latest_step_folder(checkpoint).name == "global_step9" and layout_of(checkpoint) == CheckpointLayout(DEEPSPEED, 1)


def test_partitions_on_each_nodes_own_disk_are_not_resharded(tmp_path, monkeypatch):
    zero = folder(tmp_path, "checkpoint-4", "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                  "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    on_each_node = SimpleNamespace(is_deepspeed_enabled=True, is_fsdp_enabled=False,
                                   args=SimpleNamespace(save_on_each_node=True, world_size=4))
    with pytest.raises(UsageError, match="save_on_each_node: each node keeps its own ranks' partitions"):
        check_resume(on_each_node, zero, 4)


def test_what_deepspeeds_universal_load_leaves_out_is_put_back_as_saved(tmp_path):
    """Buffers (no module state is loaded), one step tensor per sub-group (ZeRO-3 shares one), every group's own
    hyperparameters (ZeRO-3 copies the first group's), and later loads DeepSpeed's own checkpoints again."""
    import torch

    from hf_gpu_train.faults.deepspeed_resharding import _as_saved

    step_folder = tmp_path / "checkpoint-4" / "global_step4"
    (tmp_path / "checkpoint-4" / "global_step4_universal" / "zero").mkdir(parents=True)
    step_folder.mkdir()
    saved_norm = torch.nn.BatchNorm1d(3)
    saved_norm.running_mean.fill_(0.5)
    saved_norm.num_batches_tracked.fill_(4)
    torch.save({"module": {**saved_norm.state_dict(), "weight": torch.empty(0)}}, step_folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"param_groups": [{"weight_decay": 0.01, "lr": 3e-4, "params": [0]},
                                                          {"weight_decay": 0.0, "lr": 3e-4, "params": [1]}]}},
               tmp_path / "checkpoint-4" / "global_step4_universal" / "zero" / "optimizer_state.pt")
    model = torch.nn.BatchNorm1d(3)
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    inner = torch.optim.AdamW([{"params": [a], "weight_decay": 0.01}, {"params": [b], "weight_decay": 0.01}])  # as loaded
    shared = torch.tensor(4.0)
    inner.state[a]["step"], inner.state[b]["step"] = shared, shared
    engine = SimpleNamespace(module=model, optimizer=SimpleNamespace(optimizer=inner),
                             _config=SimpleNamespace(load_universal_checkpoint=True))
    _as_saved(engine, step_folder)
    assert torch.equal(model.running_mean, torch.full((3,), 0.5)) and int(model.num_batches_tracked) == 4
    assert inner.state[a]["step"] is not inner.state[b]["step"] and float(inner.state[b]["step"]) == 4.0
    assert [g["weight_decay"] for g in inner.param_groups] == [0.01, 0.0]
    assert [g["params"] for g in inner.param_groups] == [[a], [b]]
    assert engine._config.load_universal_checkpoint is False
