"""The integration matrix: telemetry, the loss guard and in-place OOM recovery inside other people's trainers, on one
process and on two gloo processes, with an out-of-memory error injected on one rank in forward and in backward.

Each cell is an equality, never "it finished": the run with our pieces (and with an OOM recovered) logs the same
losses and gradient norms and ends with the same trainable weights as the same trainer without them, one process at
the whole batch. The peers: the plain ``Trainer``, a subclass whose ``compute_loss`` gathers and all-reduces on every
call (the pattern that hung TRL's ``SFTTrainer`` on 2 processes), ``Seq2SeqTrainer``, TRL's ``SFTTrainer`` (LoRA,
prompt/completion) and ``DPOTrainer`` (LoRA, reference by disabling the adapter), and ``GRPOTrainer`` (a reward
function, generation in the process), where recovery steps aside before training with its reason; and the families whose
losses are not a causal LM's (``peers.FAMILIES``), a Mixtral with its router's load-balancing loss among them.

``python -m pytest tests/integrations/test_matrix.py -s -k matrix_table`` prints the table (README: "Integration matrix").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integrations.peer_probe import record
from tests.launching import cpu_config, launch
from tests.scaling.equivalence import assert_same_params, assert_same_series, assert_trained

pytest.importorskip("trl")
pytest.importorskip("peft")
pytestmark = pytest.mark.slow

FAMILIES = ("T5Seq2Seq", "TokenClassification", "MaskedLM", "ViT", "MoECausalLM")  # peers.FAMILIES: other losses than a causal LM's
SPLITTABLE = ("Trainer", "subclass", "Seq2SeqTrainer", "SFTTrainer", "DPOTrainer", *FAMILIES)
ALL = (*SPLITTABLE, "GRPOTrainer")
# prediction steps that gather across ranks (TRL's compute_loss in eval mode), and generation (predict_with_generate)
EVALUATED = ("subclass", "SFTTrainer", "T5Seq2Seq", "MoECausalLM")
# a loss that is each rank's own mean over its labelled tokens: DDP averages the ranks' means, which is not one process's
# mean over every token when the ranks hold different token counts (the Trainer's semantics, not ours): 2 processes with
# our pieces are compared with 2 processes of the same trainer without them, told that its loss is a mean
# (model_accepts_loss_kwargs=False: without it transformers 5 multiplies these losses by the number of processes, the
# defect the loss guard corrects)
PER_RANK_MEAN = ("T5Seq2Seq", "TokenClassification", "MaskedLM")
# a router's load-balancing term is each rank's own, over its own rows (transformers multiplies it by the number of
# processes with the token term, and DDP averages): 2 processes are compared with 2 processes without our pieces
PER_RANK = (*PER_RANK_MEAN, "MoECausalLM")
EVAL = ("2 processes, evaluation", "2 processes, OOM on rank 1 in evaluation")
ONE = {"ours, no OOM": dict(per_device=8),
       "OOM in forward": dict(per_device=8, oom=dict(max_batch=4, phase="forward")),
       "OOM in backward": dict(per_device=8, oom=dict(max_batch=4, phase="backward"))}
TWO = {"2 processes, ours, no OOM": dict(per_device=4),
       "2 processes, OOM on rank 1 in forward": dict(per_device=4, oom=dict(max_batch=2, rank=1, phase="forward")),
       "2 processes, OOM on rank 1 in backward": dict(per_device=4, oom=dict(max_batch=2, rank=1, phase="backward"))}
# the original hang came at step 2 (after the loss probe's step); and a later accumulation micro-step, whose earlier
# micro-step every rank computes again: for the trainers whose compute_loss gathers
LATER = {"2 processes, OOM on rank 1 in backward at step 2": dict(
             per_device=4, oom=dict(max_batch=2, rank=1, phase="backward", start_after=1)),
         "2 processes, accumulation 2, OOM on rank 1 in its 2nd micro-step": dict(
             per_device=2, accumulation=2, oom=dict(max_batch=1, rank=1, phase="forward", start_after=1))}
GATHERING = ("subclass", "SFTTrainer")


def file_name(kind: str, name: str) -> str:
    return f"{kind}-{name.replace(' ', '_').replace(',', '')}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("matrix")
    results = {}
    for kind in ALL:
        results[(kind, "reference")] = record(out, file_name(kind, "reference"), kind=kind, per_device=8, ours=False)
        cells = ONE if kind in SPLITTABLE else {"ours, no OOM": ONE["ours, no OOM"]}
        for name, run in cells.items():
            results[(kind, name)] = record(out, file_name(kind, name), kind=kind, **run)
    plan = {file_name(kind, name): dict(kind=kind, **run) for kind in SPLITTABLE for name, run in TWO.items()}
    plan.update({file_name(kind, name): dict(kind=kind, **run) for kind in GATHERING for name, run in LATER.items()})
    for kind in EVALUATED:  # evaluation: 2 processes with an OOM on rank 1 against 2 processes without
        plan[file_name(kind, "2 processes, evaluation")] = dict(kind=kind, per_device=4, evaluate=True)
        plan[file_name(kind, "2 processes, OOM on rank 1 in evaluation")] = dict(
            kind=kind, per_device=4, evaluate=True, oom=dict(max_batch=2, rank=1, phase="forward", eval_too=True))
    # GRPO samples completions, the per-rank means average differently on 2 processes: both are compared with 2 processes
    # without our pieces
    for kind in ("GRPOTrainer", *PER_RANK):
        plan[file_name(kind, "2 processes, without ours")] = dict(kind=kind, per_device=4, ours=False,
                                                                  mean_loss=kind in PER_RANK_MEAN)
    plan[file_name("GRPOTrainer", "2 processes, ours, no OOM")] = dict(kind="GRPOTrainer", per_device=4)
    done = launch(cpu_config(out), Path(__file__).with_name("peer_probe.py"), str(out), json.dumps(plan), timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    for name in plan:
        kind = name.split("-", 1)[0]
        label = next(n for n in (*TWO, *LATER, *EVAL, "2 processes, without ours") if file_name(kind, n) == name)
        results[(kind, label)] = torch.load(out / f"{name}.rank0.pt")
        results[(kind, label, "rank 1")] = torch.load(out / f"{name}.rank1.pt")
    return results


def assert_same_run(got: dict, expected: dict) -> None:
    assert got["global_step"] == expected["global_step"]
    assert_same_series("logged loss", got["losses"], expected["losses"])
    assert_same_series("gradient norm", got["grad_norms"], expected["grad_norms"])
    assert_same_params(got["params"], expected["params"])


@pytest.mark.parametrize("kind", ALL)
def test_the_reference_trains(runs, kind):
    from tests.integrations.peers import build

    initial = {n: p.detach().clone() for n, p in build(kind, "/tmp/unused", 8).model.named_parameters() if p.requires_grad}
    assert_trained(runs[(kind, "reference")]["params"], initial, at_least=1e-3)


def reference_for(runs: dict, kind: str, name: str) -> dict:
    """One process at the whole batch; for a per-rank mean on 2 processes, 2 processes without our pieces."""
    if name.startswith("2 processes") and kind in PER_RANK:
        return runs[(kind, "2 processes, without ours")]
    return runs[(kind, "reference")]


@pytest.mark.parametrize("name", [*ONE, *TWO])
@pytest.mark.parametrize("kind", SPLITTABLE)
def test_our_pieces_and_a_recovered_oom_change_nothing(runs, kind, name):
    got = runs[(kind, name)]
    assert_same_run(got, reference_for(runs, kind, name))
    assert not got["stepped_aside"]
    oom = {**ONE, **TWO}[name].get("oom")
    if oom:
        assert got["micro_batch"] is not None and got["micro_batch"] < {**ONE, **TWO}[name]["per_device"]
    if oom and name in TWO:
        rank0, rank1 = got, runs[(kind, name, "rank 1")]
        assert rank1["ooms_raised"] >= 1 and rank0["ooms_raised"] == 0
        assert rank0["micro_batch"] == rank1["micro_batch"]  # rank 0 never ran out of memory, yet agreed
        assert_same_params(rank1["params"], rank0["params"], atol=0.0)


@pytest.mark.parametrize("name", LATER)
@pytest.mark.parametrize("kind", GATHERING)
def test_an_oom_after_the_first_step_or_in_a_later_micro_step_changes_nothing(runs, kind, name):
    got, other = runs[(kind, name)], runs[(kind, name, "rank 1")]
    assert_same_run(got, runs[(kind, "reference")])
    assert other["ooms_raised"] >= 1 and got["micro_batch"] == other["micro_batch"] < LATER[name]["per_device"]
    assert max(got["restarts"], other["restarts"]) >= 1  # every rank computed the step again, in lockstep
    assert got["tallies"] == runs[(kind, "reference")]["tallies"]


@pytest.mark.parametrize("kind", SPLITTABLE)
def test_the_trainers_own_tallies_count_each_sample_once(runs, kind):
    """TRL's num_tokens, a subclass's own token tally: a recovered step (and the loss probe) counts nothing twice."""
    for name in [*ONE, *TWO]:
        reference = reference_for(runs, kind, name)
        got = runs[(kind, name)]
        assert got["tallies"] == reference["tallies"], name
        if "tokens_seen" in reference["own_tallies"]:
            assert got["own_tallies"]["tokens_seen"] == reference["own_tallies"]["tokens_seen"], name


@pytest.mark.parametrize("kind", ALL)
def test_telemetry_reaches_the_log_history_of_every_trainer(runs, kind):
    keys = runs[(kind, "ours, no OOM")]["telemetry_keys"]
    rate = "loop/samples_per_s" if kind == "ViT" else "loop/tokens_per_s"  # images have no tokens
    assert {rate, "loop/step_time_s", "host/rss_gib"} <= set(keys), keys
    assert not any(k.startswith("train/") for k in keys)  # report_to sinks add their own "train/" prefix


@pytest.mark.parametrize("kind", EVALUATED)
def test_an_oom_in_evaluation_on_one_rank_is_recovered_with_the_same_figures(runs, kind):
    clean, got = runs[(kind, EVAL[0])], runs[(kind, EVAL[1])]
    other = runs[(kind, EVAL[1], "rank 1")]
    assert other["ooms_raised"] >= 1 and got["eval_micro_batch"] == other["eval_micro_batch"] == 2
    assert clean["evaluation"] and got["evaluation"].keys() == clean["evaluation"].keys()
    assert got["evaluation"]["eval_loss"] == pytest.approx(clean["evaluation"]["eval_loss"], rel=1e-5)
    # TRL files entropy and token accuracy once per compute_loss call and logs their mean: a step run as micro-batches
    # files one ratio per micro-batch, so these two are means over micro-batches (close, not equal; README says so)
    for key in set(clean["evaluation"]) - {"eval_loss"}:
        assert got["evaluation"][key] == pytest.approx(clean["evaluation"][key], rel=0.05), key
    assert_same_run(got, clean)  # the training before it, with OOMs too, is the same run


@pytest.mark.parametrize("kind", ["SFTTrainer", "DPOTrainer"])
@pytest.mark.parametrize("name", ["ours, no OOM", "OOM in backward"])
def test_telemetry_counts_the_training_tokens_trl_counts(runs, kind, name):
    """Training forwards only (DPO's reference pass with the adapter disabled is not one), each token once (an OOM
    recovered in place counts its batch once): the tokens TRL itself counts (attention mask) on one process."""
    got = runs[(kind, name)]
    assert got["telemetry_tokens"] == got["tallies"]["num_tokens"] > 0


def test_grpo_generation_is_counted_apart_from_training(runs):
    got = runs[("GRPOTrainer", "ours, no OOM")]
    assert got["generated_tokens"] > 0 and got["telemetry_tokens"] > 0


def test_grpo_recovery_steps_aside_before_training_and_changes_nothing(runs):
    got = runs[("GRPOTrainer", "ours, no OOM")]
    assert got["stepped_aside"] and "prepares its own batches" in got["stepped_aside"][0]
    assert_same_run(got, runs[("GRPOTrainer", "reference")])
    assert_same_run(runs[("GRPOTrainer", "2 processes, ours, no OOM")], runs[("GRPOTrainer", "2 processes, without ours")])


def test_matrix_table(runs, capsys):
    """The matrix as a table (trainer x processes x OOM phase -> outcome); every row is asserted by the tests above."""
    rows = []
    for kind in ALL:
        names = [*ONE, *TWO] if kind in SPLITTABLE else ["ours, no OOM", "2 processes, ours, no OOM"]
        names += list(LATER) if kind in GATHERING else []
        names += [EVAL[1]] if kind in EVALUATED else []
        for name in names:
            got = runs[(kind, name)]
            other = runs.get((kind, name, "rank 1"), {})
            if got["stepped_aside"]:
                outcome = "stepped aside before training (generates inside its steps); telemetry on, same run"
            elif got["ooms_raised"] or other.get("ooms_raised"):
                how = "every rank computed the step again" if max(got["restarts"], other.get("restarts", 0)) else \
                    "the rank recovered alone, the others reduced again" if other else "recovered in place"
                outcome = f"recovered, micro-batch {got['micro_batch']} ({how}); same run"
            else:
                outcome = "same run"
            rows.append(f"| {kind} | {name} | {outcome} |")
    with capsys.disabled():
        print("\n| trainer | run | outcome (same run: losses, grad norms and weights equal to the trainer without our pieces) |")
        print("|---|---|---|")
        print("\n".join(rows))
