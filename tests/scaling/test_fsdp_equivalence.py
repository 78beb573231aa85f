"""FSDP2 through scripts/finetune.py and a config from `hf-gpu-train config --strategy fsdp`: two gloo processes
sharding the model train what one process trains (the same losses, gradient norms and final weights), checkpoints
are written as shards (one file per rank), a run killed after a sharded checkpoint resumes from it to the same
final weights on another number of processes (2 -> 1, then 1 -> 2), and the final model is saved whole; a BatchNorm model trains and evaluates what DDP does on the same 2
processes (issue 41, tests/scaling/conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hf_gpu_train.finetune.run import main
from tests.launching import free_port, launch
from tests.scaling.equivalence import assert_same_evaluation, assert_same_params, assert_same_series
from tests.scaling.finetune_cases import COMMON, GLOBAL_BATCH, as_if_killed_after, text_case

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "finetune.py"


def fsdp_config(tmp_path: Path) -> Path:
    out = tmp_path / "fsdp"
    made = subprocess.run([sys.executable, "-m", "hf_gpu_train", "config", "--machine", "cpu-only", "--num-processes", "2",
                           "--strategy", "fsdp", "--main-process-port", str(free_port()), "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    return out.with_suffix(".yaml")


def history(out: Path, key: str) -> list[float]:
    return [h[key] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if key in h]


def test_two_fsdp_processes_train_what_one_process_trains(tmp_path):
    case = text_case(tmp_path)
    arguments = [*case, *COMMON, f"per_device_train_batch_size={GLOBAL_BATCH // 2}", f"global_batch_size={GLOBAL_BATCH}"]
    reference = tmp_path / "one"
    assert main([*arguments, f"output_dir={reference}"]) == 0
    out, config = tmp_path / "sharded", fsdp_config(tmp_path)
    saving = ["save_strategy=steps", "save_steps=1", "save_total_limit=6", "background_saves=true"]  # as on a GPU
    run = launch(config, SCRIPT, *arguments, *saving, f"output_dir={out}", timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "sharding with FSDP2 over gloo" in run.stderr
    assert_same_series("logged loss", history(out, "loss"), history(reference, "loss"))
    assert_same_series("gradient norm", history(out, "grad_norm"), history(reference, "grad_norm"))
    assert_same_params(load_file(out / "model.safetensors"), load_file(reference / "model.safetensors"))
    shards = sorted(p.name for p in (out / "checkpoint-4").rglob("*.distcp"))
    assert len(shards) >= 4 and {name.split("_")[2] for name in shards} == {"0", "1"}  # model and optimizer, a file per rank

    # another number of processes resumes it (issue 38 item 3: torch.distributed.checkpoint reshards the model's and the
    # optimizer's shards): 2 -> 1 from checkpoint-2 (the second background save, staged into the first's host copy of
    # the shards), then that run's own checkpoint-3 1 -> 2; both end where the uninterrupted run ends
    one = launch(config, "--num_processes", "1", SCRIPT, *arguments, *saving,
                 f"output_dir={as_if_killed_after(out, 'checkpoint-2', tmp_path / 'on-one')}", timeout=600)
    assert one.returncode == 0, one.stderr[-4000:]
    assert f"resuming from {tmp_path / 'on-one' / 'checkpoint-2'}" in one.stdout and "CPU x1" in one.stdout
    assert_same_params(load_file(tmp_path / "on-one" / "model.safetensors"), load_file(reference / "model.safetensors"))
    two = launch(config, SCRIPT, *arguments, *saving,
                 f"output_dir={as_if_killed_after(tmp_path / 'on-one', 'checkpoint-3', tmp_path / 'on-two')}", timeout=600)
    assert two.returncode == 0, two.stderr[-4000:]
    assert f"resuming from {tmp_path / 'on-two' / 'checkpoint-3'}" in two.stdout and "CPU x2" in two.stdout
    assert_same_params(load_file(tmp_path / "on-two" / "model.safetensors"), load_file(reference / "model.safetensors"))


def test_loading_the_weights_on_rank_0_only_trains_the_same_model(tmp_path):
    """fsdp_cpu_ram_efficient_loading: the process group exists before the model loads, rank 0 alone reads the weights
    (the others wait on the meta device) and FSDP broadcasts them: still what one process trains."""
    case = text_case(tmp_path)
    arguments = [*case, *COMMON, f"per_device_train_batch_size={GLOBAL_BATCH // 2}", f"global_batch_size={GLOBAL_BATCH}"]
    reference = tmp_path / "one"
    assert main([*arguments, f"output_dir={reference}"]) == 0
    config = fsdp_config(tmp_path)
    text = config.read_text()
    assert "fsdp_cpu_ram_efficient_loading: false" in text
    config.write_text(text.replace("fsdp_cpu_ram_efficient_loading: false", "fsdp_cpu_ram_efficient_loading: true"))
    out = tmp_path / "sharded"
    run = launch(config, SCRIPT, *arguments, f"output_dir={out}", timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert_same_series("logged loss", history(out, "loss"), history(reference, "loss"))
    assert_same_params(load_file(out / "model.safetensors"), load_file(reference / "model.safetensors"))


def test_a_batchnorm_model_under_fsdp_trains_and_evaluates_what_ddp_does(tmp_path, batchnorm_ddp):
    """Issue 41: the same losses, gradient norms, weights and running statistics (rank 0's) as DDP, and the same
    evaluation (each rank evaluates rank 0's running statistics, under either strategy)."""
    case, ddp = batchnorm_ddp
    out = tmp_path / "fsdp-batchnorm"
    run = launch(fsdp_config(tmp_path), SCRIPT, *case, f"output_dir={out}", timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "BatchNorm running statistics: rank 0's on every rank after every optimizer step" in run.stdout
    assert_same_series("logged loss", history(out, "loss"), history(ddp, "loss"))
    assert_same_series("gradient norm", history(out, "grad_norm"), history(ddp, "grad_norm"))
    assert_same_params(load_file(out / "model.safetensors"), load_file(ddp / "model.safetensors"))
    assert_same_evaluation(out, ddp)
