"""A plain Trainer with hf_gpu_train's guard or OOM recovery trains the same model whether the batch of 8
runs as one batch, as 2 x 4 accumulated, on 2 gloo processes of 4 (or 2 x 2 accumulated), split by the
OOM recovery after an out-of-memory error (in forward or in backward, on one rank only): same logged
losses, same gradient norms, same weights. For a classifier with a per-batch mean loss (BERT), a timm ViT, and
a causal LM whose loss is normalised by the batch's label-token count (Llama). Tolerances: tests/scaling/equivalence.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launching import cpu_config, launch
from tests.scaling.equivalence import assert_same_run, assert_trained, initial_params
from tests.scaling.models import KINDS, model_and_data
from tests.scaling.trainer_probe import record

pytestmark = pytest.mark.slow

ONE_PROCESS = {
    "accumulation": dict(per_device=4, accumulation=2),
    "recovery, no OOM": dict(per_device=8, recovery=True),
    "OOM in forward": dict(per_device=8, recovery=True, oom=dict(max_batch=4, phase="forward")),
    "OOM in backward": dict(per_device=8, recovery=True, oom=dict(max_batch=4, phase="backward")),
    # the second micro-step of the first optimizer step runs out of memory in forward: nothing is dropped
    "OOM in a later micro-step": dict(per_device=4, accumulation=2, recovery=True,
                                      oom=dict(max_batch=2, phase="forward", start_after=1)),
    # ... part-way through its backward: the first micro-step is computed again from its inputs
    "OOM in backward in a later micro-step": dict(per_device=4, accumulation=2, recovery=True,
                                                  oom=dict(max_batch=2, phase="backward", start_after=1)),
}
TWO_PROCESSES = {
    "2 processes": dict(per_device=4),
    "2 processes, accumulation": dict(per_device=2, accumulation=2),
    "2 processes, recovery, no OOM": dict(per_device=4, recovery=True),
    "2 processes, OOM on rank 1 in forward": dict(per_device=4, recovery=True, oom=dict(max_batch=2, rank=1, phase="forward")),
    "2 processes, OOM on rank 1 in backward": dict(per_device=4, recovery=True, oom=dict(max_batch=2, rank=1, phase="backward")),
    "2 processes, OOM on rank 1 in a later micro-step": dict(per_device=2, accumulation=2, recovery=True,
                                                            oom=dict(max_batch=1, rank=1, phase="forward", start_after=1)),
    "2 processes, OOM on rank 1 in backward in a later micro-step": dict(
        per_device=2, accumulation=2, recovery=True, oom=dict(max_batch=1, rank=1, phase="backward", start_after=1)),
    # 4 KiB buckets: every model here spans several, so all-reduces leave while backward runs, and fail part-way
    "2 processes, recovery, no OOM, small buckets": dict(per_device=4, recovery=True, bucket_bytes=4096),
    "2 processes, OOM on rank 1 in backward, small buckets": dict(per_device=4, recovery=True, bucket_bytes=4096,
                                                                  oom=dict(max_batch=2, rank=1, phase="backward")),
}
EXPECTED_MICRO_BATCH = {"OOM in forward": 4, "OOM in backward": 4, "OOM in a later micro-step": 2,
                        "OOM in backward in a later micro-step": 2, "2 processes, OOM on rank 1 in forward": 2,
                        "2 processes, OOM on rank 1 in backward": 2, "2 processes, OOM on rank 1 in a later micro-step": 1,
                        "2 processes, OOM on rank 1 in backward in a later micro-step": 1,
                        "2 processes, OOM on rank 1 in backward, small buckets": 2}


def file_name(kind: str, name: str) -> str:
    return f"{kind}-{name.replace(' ', '_').replace(',', '')}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every configuration of both models: one process in this test process, two in one gloo launch."""
    out = tmp_path_factory.mktemp("scaling")
    results = {}
    for kind in KINDS:
        results[(kind, "reference")] = record(out, file_name(kind, "reference"), kind=kind, per_device=8)
        for name, run in ONE_PROCESS.items():
            results[(kind, name)] = record(out, file_name(kind, name), kind=kind, **run)
    plan = {file_name(kind, name): dict(kind=kind, **run) for kind in KINDS for name, run in TWO_PROCESSES.items()}
    plan["text-plain_Trainer"] = dict(kind="text", per_device=4, guard=False)
    plan["causal-plain_Trainer"] = dict(kind="causal", per_device=4, guard=False)
    done = launch(cpu_config(out), Path(__file__).with_name("trainer_probe.py"), str(out), json.dumps(plan), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    for kind in KINDS:
        for name in TWO_PROCESSES:
            rank0 = torch.load(out / f"{file_name(kind, name)}.rank0.pt")
            rank1 = torch.load(out / f"{file_name(kind, name)}.rank1.pt")
            results[(kind, name)] = rank0
            results[(kind, name, "rank 1")] = rank1
    for kind in ("text", "causal"):
        results[(kind, "plain Trainer")] = torch.load(out / f"{kind}-plain_Trainer.rank0.pt")
    return results


@pytest.mark.parametrize("kind", KINDS)
def test_the_reference_run_trains(runs, kind):
    model, _ = model_and_data(kind)
    assert_trained(runs[(kind, "reference")]["params"], initial_params(model))


@pytest.mark.parametrize("name", list(ONE_PROCESS) + list(TWO_PROCESSES))
@pytest.mark.parametrize("kind", KINDS)
def test_same_losses_gradients_and_weights_as_one_batch(runs, kind, name):
    got = runs[(kind, name)]
    assert_same_run(got, runs[(kind, "reference")])
    assert got["micro_batch"] == EXPECTED_MICRO_BATCH.get(name)
    if name in ONE_PROCESS and ONE_PROCESS[name].get("oom"):
        assert got["ooms_raised"] >= 1, "the injector never fired"


@pytest.mark.parametrize("name", TWO_PROCESSES)
@pytest.mark.parametrize("kind", KINDS)
def test_both_ranks_end_with_the_same_weights_and_micro_batch(runs, kind, name):
    rank0, rank1 = runs[(kind, name)], runs[(kind, name, "rank 1")]
    assert rank0["micro_batch"] == rank1["micro_batch"]  # rank 0 never ran out of memory, yet agreed
    for key in rank0["params"]:
        assert torch.equal(rank0["params"][key], rank1["params"][key]), key
    if TWO_PROCESSES[name].get("oom"):
        assert rank1["ooms_raised"] >= 1 and rank0["ooms_raised"] == 0
    if TWO_PROCESSES[name].get("bucket_bytes"):
        assert rank0["overlapped_buckets"] > 0  # all-reduces really left while backward ran


def test_the_plain_trainer_is_right_for_a_token_normalised_loss(runs):
    """transformers 5's num_items_in_batch machinery is right for the losses it was made for: the guard leaves it alone."""
    assert_same_run(runs[("causal", "plain Trainer")], runs[("causal", "reference")])


def test_the_plain_trainer_logs_n_times_the_loss_on_n_processes(runs):
    """Upstream behaviour (transformers 5) that the guard corrects: BERT's forward takes **kwargs, so its
    mean loss is taken for a num_items-normalised one and multiplied by the number of processes."""
    plain, reference = runs[("text", "plain Trainer")], runs[("text", "reference")]
    assert abs(plain["losses"][0] / reference["losses"][0] - 2.0) < 1e-4
