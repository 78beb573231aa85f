"""Comparisons shared by the scaling tests, with tolerances that come from fp32 reduction order.

Two runs that see the same samples per optimizer step differ only in how sums are grouped: a batch
of 8 as one mean, as two means of 4 averaged (accumulation, or two processes), or in micro-batches
split by the OOM recovery. Each regrouping changes a fp32 sum by a few ulps (eps = 1.2e-7) of its terms;
over these tiny models that is ~1e-7 relative on a loss or a gradient norm, so ``LOSS_RTOL = 1e-5``
leaves two orders of magnitude of headroom while a loss or gradient that is 2x (or 1.01x) too large fails.
Weights are compared after 6 AdamW steps at lr 1e-3: a step moves a weight by at most ~lr, so
``PARAM_ATOL = 1e-5`` is 1% of one step. The runs use AdamW's eps at 1e-6 instead of 1e-8: a parameter
whose true gradient is zero (an attention key bias: softmax ignores a shift) gets pure rounding noise
(~1e-9) as gradient, which AdamW divides by sqrt(v) ~ the same noise, turning it into steps of ~0.1 lr
that differ between any two summation orders; at eps 1e-6 such steps shrink to ~1e-3 lr, while every real
gradient (> 1e-4 here) is normalised as before. AdamW is almost blind to a constant gradient scale
(m / sqrt(v)), so a weights check alone would miss a 2x loss: losses and gradient norms are compared too.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5


def assert_same_series(name: str, got: list[float], expected: list[float], rtol: float = LOSS_RTOL) -> None:
    assert len(got) == len(expected) and got, f"{name}: {len(got)} values against {len(expected)}"
    for step, (a, b) in enumerate(zip(got, expected), 1):
        assert abs(a - b) <= rtol * abs(b), f"{name} at step {step}: {a} against {b} (ratio {a / b:.6f})"


def assert_same_params(got: dict, expected: dict, atol: float = PARAM_ATOL) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        diff = (got[key].float() - expected[key].float()).abs().max().item()
        assert diff <= atol, f"parameter {key} differs by {diff:.3g} (tolerance {atol})"


def assert_same_evaluation(got: Path, expected: Path) -> None:
    """Every evaluation's loss during training (trainer_state.json), and the final evaluation's loss and accuracy
    (all_results.json)."""
    during = [[h["eval_loss"] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "eval_loss" in h]
              for out in (got, expected)]
    assert_same_series("evaluation loss during training", *during)
    a, b = (json.loads((out / "all_results.json").read_text()) for out in (got, expected))
    assert_same_series("evaluation loss", [a["eval_loss"]], [b["eval_loss"]])
    assert a["eval_accuracy"] == b["eval_accuracy"], f"evaluation accuracy {a['eval_accuracy']} against {b['eval_accuracy']}"


def assert_trained(final: dict, initial: dict, at_least: float = 100 * PARAM_ATOL) -> None:
    """The comparison means something only if training moved the weights well beyond the tolerance."""
    moved = max((final[k].float() - initial[k].float()).abs().max().item() for k in initial if initial[k].is_floating_point())
    assert moved >= at_least, f"weights moved only {moved:.3g}: the equality checks would compare too little"


def assert_same_run(got: dict, expected: dict) -> None:
    assert got["global_step"] == expected["global_step"]
    assert_same_series("logged loss", got["losses"], expected["losses"])
    assert_same_series("gradient norm", got["grad_norms"], expected["grad_norms"])
    assert_same_params(got["params"], expected["params"])


def initial_params(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
