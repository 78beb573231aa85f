"""Out of memory on one rank of 2 under DeepSpeed ZeRO-2 (issue 31): in-place recovery stepped aside before training
with the reason (DeepSpeed's engine owns accumulation and the step), and the OOM ends the launch at once with that
reason and the fix (exit 2), not a hang and not a bare traceback. The fix it names (a smaller micro-batch, the same
effective batch) resumes from the last complete checkpoint and ends with the weights one process trains."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hf_gpu_train.faults.checkpoint_marker import complete_checkpoints
from hf_gpu_train.finetune.run import main
from tests.launching import launch
from tests.scaling.equivalence import assert_same_params
from tests.scaling.finetune_cases import COMMON, GLOBAL_BATCH, text_case
from tests.scaling.test_deepspeed_equivalence import QUIET, SCRIPT, deepspeed_config

pytestmark = pytest.mark.slow
PROBE = Path(__file__).with_name("deepspeed_oom_probe.py")


def test_an_oom_on_one_rank_under_zero2_ends_both_with_the_fix_and_the_fix_resumes_exactly(tmp_path):
    case = text_case(tmp_path)
    common = [*case, *COMMON, *QUIET, f"global_batch_size={GLOBAL_BATCH}"]
    one = tmp_path / "one"
    assert main([*common, f"per_device_train_batch_size={GLOBAL_BATCH}", f"output_dir={one}"]) == 0
    config = deepspeed_config(tmp_path, "deepspeed-zero2")
    out = tmp_path / "zero2"
    saving = ["save_strategy=steps", "save_steps=2", f"output_dir={out}"]
    start = time.monotonic()
    failed = launch(config, PROBE, *common, *saving, "per_device_train_batch_size=4", env={"OOM_AT_STEP": "3"}, timeout=600)
    seconds = time.monotonic() - start
    assert failed.returncode == 2, failed.stderr[-3000:]
    said = failed.stderr
    assert said.count("WARNING hf_gpu_train.oom: OOM recovery is off for Trainer: DeepSpeed's engine owns gradient accumulation") == 2
    assert "finetune: error: out of memory on rank 1 after optimizer step 2 (per_device_train_batch_size=4" in said
    assert "In a training step: lower per_device_train_batch_size and raise gradient_accumulation_steps" in said
    assert "hf-gpu-train launch: the training processes stopped on the usage error above (exit 2)" in said
    assert seconds < 240  # ended, not waiting out gloo's 30-minute collective timeout
    assert [c.name for c in complete_checkpoints(out)] == ["checkpoint-2"]
    fixed = launch(config, SCRIPT, *common, *saving, "per_device_train_batch_size=2", timeout=600)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-2'}" in fixed.stdout and "batch 2 x 4 x 2 = 16" in fixed.stdout
    assert_same_params(load_file(out / "model.safetensors"), load_file(one / "model.safetensors"))
