"""The ballots that keep ranks in the same collectives, on 2 real gloo processes: a rank that reports a failure at a
gate makes every rank restart (before the collective runs), and ranks at different points with nobody failing raise
RanksDiverged instead of hanging. The loss-scaling answer is agreed when one rank sees something else."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.launching import free_port

pytestmark = pytest.mark.slow


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from hf_gpu_train.oom import lockstep
    from hf_gpu_train.oom.loss_scaling import MEAN, SUM, UNKNOWN, agree_across_ranks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    seen = {}
    try:
        lock = lockstep.Lockstep(num_params=3)
        lockstep.install_gates()
        # 1. rank 1 ran out of memory and reports it at its next ballot; rank 0 is about to all_reduce: both restart,
        #    and rank 0's all_reduce never ran (its tensor is unchanged)
        value = torch.ones(1)
        if rank == 1:
            lock.pending_failure, lock.micro_batch = True, 2
        try:
            with lock.attempt():
                dist.all_reduce(value)  # gated: a ballot first
            seen["restart"] = False
        except lockstep.RestartStep as restart:
            seen["restart"], seen["micro_batch"] = restart.outcome.restart, restart.outcome.micro_batch
        seen["untouched"] = float(value)
        lock.pending_failure, lock.micro_batch = False, None
        # 2. nobody failed; rank 0 is at a collective, rank 1 at the end of its micro-step: diverged, said on both
        try:
            with lock.attempt():
                if rank == 0:
                    dist.all_reduce(torch.ones(1))
                else:
                    outcome = lock.ballot(lockstep.END)
                    seen["end_diverged"] = outcome.diverged
            seen.setdefault("gate_diverged", False)
        except lockstep.RanksDiverged:
            seen["gate_diverged"] = True
        # 3. outside an attempt, collectives are not gated (no ballot)
        before = lock.ballots
        dist.all_reduce(torch.ones(1))
        seen["ungated"] = lock.ballots == before
        # 4. the loss-scaling verdict: one rank sees a mean, the other a sum: unknown on both
        accelerator = type("A", (), {"num_processes": 2, "device": torch.device("cpu")})()
        seen["agreed"] = agree_across_ranks(MEAN if rank == 0 else SUM, accelerator) == UNKNOWN
        lockstep.remove_gates()
        lock.close()
        torch.save(seen, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ballots_restart_every_rank_and_name_a_divergence(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    for seen in (rank0, rank1):
        assert seen["restart"] is True and seen["micro_batch"] == 2  # the smallest micro-batch any rank asked for
        assert seen["ungated"] and seen["agreed"]
    assert rank0["untouched"] == 1.0  # the collective after a failed ballot never ran
    assert rank0["gate_diverged"] is True and rank1["end_diverged"] is True
