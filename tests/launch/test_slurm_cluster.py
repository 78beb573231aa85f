"""Issue 30: the sbatch that ``hf-gpu-train config --num-machines 2`` writes, submitted to a real SLURM cluster of two
nodes on this machine (tests/slurm_cluster.py; skipped, with the reason, where slurm-wlm and munge are not installed or
not as root). Two nodes of one gloo process each, a batch of 8 each, train the weights one process trains with a
batch of 16 (the equality of tests/scaling/test_finetune_equivalence.py, through SLURM instead of a local launch); and
when node n2's worker is SIGKILLed mid-run, the job ends within a minute and its output names that node and rank."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from hf_gpu_train.finetune.run import main
from tests.launching import ROOT, free_port, hf_gpu_train, teardown_race_only
from tests.scaling.equivalence import assert_same_params, assert_same_series, assert_trained
from tests.scaling.finetune_cases import COMMON, EPOCHS, GLOBAL_BATCH, text_case

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "scripts" / "finetune.py"
KILL_PROBE = Path(__file__).with_name("node_kill_probe.py")
BIN = Path(sys.executable).parent  # this environment's hf-gpu-train and accelerate; root's login shell has none on PATH
QUIET = ["telemetry=false", "evaluate_before=false"]
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> list[str]:
    return text_case(tmp_path_factory.mktemp("slurm-case"))


@pytest.fixture(scope="module")
def one_process(case, tmp_path_factory) -> Path:
    """The uninterrupted run of one process with the whole batch of 16."""
    out = tmp_path_factory.mktemp("slurm-reference") / "out"
    assert main([*case, *COMMON, *QUIET, f"per_device_train_batch_size={GLOBAL_BATCH}", f"output_dir={out}"]) == 0
    return out


def recipe(tmp_path: Path, arguments: list[str]) -> Path:
    """The key=value arguments as a recipe file: each value a string, read as the command line reads it (the sbatch
    passes its own arguments on through ``bash -c "... $*"``, which splits one holding a space)."""
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(dict(a.split("=", 1) for a in arguments)))
    return path


def two_node_sbatch(tmp_path: Path, script: str, *extra: str) -> Path:
    """What ``hf-gpu-train config --machine cpu-only --num-machines 2 --num-processes 1`` writes, on a free port."""
    out = tmp_path / "job"
    made = hf_gpu_train("config", "--machine", "cpu-only", "--num-machines", "2", "--num-processes", "1",
                        "--main-process-ip", "n1", "--main-process-port", str(free_port()), "--output", str(out),
                        "--script", script, *extra)
    assert made.returncode == 0, made.stderr
    return out.with_suffix(".sbatch")


def submit_environment(cluster, **extra: str) -> tuple[dict, tuple[str, ...]]:
    """The environment to submit from (none of this pytest's launch variables) and the --export naming the repository
    and this environment's hf-gpu-train (each node's task) and accelerate."""
    env = {k: v for k, v in cluster.env.items() if not k.startswith(("ACCELERATE_", "FSDP_"))
           and k not in ("OMP_NUM_THREADS", "HF_GPU_TRAIN_PLAN")}
    exported = {"HF_GPU_TRAIN_DIR": str(ROOT), "HF_GPU_TRAIN": str(BIN / "hf-gpu-train"), "ACCELERATE": str(BIN / "accelerate"),
                **extra}
    return env, ("--export=ALL," + ",".join(f"{k}={v}" for k, v in exported.items()),)


def history(out: Path, key: str) -> list[float]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [h[key] for h in state["log_history"] if key in h]


def test_the_generated_two_node_sbatch_trains_the_weights_of_one_process(slurm_cluster, tmp_path, case, one_process):
    out = tmp_path / "out"
    batch = recipe(tmp_path, [*case, *COMMON, *QUIET, f"per_device_train_batch_size={GLOBAL_BATCH // 2}", f"output_dir={out}"])
    env, options = submit_environment(slurm_cluster)
    job = slurm_cluster.sbatch(two_node_sbatch(tmp_path, f"{SCRIPT} --config {batch}"), cwd=tmp_path, env=env, options=options)
    state, code = slurm_cluster.wait(job, JOB_TIMEOUT_S)
    info, output = slurm_cluster.job_info(job), slurm_cluster.output(job)
    summary = out / "run_summary.json"
    assert (state, code) == ("COMPLETED", 0) or teardown_race_only(output, [summary.is_file()]), f"{state} {code}\n{output}"
    assert (info["NumNodes"], info["NodeList"]) == ("2", "n[1-2]"), info
    assert json.loads(summary.read_text())["global_step"] == 2 * EPOCHS, output
    assert "CPU x2" in output, output  # one process group of the two nodes' processes, not two runs
    assert_same_series("logged loss", history(out, "loss"), history(one_process, "loss"))
    assert_same_series("gradient norm", history(out, "grad_norm"), history(one_process, "grad_norm"))
    final = load_file(out / "model.safetensors")
    assert_trained(final, load_file(Path(case[0].split("=", 1)[1]) / "model.safetensors"))
    assert_same_params(final, load_file(one_process / "model.safetensors"))


@pytest.fixture(scope="module")
def killed_job(slurm_cluster, case, tmp_path_factory) -> dict:
    """The generated sbatch running node_kill_probe.py: node n2's training process SIGKILLed at the end of step 2 of 6
    (its global rank is 0 or 1: under c10d rendezvous the nodes are numbered in the order they join)."""
    tmp_path = tmp_path_factory.mktemp("slurm-killed")
    out, stamp = tmp_path / "out", tmp_path / "killed.json"
    batch = recipe(tmp_path, [*case, *COMMON, *QUIET, f"per_device_train_batch_size={GLOBAL_BATCH // 2}", f"output_dir={out}"])
    env, options = submit_environment(slurm_cluster, KILL_NODE="n2", KILL_AT_STEP="2", KILL_STAMP=str(stamp))
    job = slurm_cluster.sbatch(two_node_sbatch(tmp_path, f"{KILL_PROBE} --config {batch}"), cwd=tmp_path, env=env,
                               options=options)
    state, code = slurm_cluster.wait(job, JOB_TIMEOUT_S)
    ended = time.time()
    output = slurm_cluster.output(job, tail=200_000)
    assert stamp.is_file(), f"node n2's process was never killed: {state} {code}\n{output}"
    killed = json.loads(stamp.read_text())
    return {"state": state, "code": code, "seconds_after_kill": ended - killed["time"], "rank": killed["rank"],
            "output": output, "out": out}


def test_a_worker_killed_on_one_node_at_the_same_step_twice_ends_the_job_within_a_minute(killed_job):
    """Started again once in the job (a restart can help: the run resumes), killed at the same step again: not started
    a third time, and the job ends within a minute of that kill."""
    output = killed_job["output"]
    assert "starting again on 2 node(s) of the job (n1,n2)" in output, output[-8000:]
    assert "the same failure as the start before" in output and "requeueing" not in output, output[-8000:]
    assert killed_job["state"] == "FAILED" and killed_job["code"] != 0, f"{killed_job['state']} {killed_job['code']}\n{output}"
    assert killed_job["seconds_after_kill"] < 60, f"the job ended {killed_job['seconds_after_kill']:.0f} s after the kill\n{output}"
    assert not (killed_job["out"] / "model.safetensors").exists()


def test_the_output_names_the_node_and_the_rank_that_died(killed_job):
    """torchelastic's "Root Cause" names the rank and the machine's hostname, one for both test nodes (as for every
    node in a container whose hostname is localhost): the node's own task says which node it is."""
    line = f"hf-gpu-train launch on node n2: rank {killed_job['rank']} died (SIGKILL, exit -9)"
    assert line in killed_job["output"], killed_job["output"][-8000:]


@pytest.mark.parametrize("drained", [False, True], ids=["same-nodes", "node-drained"])
def test_a_rank_killed_once_the_job_trains_again_on_the_nodes_it_has_and_ends_with_the_uninterrupted_weights(
        slurm_cluster, tmp_path, case, one_process, drained):
    """Issue 38, item 4, on SLURM: the generated two-node sbatch; after step 5 (checkpoint-4 complete) n2's training
    process is SIGKILLed, once. The nodes' launchers say a restart can help and the script starts the training again
    in the job's allocation, no requeue: on both nodes; or, with ``--min-machines 1`` and n2 drained first (its
    administrator took it out), on n1 alone, resuming on one process with its global batch of 16 (8 x accumulation 2).
    Either way it resumes from checkpoint-4 and ends with the weights of the uninterrupted run."""
    out = tmp_path / "out"
    batch = recipe(tmp_path, [*case, *COMMON, *QUIET, f"per_device_train_batch_size={GLOBAL_BATCH // 2}", f"output_dir={out}",
                              "save_strategy=steps", "save_steps=2"])
    env, options = submit_environment(slurm_cluster, KILL_NODE="n2", KILL_AT_STEP="5", KILL_STAMP=str(tmp_path / "killed.json"),
                                      KILL_ONCE=str(tmp_path / "killed-once"), DRAIN_NODE="1" if drained else "0")
    sbatch = two_node_sbatch(tmp_path, f"{KILL_PROBE} --config {batch}", *(["--min-machines", "1"] if drained else []))
    try:
        job = slurm_cluster.sbatch(sbatch, cwd=tmp_path, env=env, options=options)
        state, code = slurm_cluster.wait(job, 3 * JOB_TIMEOUT_S)
        info, output = slurm_cluster.job_info(job), slurm_cluster.output(job, tail=200_000)
    finally:
        if drained:
            slurm_cluster._run("scontrol", "update", "NodeName=n2", "State=RESUME", check=False)
    summary = out / "run_summary.json"
    assert (state, code) == ("COMPLETED", 0) or teardown_race_only(output, [summary.is_file()]), f"{state} {code}\n{output[-8000:]}"
    assert (tmp_path / "killed-once").is_file(), f"{info}\n{output[-8000:]}"
    assert info["RestartCnt"] == "0", info  # started again inside the job: no requeue, no wait for an allocation
    again = "starting again on 1 node(s) of the job (n1)" if drained else "starting again on 2 node(s) of the job (n1,n2)"
    assert again in output, output[-8000:]
    assert f"resuming from {out / 'checkpoint-4'}" in output, output[-8000:]
    if drained:
        assert ("resuming a run of 2 process(es) on 1: its global batch of 16 kept (per-device batch 8 x accumulation 2 "
                "x 1 process(es))") in output, output[-8000:]
    assert not (ROOT / f".hf-gpu-train-restarts-{job}").exists()  # the verdicts' folder (in HF_GPU_TRAIN_DIR) gone with the job
    assert_same_params(load_file(out / "model.safetensors"), load_file(one_process / "model.safetensors"))
