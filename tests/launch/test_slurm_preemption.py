"""Issue 30: preemption on a real SLURM cluster (tests/slurm_cluster.py; skipped with the reason where slurm-wlm and
munge are not installed or not as root). The generated 2-node sbatch, 2 gradient-accumulation micro-batches a step
on each node, 6 steps and no checkpoint of its own, is stopped twice, each time in the middle of a step:

1. at step 3, USR1 to the batch shell alone (``scancel --batch``: what ``#SBATCH --signal=B:USR1@N`` sends N seconds
   before the time limit), which passes it to the tasks through srun;
2. at step 5 of the requeued job, SIGTERM to every process of the job's steps (``scancel --signal=TERM``: what
   SLURM's preemption sends at the start of its GraceTime).

Each time every rank saves that step and exits 75 and the script requeues the job; the job resumes from checkpoint-3,
then from checkpoint-5, and ends with the weights one uninterrupted process trains. (A TERM to srun itself, at a
time limit or from ``scancel --full``, makes srun SIGKILL every task: benchmarks/preemption.py shows that case.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.launch.test_slurm_cluster import JOB_TIMEOUT_S, QUIET, case, one_process, recipe, submit_environment, two_node_sbatch  # noqa: F401
from tests.scaling.equivalence import assert_same_params
from tests.scaling.finetune_cases import COMMON, GLOBAL_BATCH

pytestmark = pytest.mark.slow
PROBE = Path(__file__).resolve().parents[1] / "faults" / "signal_probe.py"


def test_a_stopped_job_checkpoints_requeues_itself_and_ends_with_the_uninterrupted_weights(
        slurm_cluster, tmp_path, case, one_process):  # noqa: F811
    out = tmp_path / "out"
    batch = recipe(tmp_path, [*case, *COMMON, *QUIET, "per_device_train_batch_size=4", f"global_batch_size={GLOBAL_BATCH}",
                              f"output_dir={out}"])
    env, options = submit_environment(slurm_cluster, SIGNALS="USR1:batch:accumulation:3+TERM:steps:accumulation:5",
                                      SIGNAL_RANK="0")
    job = slurm_cluster.sbatch(two_node_sbatch(tmp_path, f"{PROBE} --config {batch}"), cwd=tmp_path, env=env, options=options)
    state, code = slurm_cluster.wait(job, 3 * JOB_TIMEOUT_S)
    info, output = slurm_cluster.job_info(job), slurm_cluster.output(job, tail=300_000)
    assert (state, code) == ("COMPLETED", 0), f"{state} {code}\n{output[-6000:]}"
    assert info["Restarts"] == "2", f"{info}\n{output[-6000:]}"
    assert "hf-gpu-train: SIGUSR1 at " in output, output[-6000:]  # the batch shell passed the warning on
    assert output.count("hf-gpu-train: stopped with a complete checkpoint: requeueing job") == 2, output[-6000:]
    for restarts, step in ((1, 3), (2, 5)):
        assert f"requeued {restarts} time(s)" in output and f"resuming from {out / f'checkpoint-{step}'}" in output, output[-6000:]
    assert_same_params(load_file(out / "model.safetensors"), load_file(one_process / "model.safetensors"))
