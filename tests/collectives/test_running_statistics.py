"""BatchNorm's running statistics made rank 0's on every rank after each optimizer step, and the clipping line
(issue 41). The outcome under DeepSpeed and FSDP against DDP: tests/scaling/test_deepspeed_equivalence.py and
test_fsdp_equivalence.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from hf_gpu_train.collectives.clipping_order import clipping_order_line
from hf_gpu_train.collectives.running_statistics import (
    RunningStatisticsBroadcast,
    running_statistics,
    share_running_statistics,
)
from tests.launching import free_port, gloo_process_group


def batchnorm_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.LayerNorm(2),
                               torch.nn.BatchNorm1d(2, track_running_stats=False), torch.nn.InstanceNorm1d(3))


def test_the_running_statistics_are_the_tracking_norms_buffers_in_model_order():
    net = batchnorm_net()
    found = running_statistics(net)
    assert [t.data_ptr() for t in found] == [net[1].running_mean.data_ptr(), net[1].running_var.data_ptr(),
                                             net[1].num_batches_tracked.data_ptr()]
    assert running_statistics(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))) == []


def trainer(world_size: int, model=None, *, deepspeed=False, fsdp=False, max_grad_norm=1.0):
    added = []
    return SimpleNamespace(model=model or batchnorm_net(), args=SimpleNamespace(world_size=world_size, max_grad_norm=max_grad_norm),
                           is_deepspeed_enabled=deepspeed, is_fsdp_enabled=fsdp, add_callback=added.append, added=added)


def test_one_process_or_a_model_without_running_statistics_gets_nothing():
    alone = trainer(1)
    assert share_running_statistics(alone) == [] and alone.added == []
    layer_norm_only = trainer(2, torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)))
    assert share_running_statistics(layer_norm_only) == [] and layer_norm_only.added == []
    several = trainer(2)
    assert share_running_statistics(several)[0].startswith("BatchNorm running statistics: rank 0's on every rank")
    assert [type(c) for c in several.added] == [RunningStatisticsBroadcast]


def test_clipping_is_said_only_where_a_sharded_engine_clips_over_several_processes():
    assert clipping_order_line(trainer(2)) == []  # DDP: the Trainer's own clip_grad_norm_
    assert clipping_order_line(trainer(1, deepspeed=True)) == []
    assert clipping_order_line(trainer(2, fsdp=True, max_grad_norm=0.0)) == []
    line = clipping_order_line(trainer(2, fsdp=True))[0]
    assert line.startswith("gradient clipping at 1 under FSDP") and "1.2e-3 apart" in line and "max_grad_norm=0" in line
    assert clipping_order_line(trainer(2, deepspeed=True, max_grad_norm=0.5))[0].startswith("gradient clipping at 0.5 under DeepSpeed")


def _rank(rank: int, port: int, out: str) -> None:
    with gloo_process_group(rank, port):
        torch.manual_seed(rank)  # each rank's own batches
        net = batchnorm_net().train()
        for _ in range(rank + 1):
            net[:2](torch.randn(3, 3, 5, 5))
        RunningStatisticsBroadcast(net).on_step_end(None, None, None)
        torch.save({k: v for k, v in net.state_dict().items() if k.startswith("1.")}, f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_after_a_step_every_rank_holds_rank_0s_statistics(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert int(rank0["1.num_batches_tracked"]) == 1  # rank 1 had counted 2 batches of its own
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    assert not torch.equal(rank0["1.running_var"], torch.ones(4))  # moved by the batch, then broadcast
