"""``scripts/finetune.py`` trains the same model from one process with a batch of 16, one process of 8 with
accumulation 2, two gloo processes of 8, and two of 4 with accumulation 2: the same logged losses and
gradient norms at every step, the same saved weights; and the loss it logs at step 1 is the mean loss of
step 1's 16 samples computed by hand. For a transformers text model and a timm vision model, through the
entry point's defaults (OOM recovery and telemetry on). Tolerances: tests/scaling/equivalence.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hf_gpu_train.finetune.run import main
from tests.launching import cpu_config, launch
from tests.scaling.equivalence import assert_same_params, assert_same_series
from tests.scaling.finetune_cases import (
    COMMON,
    EPOCHS,
    GLOBAL_BATCH,
    text_case,
    text_loss_by_hand,
    vision_case,
    vision_loss_by_hand,
)

pytestmark = pytest.mark.slow
HALF = GLOBAL_BATCH // 2
# The reference evaluates nothing before training, the 2-process runs do (evaluate_before=true): the evaluation at
# train begin, on 2 processes, must change nothing they train (an earlier version prepared the model in evaluation mode
# first, and 2 processes trained other weights)
ONE_PROCESS = {"1 x 16": [f"per_device_train_batch_size={GLOBAL_BATCH}", "evaluate_before=false"],
               "1 x 8, accumulation 2": [f"per_device_train_batch_size={HALF}", f"global_batch_size={GLOBAL_BATCH}"]}
TWO_PROCESSES = {"2 x 8": [f"per_device_train_batch_size={HALF}", "evaluate_before=true"],
                 "2 x 4, accumulation 2": [f"per_device_train_batch_size={HALF // 2}", f"global_batch_size={GLOBAL_BATCH}",
                                           "evaluate_before=true"]}
CASES = {"text": (text_case, text_loss_by_hand), "vision": (vision_case, vision_loss_by_hand)}


def run_dir(root: Path, kind: str, name: str) -> Path:
    return root / "runs" / f"{kind}-{name.replace(' ', '').replace(',', '_')}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("finetune-scaling")
    arguments = {}
    for kind, (make, _) in CASES.items():
        (root / kind).mkdir()
        arguments[kind] = make(root / kind)
    for kind, base in arguments.items():
        for name, extra in ONE_PROCESS.items():
            assert main([*base, *COMMON, *extra, f"output_dir={run_dir(root, kind, name)}"]) == 0
    plan = [[*base, *COMMON, *extra, f"output_dir={run_dir(root, kind, name)}"]
            for kind, base in arguments.items() for name, extra in TWO_PROCESSES.items()]
    done = launch(cpu_config(root), Path(__file__).with_name("finetune_probe.py"), json.dumps(plan), timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return {"root": root}


def history(out: Path, key: str) -> list[float]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [h[key] for h in state["log_history"] if key in h]


@pytest.mark.parametrize("name", list(ONE_PROCESS)[1:] + list(TWO_PROCESSES))
@pytest.mark.parametrize("kind", CASES)
def test_same_losses_gradients_and_weights_as_one_process_of_16(trained, kind, name):
    reference, got = run_dir(trained["root"], kind, "1 x 16"), run_dir(trained["root"], kind, name)
    steps = {"text": 2 * EPOCHS, "vision": EPOCHS}[kind]  # text: two global batches per epoch, in length-grouped order
    assert json.loads((got / "run_summary.json").read_text())["global_step"] == steps
    assert not (reference / "baseline_results.json").exists()
    assert (got / "baseline_results.json").is_file()  # evaluated first (auto on 1 process, true on 2)
    assert_same_series("logged loss", history(got, "loss"), history(reference, "loss"))
    assert_same_series("gradient norm", history(got, "grad_norm"), history(reference, "grad_norm"))
    assert_same_params(load_file(got / "model.safetensors"), load_file(reference / "model.safetensors"))


@pytest.mark.parametrize("name", list(ONE_PROCESS) + list(TWO_PROCESSES))
@pytest.mark.parametrize("kind", CASES)
def test_the_loss_logged_at_step_1_is_the_mean_loss_of_the_batch(trained, kind, name):
    by_hand = CASES[kind][1](trained["root"] / kind)
    assert_same_series("step-1 loss", history(run_dir(trained["root"], kind, name), "loss")[:1], [by_hand])
