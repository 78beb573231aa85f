"""Preemption on 2 gloo processes through ``hf-gpu-train launch`` and scripts/finetune.py, where it is on by default
(issue 30, item 1): a signal that reaches one rank only, or the launcher only, stops every rank at the same step
boundary with a complete checkpoint; the launch ends with 75, not the launcher's own code; the same command resumes
to the weights one uninterrupted process trains."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from hf_gpu_train.faults.checkpoint_marker import complete_checkpoints
from hf_gpu_train.launch.rank_report import PREEMPTED_EXIT_CODE
from tests.finetune.test_resume import COMMON, GLOBAL_BATCH, QUIET, SCRIPT, case, uninterrupted  # noqa: F401 (fixtures)
from tests.launching import cpu_config, launch
from tests.scaling.equivalence import assert_same_params

pytestmark = pytest.mark.slow
PROBE = Path(__file__).with_name("signal_probe.py")


def command(text_case: list[str], out: Path) -> list[str]:
    # 4 rows a process, 16 a step: 2 micro-batches a step, so the signal comes in the middle of one
    return [*text_case, *COMMON, *QUIET, f"output_dir={out}", "per_device_train_batch_size=4", f"global_batch_size={GLOBAL_BATCH}"]


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step_and_the_same_command_resumes_exactly(
        tmp_path, case, uninterrupted):  # noqa: F811
    out = tmp_path / "out"
    config = cpu_config(tmp_path)
    stopped = launch(config, PROBE, *command(case, out),
                     env={"SIGNALS": "TERM:self:accumulation:3", "SIGNAL_RANK": "1"})
    assert stopped.returncode == PREEMPTED_EXIT_CODE, stopped.stderr[-3000:]
    assert "hf_gpu_train: preemption: SIGTERM received" in stopped.stderr
    assert "stopped for a stop signal (rank 0 after step 3, rank 1 after step 3)" in stopped.stderr, stopped.stderr[-3000:]
    assert [c.name for c in complete_checkpoints(out)] == ["checkpoint-3"] and not (out / "model.safetensors").exists()
    again = launch(config, SCRIPT, *command(case, out))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-3'}" in again.stdout
    assert_same_params(load_file(out / "model.safetensors"), load_file(uninterrupted / "model.safetensors"))


def test_a_signal_to_the_launcher_only_is_forwarded_to_every_rank(tmp_path, case):  # noqa: F811
    out = tmp_path / "out"
    stopped = launch(cpu_config(tmp_path), PROBE, *command(case, out),
                     env={"SIGNALS": "USR1:launcher:accumulation:2", "SIGNAL_RANK": "0"})
    assert stopped.returncode == PREEMPTED_EXIT_CODE, stopped.stderr[-3000:]
    assert "hf-gpu-train launch: SIGUSR1 forwarded to the training processes" in stopped.stderr
    assert "stopped for a stop signal (rank 0 after step 2, rank 1 after step 2)" in stopped.stderr, stopped.stderr[-3000:]
    assert [c.name for c in complete_checkpoints(out)] == ["checkpoint-2"]
