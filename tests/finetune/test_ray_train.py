"""The fine-tune on Ray Train (issue 30, part 3): a real local Ray cluster (2 CPUs), 2 Ray Train workers of 8 samples
each train what one process of 16 trains (the same losses, gradient norms and weights), with telemetry on and through
an OOM on one worker recovered in place; a worker killed after a checkpoint restarted by Ray and resumed from that checkpoint,
and a hang ended by the watchdog through the c10d store of the group Ray made. Checkpoints reach Ray complete. The
comparison of Ray's newest checkpoint with output_dir's (after a restart) is checked on files, without Ray.
Tolerances: tests/scaling/equivalence.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hf_gpu_train.faults.checkpoint_marker import COMPLETE_MARKER, SAVING, last_complete_checkpoint
from hf_gpu_train.finetune import ray_train
from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.run import main as one_process_main
from tests.finetune.ray_probes import HangAt, InjectOOM, KillOnce, StepLog
from tests.ray_cluster import local_ray, needs_ray
from tests.scaling.equivalence import assert_same_params, assert_same_series
from tests.scaling.finetune_cases import COMMON, GLOBAL_BATCH, text_case

HALF = GLOBAL_BATCH // 2
TWO_WORKERS = ["--num-workers", "2"]


@pytest.fixture(scope="module")
def cluster():
    with local_ray(num_cpus=2) as address:
        yield address


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> list[str]:
    return text_case(tmp_path_factory.mktemp("ray-case"))


@pytest.fixture(scope="module")
def one_process(case, tmp_path_factory) -> Path:
    """One process of 16, the whole run: what every Ray run must end with."""
    out = tmp_path_factory.mktemp("one-process") / "out"
    assert one_process_main([*case, *COMMON, "telemetry=false", f"per_device_train_batch_size={GLOBAL_BATCH}",
                             f"output_dir={out}"]) == 0
    return out


def two_workers(case, out: Path, *extra) -> list[str]:
    return [*TWO_WORKERS, *case, *COMMON, f"per_device_train_batch_size={HALF}", f"global_batch_size={GLOBAL_BATCH}",
            f"output_dir={out}", *extra]


def history(out: Path, key: str) -> list[float]:
    return [h[key] for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if key in h]


def assert_same_run(out: Path, reference: Path) -> None:
    assert json.loads((out / "run_summary.json").read_text())["global_step"] == 6
    assert_same_series("logged loss", history(out, "loss"), history(reference, "loss"))
    assert_same_series("gradient norm", history(out, "grad_norm"), history(reference, "grad_norm"))
    assert_same_params(load_file(out / "model.safetensors"), load_file(reference / "model.safetensors"))


@pytest.mark.slow
@needs_ray
def test_two_ray_workers_train_what_one_process_trains_through_an_oom_and_ray_holds_complete_checkpoints(
        cluster, case, one_process, tmp_path, capsys):
    out = tmp_path / "out"
    # rank 1's backward at step 2 runs out of memory (a batch of 8 > 4): every rank splits that step into micro-batches
    oom = InjectOOM(rank=1, max_batch=4, start_after=2)
    assert ray_train.main(two_workers(case, out, "save_strategy=steps", "save_steps=2"), callbacks=[oom]) == 0
    assert (out / "oom-raised-rank1.txt").read_text() == "1"
    assert_same_run(out, one_process)
    # telemetry ran on the workers: its windows in the Trainer's log and its own file
    assert history(out, "loop/tokens_per_s") and (out / "telemetry.jsonl").is_file()
    # every checkpoint reached Ray whole: marked complete, no note of a save in progress (save_total_limit 2 kept)
    held = sorted((out / "ray" / "finetune").glob("checkpoint_*/checkpoint"))
    assert len(held) == 2
    for folder in held:
        assert (folder / COMPLETE_MARKER).is_file() and not (folder / SAVING).exists()
    assert [json.loads((f / "trainer_state.json").read_text())["global_step"] for f in held] == [4, 6]
    assert "hf_gpu_train: ray: 2 worker(s) finished; Ray's newest checkpoint:" in capsys.readouterr().out


@pytest.mark.slow
@needs_ray
def test_a_worker_killed_after_a_checkpoint_is_restarted_by_ray_and_resumes_from_it(cluster, case, one_process, tmp_path):
    out = tmp_path / "out"
    steps = tmp_path / "steps.txt"
    argv = [*two_workers(case, out, "telemetry=false", "save_strategy=steps", "save_steps=2"), "--max-failures", "1"]
    assert ray_train.main(argv, callbacks=[KillOnce(rank=1, step=5, marker=str(tmp_path / "killed")), StepLog(str(steps))]) == 0
    attempts: dict[str, list[int]] = {}
    for pid, step in (line.split() for line in steps.read_text().splitlines()):
        attempts.setdefault(pid, []).append(int(step))
    # the first group trained to step 5 (rank 1 killed at its end), the restarted one from the checkpoint of step 4
    assert list(attempts.values()) == [[1, 2, 3, 4, 5], [5, 6]]
    assert_same_run(out, one_process)


@pytest.mark.slow
@needs_ray
def test_a_hang_on_one_worker_ends_the_run_with_every_ranks_stacks(cluster, case, tmp_path, capsys):
    """The watchdog's word between the ranks goes through the c10d store of the group Ray made: rank 0, waiting in a
    collective, learns of the hang, both ranks' stacks are written, the summary names rank 1, and the run ends (exit 3)
    instead of waiting out the collective timeout."""
    out = tmp_path / "out"
    assert ray_train.main(two_workers(case, out, "telemetry=false", "watchdog=15"), callbacks=[HangAt(rank=1, step=2)]) == 3
    (folder,) = out.glob("hang-*")
    assert (folder / "rank-0.txt").is_file() and (folder / "rank-1.txt").is_file()
    summary = (folder / "summary.txt").read_text()
    assert "rank 1: step 1 finished" in summary and "<- not where the others are" in summary.split("rank 1:")[1]
    assert "the watchdog ended the run: hang: no progress for" in capsys.readouterr().err


@pytest.mark.slow
@needs_ray
def test_a_usage_error_a_worker_meets_is_one_line_and_exit_2(cluster, case, tmp_path, capsys):
    out = tmp_path / "out"
    assert ray_train.main(two_workers(case, out, f"train_file={tmp_path / 'missing.csv'}")) == 2
    # the driver's line (Ray's own log of the worker's failure, forwarded to this process, has its traceback)
    assert f"ray_train: error: train_file='{tmp_path / 'missing.csv'}' does not exist\n" in capsys.readouterr().err


def test_a_bad_key_is_refused_on_the_driver_before_ray_starts(capsys):
    assert ray_train.main([*TWO_WORKERS, "learning_rte=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "learning_rte" in err and "learning_rate" in err and "Traceback" not in err


# ---- Ray's newest checkpoint against output_dir's, on files (agree_on_resume)


def checkpoint(folder: Path, step: int, complete: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "model.safetensors").write_text("weights")
    if complete:
        (folder / COMPLETE_MARKER).write_text("{}")
    return folder


def test_the_same_newest_checkpoint_in_ray_and_output_dir_is_said(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path / 'out'}"])
    checkpoint(tmp_path / "out" / "checkpoint-4", 4)
    resumed, line = ray_train.agree_on_resume(cfg, checkpoint(tmp_path / "ray" / "checkpoint", 4), copies=True)
    assert resumed == 4 and "the same, step 4" in line


def test_a_newer_checkpoint_in_output_dir_than_ray_heard_of_is_taken(tmp_path):
    """A worker killed right after a save: the checkpoint is complete in output_dir, Ray's controller never took the
    report (seen here on a real restart: Ray's newest was step 2, output_dir's step 4)."""
    cfg = load_config(None, [f"output_dir={tmp_path / 'out'}"])
    checkpoint(tmp_path / "out" / "checkpoint-4", 4)
    resumed, line = ray_train.agree_on_resume(cfg, checkpoint(tmp_path / "ray" / "checkpoint", 2), copies=True)
    assert resumed == 4 and "newer than Ray's newest checkpoint (step 2)" in line
    assert not (tmp_path / "out" / "checkpoint-2").exists()


def test_a_ray_checkpoint_output_dir_lacks_is_copied_there_for_the_resume(tmp_path):
    """A worker on a node that cannot see the disk the checkpoint was written to: Ray's copy comes back into
    output_dir, without a note of a save in progress, and resume=auto takes it."""
    cfg = load_config(None, [f"output_dir={tmp_path / 'out'}"])
    checkpoint(tmp_path / "out" / "checkpoint-2", 2)
    held = checkpoint(tmp_path / "ray" / "checkpoint", 4)
    (held / SAVING).write_text("{}")  # a rank's copy taken before the main process removed it
    resumed, line = ray_train.agree_on_resume(cfg, held, copies=True)
    assert resumed == 4 and "copied to" in line
    assert last_complete_checkpoint(cfg.output_dir) == tmp_path / "out" / "checkpoint-4"
    assert not (tmp_path / "out" / "checkpoint-4" / SAVING).exists()


def test_a_ray_checkpoint_without_a_completion_marker_is_not_taken(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path / 'out'}"])
    resumed, line = ray_train.agree_on_resume(cfg, checkpoint(tmp_path / "ray" / "checkpoint", 4, complete=False), copies=True)
    assert resumed is None and "no completion marker: not taken" in line
    assert not (tmp_path / "out" / "checkpoint-4").exists()


def test_resume_named_or_never_leaves_ray_checkpoint_alone(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path / 'out'}", "resume=never"])
    resumed, line = ray_train.agree_on_resume(cfg, checkpoint(tmp_path / "ray" / "checkpoint", 4), copies=True)
    assert resumed is None and "resume=never decides" in line and not (tmp_path / "out").exists()
