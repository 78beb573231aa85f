"""A second command into the same output_dir never surprises: set-aside checkpoints stay out of the Trainer's
rotation, a different training is refused before anything is written, a finished run is reported and not
trained again, another number of processes with the same effective batch resumes at the right sample, and
the final evaluation runs once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from transformers import TrainerCallback

from hf_gpu_train.faults.checkpoint_marker import complete_checkpoints
from hf_gpu_train.finetune.checkpoints import COMPLETE_MARKER, SET_ASIDE_DIR
from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.run import finetune, main
from hf_gpu_train.finetune.run_record import RECORD
from tests.launching import ROOT, cpu_config, free_port, launch
from tests.scaling.equivalence import assert_same_params
from tests.scaling.finetune_cases import COMMON, GLOBAL_BATCH, text_case

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "finetune.py"
QUIET = ["telemetry=false"]


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> list[str]:
    return text_case(tmp_path_factory.mktemp("resume-case"))


def args(case, out, *extra) -> list[str]:
    return [*case, *COMMON, *QUIET, f"per_device_train_batch_size={GLOBAL_BATCH}", f"output_dir={out}", *extra]


def files(out: Path) -> dict:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}


@pytest.mark.parametrize("limit", [1, 2])
def test_a_set_aside_incomplete_checkpoint_is_never_rotated_away(tmp_path, case, limit):
    out = tmp_path / "out"
    assert main(args(case, out, "save_strategy=steps", "save_steps=2")) == 0  # checkpoints 2, 4, 6
    (out / "checkpoint-6" / COMPLETE_MARKER).unlink()  # as if killed while saving step 6
    record = json.loads((out / RECORD).read_text())
    (out / RECORD).write_text(json.dumps({**record, "finished": False}))
    assert main(args(case, out, "save_strategy=steps", "save_steps=2", f"save_total_limit={limit}")) == 0
    aside = list((out / SET_ASIDE_DIR).iterdir())
    assert [p.name.split(".")[0] for p in aside] == ["checkpoint-6"] and (aside[0] / "model.safetensors").is_file()
    kept = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert len(kept) == limit and kept[-1].name == "checkpoint-6"
    assert all((p / COMPLETE_MARKER).is_file() for p in kept)


def test_resume_named_to_a_half_written_checkpoint_resumes_from_the_newest_complete_one(tmp_path, case, caplog):
    """resume=PATH to a checkpoint killed while saving: set aside, the newest complete checkpoint beside it taken, said in
    one line (it was read for its step before the Trainer could redirect: FileNotFoundError)."""
    out = tmp_path / "out"
    assert main(args(case, out, "save_strategy=steps", "save_steps=2", "max_steps=4")) == 0  # checkpoints 2, 4
    (out / "checkpoint-4" / COMPLETE_MARKER).unlink()  # as if killed while saving step 4
    (out / "checkpoint-4" / "trainer_state.json").unlink()
    record = json.loads((out / RECORD).read_text())
    (out / RECORD).write_text(json.dumps({**record, "finished": False}))
    with caplog.at_level("WARNING"):
        assert main(args(case, out, "save_strategy=steps", "save_steps=2", "max_steps=4",
                         f"resume={out / 'checkpoint-4'}")) == 0
    said = [r.getMessage() for r in caplog.records if "half-written" in r.getMessage()]
    assert len(said) == 1 and "checkpoint-2" in said[0]
    assert [p.name.split(".")[0] for p in (out / SET_ASIDE_DIR).iterdir()] == ["checkpoint-4"]
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4  # trained again


def test_a_different_training_is_refused_and_nothing_is_overwritten(tmp_path, case, capsys):
    out = tmp_path / "out"
    assert main(args(case, out)) == 0
    before = {name: (out / name).read_bytes() for name in ("finetune_config.yaml", RECORD, "model.safetensors")}
    assert main(args(case, out, "learning_rate=2e-3")) == 2
    err = capsys.readouterr().err
    assert "learning_rate: 0.001 -> 0.002" in err and "output_dir=NEW_DIR" in err and "resume=PATH/checkpoint-N" in err
    assert "Traceback" not in err
    assert {name: (out / name).read_bytes() for name in before} == before


def test_rerunning_a_finished_run_reports_it_and_trains_nothing(tmp_path, case, capsys):
    out = tmp_path / "out"
    assert main(args(case, out)) == 0
    results = json.loads((out / "eval_results.json").read_text())
    before = files(out)
    capsys.readouterr()
    assert main(args(case, out, "logging_steps=3")) == 0  # how it is logged does not change what it trains
    said = capsys.readouterr().out
    assert "already holds this run, finished" in said and f"{results['eval_accuracy']}" in said
    assert files(out) == before  # not a file touched


def test_the_final_evaluation_runs_once(tmp_path, case):
    out = tmp_path / "out"
    assert main(args(case, out, "eval_strategy=epoch")) == 0
    evaluations = [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "eval_loss" in h]
    assert [h["step"] > 0 for h in evaluations] == [False, True, True, True]  # before training, then one per epoch, none after
    assert json.loads((out / "baseline_results.json").read_text())["eval_loss"] == evaluations[0]["eval_loss"]
    assert json.loads((out / "eval_results.json").read_text())["eval_loss"] == evaluations[-1]["eval_loss"]


class StopAfterSaving(TrainerCallback):
    """Stands for a crash right after the checkpoint of ``step`` was completed."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt("stopped after saving")


@pytest.fixture(scope="module")
def uninterrupted(case, tmp_path_factory) -> Path:
    """One process, the whole run: the weights every interrupted and resumed run must end with."""
    whole = tmp_path_factory.mktemp("uninterrupted") / "whole"
    assert main(args(case, whole)) == 0
    return whole


def test_another_number_of_processes_with_the_same_effective_batch_resumes_at_the_same_sample(tmp_path, case, uninterrupted,
                                                                                              capsys):
    whole = uninterrupted
    out = tmp_path / "out"
    saving = ["save_strategy=steps", "save_steps=2"]
    with pytest.raises(KeyboardInterrupt):
        finetune(load_config(None, args(case, out, *saving)), extra_callbacks=[StopAfterSaving(4)])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    capsys.readouterr()
    base = [*case, *COMMON, *QUIET, f"output_dir={out}", *saving]
    # twice the effective batch (what 2 processes of 16 would make; one process of 32 here, no launch needed)
    assert main([*base, f"per_device_train_batch_size={2 * GLOBAL_BATCH}"]) == 2
    refused = capsys.readouterr().err
    assert "Traceback" not in refused and "effective_batch: 16 -> 32" in refused and f"global_batch_size={GLOBAL_BATCH}" in refused
    config = cpu_config(tmp_path)
    resumed = launch(config, SCRIPT, *base, f"per_device_train_batch_size={GLOBAL_BATCH // 2}", f"global_batch_size={GLOBAL_BATCH}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "CPU x2" in resumed.stdout
    assert_same_params(load_file(out / "model.safetensors"), load_file(whole / "model.safetensors"))


def test_the_same_command_on_another_number_of_processes_keeps_the_global_batch_both_ways(tmp_path, case, uninterrupted,
                                                                                            capsys):
    """Issue 38, item 3: a run's checkpoints written by N processes, the same command (no global_batch_size) on M != N
    continues the same run: its global batch kept, accumulation adjusted and said, the same rows from the same position.
    1 -> 2: one process of 16 stopped after checkpoint-4, resumed on 2 (per-device 16 would make 32: 8 x 1 x 2). 2 -> 1:
    two processes of 8 killed after checkpoint-4, resumed on 1 (8 x 2 x 1). Both end with the uninterrupted weights."""
    saving = ["save_strategy=steps", "save_steps=2", "background_saves=true"]  # the default on a GPU
    config = cpu_config(tmp_path)
    # 1 -> 2
    up = tmp_path / "up"
    with pytest.raises(KeyboardInterrupt):
        finetune(load_config(None, args(case, up, *saving)), extra_callbacks=[StopAfterSaving(4)])
    resumed = launch(config, SCRIPT, *args(case, up, *saving))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("resuming a run of 1 process(es) on 2: its global batch of 16 kept (per-device batch 8 x accumulation 1 x 2 "
            "process(es))") in resumed.stdout, resumed.stdout[-3000:]
    assert f"resuming from {up / 'checkpoint-4'}" in resumed.stdout
    assert_same_params(load_file(up / "model.safetensors"), load_file(uninterrupted / "model.safetensors"))
    # 2 -> 1
    down = tmp_path / "down"
    command = [*case, *COMMON, *QUIET, f"output_dir={down}", *saving, f"per_device_train_batch_size={GLOBAL_BATCH // 2}"]
    killed = launch(config, Path(__file__).with_name("kill_probe.py"), *command, env={"KILL_RANK": "1", "KILL_AT_STEP": "5"})
    assert killed.returncode != 0 and [c.name for c in complete_checkpoints(down)][0] == "checkpoint-4", killed.stderr[-3000:]
    capsys.readouterr()
    assert main(command) == 0
    out = capsys.readouterr().out
    assert ("resuming a run of 2 process(es) on 1: its global batch of 16 kept (per-device batch 8 x accumulation 2 x 1 "
            "process(es))") in out and f"resuming from {down / 'checkpoint-4'}" in out
    assert_same_params(load_file(down / "model.safetensors"), load_file(uninterrupted / "model.safetensors"))


def test_a_rank_killed_mid_run_then_the_same_command_again_ends_with_the_uninterrupted_weights(tmp_path, case, uninterrupted):
    """Issue 18, item 1: 2 gloo processes, rank 1 SIGKILLed after the checkpoint at step 4; the launch ends naming it,
    and the same command again resumes from that checkpoint and ends where one uninterrupted process ends."""
    out = tmp_path / "out"
    command = [*case, *COMMON, *QUIET, f"output_dir={out}", "save_strategy=steps", "save_steps=2",
               f"per_device_train_batch_size={GLOBAL_BATCH // 2}", f"global_batch_size={GLOBAL_BATCH}"]
    config = cpu_config(tmp_path)
    killed = launch(config, Path(__file__).with_name("kill_probe.py"), *command, env={"KILL_RANK": "1", "KILL_AT_STEP": "5"})
    assert killed.returncode != 0 and not (out / "model.safetensors").exists(), killed.stderr[-3000:]
    assert "hf-gpu-train launch: rank 1 died (SIGKILL, exit -9)" in killed.stderr, killed.stderr[-3000:]
    # restarted once by the launcher (issue 38, item 4), killed again at the same step: not restarted a second time
    assert "rank 1 died of SIGKILL after step 5: restarting (1 of 3, --max-restarts)" in killed.stderr, killed.stderr[-3000:]
    assert ("the same failure as the start before (rank 1 died of SIGKILL after step 5): not restarting again"
            in killed.stderr), killed.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    baseline = json.loads((out / "baseline_results.json").read_text())  # evaluated when it first started
    again = launch(config, SCRIPT, *command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-4'}" in again.stdout and "CPU x2" in again.stdout
    # the resumed run does not evaluate first again, and its last line compares with what the first start measured
    assert f"before training (the model as loaded): accuracy {baseline['eval_accuracy']:.4g}" in again.stdout.strip().splitlines()[-1]
    assert "hf_gpu_train: preflight: 2 processes joined, all-reduce and broadcast work" in again.stdout
    assert "collective timeout 1800 s" in again.stdout  # the Trainer's ddp_timeout, not the preflight's short one
    assert_same_params(load_file(out / "model.safetensors"), load_file(uninterrupted / "model.safetensors"))


def test_a_rank_killed_once_is_restarted_by_the_launcher_and_ends_with_the_uninterrupted_weights(tmp_path, case,
                                                                                                   uninterrupted):
    """Issue 38, item 4: rank 1 SIGKILLed after step 5 (checkpoint-4 complete), once; hf-gpu-train launch starts the
    same command again by itself, it resumes from checkpoint-4 and ends where one uninterrupted process ends."""
    out = tmp_path / "out"
    command = [*case, *COMMON, *QUIET, f"output_dir={out}", "save_strategy=steps", "save_steps=2",
               f"per_device_train_batch_size={GLOBAL_BATCH // 2}", "background_saves=true"]  # on a GPU by default
    restarted = launch(cpu_config(tmp_path), Path(__file__).with_name("kill_probe.py"), *command,
                       env={"KILL_RANK": "1", "KILL_AT_STEP": "5", "KILL_ONCE": str(tmp_path / "killed")})
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "rank 1 died of SIGKILL after step 5: restarting (1 of 3, --max-restarts)" in restarted.stderr
    assert f"resuming from {out / 'checkpoint-4'}" in restarted.stdout
    assert_same_params(load_file(out / "model.safetensors"), load_file(uninterrupted / "model.safetensors"))


def test_a_node_lost_the_elastic_launch_goes_on_with_the_other_and_ends_with_the_uninterrupted_weights(
        tmp_path, case, uninterrupted):
    """Issue 38, item 4, ``--nnodes MIN:MAX``: two nodes of one process each (two ``hf-gpu-train launch --nnodes 1:2``
    on this machine, meeting at node 0's c10d rendezvous); after step 5 (checkpoint-4 complete) node 1 is lost: its
    launcher, torchrun and training process SIGKILLed at once. Node 0's launcher starts again, the rendezvous goes on
    with the one node left, and the run resumes from checkpoint-4 on one process, its global batch of 16 kept
    (accumulation 2), ending with the weights of the uninterrupted run."""
    out = tmp_path / "out"
    command = [*case, *COMMON, *QUIET, f"output_dir={out}", "save_strategy=steps", "save_steps=2",
               f"per_device_train_batch_size={GLOBAL_BATCH // 2}", "background_saves=true"]
    port = str(free_port())
    nodes = []
    for node, kill in ((0, {"KILL_RANK": "-1", "KILL_AT_STEP": "-1"}),
                       (1, {"KILL_RANK": "any", "KILL_AT_STEP": "5", "KILL_WHOLE_NODE": "1"})):
        env = {**os.environ, "PYTHONPATH": str(ROOT), **kill}
        config = cpu_config(tmp_path, 1, f"job-rank{node}", "--num-machines", "2", "--machine-rank", str(node),
                            "--main-process-ip", "127.0.0.1")  # each node its own file, as docs/multi-node.md writes them
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "hf_gpu_train", "launch", "--nnodes", "1:2",
             "--main_process_port", port, "--rdzv_conf", "last_call_timeout=2", "--config-file", str(config),
             str(Path(__file__).with_name("kill_probe.py")), *command],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    (out0, err0), (_, err1) = (p.communicate(timeout=600) for p in nodes)
    assert nodes[1].returncode == -9, err1[-3000:]  # lost with its processes: nothing of node 1 said or restarted
    assert nodes[0].returncode == 0, err0[-4000:]
    assert "restarting (1 of 3, --max-restarts)" in err0, out0[-6000:] + err0[-6000:]
    assert f"elastic launch: torchrun meets the other nodes at 127.0.0.1:{port} (node 0 hosts the rendezvous)" in err0
    assert ("resuming a run of 2 process(es) on 1: its global batch of 16 kept (per-device batch 8 x accumulation 2 x 1 "
            "process(es))") in out0, out0[-3000:]
    assert f"resuming from {out / 'checkpoint-4'}" in out0
    assert_same_params(load_file(out / "model.safetensors"), load_file(uninterrupted / "model.safetensors"))


def test_scripts_finetune_into_a_closed_pipe_ends_quietly(tmp_path, case):
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    assert main(args(case, out)) == 0  # a finished run: the rerun only prints its results
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, str(SCRIPT), *args(case, out)], stdout=write_end, stderr=subprocess.PIPE, text=True,
                                timeout=300)
    finally:
        os.close(write_end)
    assert result.returncode == 141 and "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr


def test_a_start_that_failed_before_training_does_not_block_the_corrected_command(tmp_path, case, capsys):
    out = tmp_path / "out"
    assert main(args(case, out, "extra={max_grad_nrom: 1.0}")) == 2  # a typo: named, before anything is written
    err = capsys.readouterr().err
    assert "'max_grad_nrom' is not a TrainingArguments argument; did you mean 'max_grad_norm'?" in err and "Traceback" not in err
    assert not out.exists()
    # an earlier start that stopped before any checkpoint (here: a record and config, as an OOM at step 1 leaves)
    assert main(args(case, out, "max_steps=1")) == 0
    record = json.loads((out / RECORD).read_text())
    (out / RECORD).write_text(json.dumps({**record, "finished": False}))
    (out / "eval_results.json").unlink()
    assert main(args(case, out, "max_length=24")) == 0  # the remedy the OOM error names: not refused
    assert json.loads((out / RECORD).read_text())["training"]["max_length"] == 24
    assert list(out.glob("finetune_config.*.yaml")) and list(out.glob(f"{RECORD}.*.bak"))  # the earlier ones kept


def test_output_dir_that_is_a_file_exits_2(tmp_path, case, capsys):
    path = tmp_path / "a_file"
    path.write_text("mine")
    assert main(args(case, path)) == 2
    assert "is a file" in capsys.readouterr().err and path.read_text() == "mine"


def test_a_finished_run_asked_for_another_evaluation_is_evaluated_again_not_trained(tmp_path, case, capsys):
    out = tmp_path / "out"
    assert main(args(case, out, "save_strategy=epoch", "max_eval_samples=8")) == 0
    steps = json.loads((out / "run_summary.json").read_text())["global_step"]
    first = (out / "eval_results.json").stat().st_mtime_ns
    capsys.readouterr()
    assert main(args(case, out, "save_strategy=epoch", "max_eval_samples=4")) == 0
    said = capsys.readouterr().out
    assert "already holds this run" not in said and "resuming from" in said
    assert json.loads((out / "run_summary.json").read_text())["global_step"] == steps  # nothing trained
    assert (out / "eval_results.json").stat().st_mtime_ns != first
