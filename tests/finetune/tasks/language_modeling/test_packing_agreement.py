"""Every rank takes the same packing decision, even when one rank alone sees a reason to refuse (under FSDP's
rank-0-only loading, only rank 0 holds weights it can run the check on)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.launching import free_port, gloo_process_group


def _rank(rank: int, port: int, out: str) -> None:
    from hf_gpu_train.finetune.tasks.language_modeling import packing

    with gloo_process_group(rank, port):
        seen = {0: packing.PackingVerdict(True, "sdpa attention (weights not loaded on this process, so not run)"),
                1: packing.PackingVerdict(False, "attention crosses example boundaries")}
        packing.packing_support = lambda model, pad: seen[rank]  # what each rank sees on its own
        verdict = packing.agreed_packing_support(None, 0)
        torch.save((verdict.supported, verdict.reason), f"{out}/rank{rank}.pt")


@pytest.mark.slow
def test_one_ranks_refusal_is_every_ranks(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert rank0[0] is False and rank1[0] is False
    assert "found on rank 1: every rank pads" in rank0[1]
