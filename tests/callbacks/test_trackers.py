"""Telemetry in the trackers users already run through ``report_to`` (issue 39, item 3): TensorBoard, MLflow with a real
SQLite tracking store, Weights & Biases offline; each read back from its own store (tests/callbacks/tracker_stores.py),
no tracker mocked."""

import json
import logging
import re
import time
from pathlib import Path

import pytest
from transformers import Trainer, TrainerCallback
from transformers.integrations.integration_utils import TensorBoardCallback

from hf_gpu_train.callbacks import attach_telemetry, trackers
from hf_gpu_train.callbacks import telemetry as telemetry_module
from hf_gpu_train.callbacks.trackers import (
    UNKNOWN_VERDICT_CODE,
    VERDICT_CODES,
    active_trackers,
    publish_texts,
    rank_metrics,
    tracker_metrics,
    tracker_texts,
)
from hf_gpu_train.callbacks.verdicts import Verdict
from hf_gpu_train.hardware.fake import FakeNvmlBackend
from tests.callbacks.tiny import TokenDataset, tiny_args, tiny_bert
from tests.callbacks.tracker_stores import tensorboard_events, wandb_run
from tests.launching import cpu_config, launch

mlflow = pytest.importorskip("mlflow")
wandb = pytest.importorskip("wandb")

TRACKERS = ["tensorboard", "mlflow", "wandb"]
VERDICT = Verdict("data-bound", "31% of wall time waiting for the next batch", "raise dataloader_num_workers from 0 to 2")
TWO_RANKS = {"step": 6, "verdict": VERDICT.to_dict(), "ranks": [
    {"rank": 0, "host": "a", "gpus": [0], "own_step_time_s": 0.1, "step_time_s": 0.5, "data_wait_pct": 3.0, "tokens": 800,
     "mem_used_gib": None, "torch_mem_allocated_gib": 1.5, "straggler": False},
    {"rank": 1, "host": "a", "gpus": [1], "own_step_time_s": 0.3, "step_time_s": 0.5, "data_wait_pct": 41.0, "tokens": 790,
     "mem_used_gib": None, "torch_mem_allocated_gib": 1.0, "straggler": True},
    {"uneven_memory": True}]}
SERIES = {"utilization_pct": [(80, 30), (90, 40)], "power_usage_mw": [250_000, 300_000], "temperature_c": [60, 62],
          "memory_info_used": [10 * 2**30]}


def torch_memory(device):  # what torch.cuda reports on a GPU (the CPU has none): 1 GiB cached but unused
    return {"torch/mem_allocated_gib": 2.0, "torch/mem_reserved_gib": 3.0, "torch/alloc_retries": 0.0}


def tracker_env(monkeypatch, tmp_path: Path) -> dict[str, str]:
    """Local stores only, nothing attempted over the network: MLflow in SQLite, W&B offline under tmp_path."""
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "MLFLOW_EXPERIMENT_NAME": "trackers",
           "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
           "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true", "WANDB_X_DISABLE_STATS": "true",
           "WANDB_PROJECT": "trackers", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
           "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)  # MLflow's artifact root (./mlruns) of a SQLite store
    return env


def mlflow_run(tmp_path: Path):
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("trackers").experiment_id])
    return client, run


# -- the numbers and texts, as pure functions ---------------------------------------------------------------------------
def test_a_two_rank_window_gives_numbers_per_rank_and_the_verdict_code():
    assert tracker_metrics(TWO_RANKS) == {
        "telemetry/verdict_code": 3.0, "telemetry/uneven_memory": 1.0,
        "rank0/own_step_time_s": 0.1, "rank0/step_time_s": 0.5, "rank0/data_wait_pct": 3.0, "rank0/tokens": 800.0,
        "rank0/torch_mem_allocated_gib": 1.5, "rank0/straggler": 0.0,
        "rank1/own_step_time_s": 0.3, "rank1/step_time_s": 0.5, "rank1/data_wait_pct": 41.0, "rank1/tokens": 790.0,
        "rank1/torch_mem_allocated_gib": 1.0, "rank1/straggler": 1.0}  # mem_used_gib unknown (no NVML): left out
    assert tracker_texts(TWO_RANKS) == {"telemetry/verdict": VERDICT.line()}
    named = {"rank": 1, "phase": "backward", "excess_ms": 200.0, "line": "straggler: rank 1 is slow in backward (...)"}
    assert tracker_texts({**TWO_RANKS, "straggler": named}) == {"telemetry/verdict": VERDICT.line(),
                                                                "telemetry/straggler": named["line"]}


def test_one_process_adds_the_verdict_code_alone():
    record = {"step": 2, "verdict": Verdict("healthy", "CPU run: 2% data wait", "nothing to change").to_dict()}
    assert rank_metrics(record) == {} and tracker_metrics(record) == {"telemetry/verdict_code": 0.0}
    assert tracker_metrics({"step": 2, "verdict": {**record["verdict"], "kind": "a-new-kind"}}) == {
        "telemetry/verdict_code": float(UNKNOWN_VERDICT_CODE)}


def test_every_verdict_kind_has_its_own_code():
    """A kind judge() can give without a code would chart as 'unknown': the table must hold each kind verdicts.py names."""
    source = Path(telemetry_module.__file__).with_name("verdicts.py").read_text()
    kinds = set(re.findall(r'Verdict\("([a-z-]+)"', source))
    assert kinds == set(VERDICT_CODES), kinds
    assert len(set(VERDICT_CODES.values())) == len(VERDICT_CODES)


def test_a_failing_tracker_is_said_once_and_never_raises(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(trackers, "_warned", set())  # said once a process: this test's own process-wide memory
    class BrokenWriter:
        def add_text(self, *args):
            raise OSError("disk full")

    trainer = Trainer(model=tiny_bert(), args=tiny_args(tmp_path), callbacks=[TensorBoardCallback(tb_writer=BrokenWriter())])
    assert list(active_trackers(trainer)) == ["TensorBoardCallback"]
    with caplog.at_level(logging.WARNING, logger="hf_gpu_train.telemetry"):
        publish_texts(trainer, 2, {"telemetry/verdict": "healthy"})
        publish_texts(trainer, 4, {"telemetry/verdict": "healthy"})
    said = [r.getMessage() for r in caplog.records if "did not take the verdict text" in r.getMessage()]
    assert len(said) == 1 and "OSError: disk full" in said[0], said


# -- a real Trainer with telemetry and the three trackers, read back ----------------------------------------------------
def test_telemetry_reaches_tensorboard_mlflow_and_wandb(tmp_path, monkeypatch, machine):
    tracker_env(monkeypatch, tmp_path)
    out = tmp_path / "out"
    trainer = Trainer(model=tiny_bert(), args=tiny_args(out, report_to=TRACKERS), train_dataset=TokenDataset())
    backend = FakeNvmlBackend(machine("2x-a100-one-busy"), series=SERIES)
    callback = attach_telemetry(trainer, backend=backend, gpu_indices=[0], interval_s=0.02, memory_probe=torch_memory,
                                health_every_s=0.02)

    class XidAtStep3(TrainerCallback):  # the driver reports an XID mid-run: its words reach every tracker
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                backend.inject_xid(backend.handle(0), 79)
                time.sleep(0.2)  # the sampler's next health reading

    trainer.add_callback(XidAtStep3())
    try:
        trainer.train()
    finally:
        wandb.finish()  # the WandbCallback leaves the run open at train end; finishing writes its summary
        wandb.teardown()  # its service process, now: at the test process's exit its atexit hook finds the socket gone
    windows = [r for r in callback.records if not r["final"]]  # the final window is written to the report, not logged
    steps = [w["step"] for w in windows]
    assert steps == [2, 4, 6, 8], steps
    last = windows[-1]
    numbers = ("gpu0/util_pct", "gpu0/power_w", "gpu0/temp_c", "gpu0/mem_used_gib", "loop/step_time_s", "loop/samples_per_s",
               "loop/data_wait_pct", "host/cpu_pct", "torch/mem_allocated_gib")
    verdict_line = Verdict.from_dict(last["verdict"]).line()
    code = float(VERDICT_CODES[last["verdict"]["kind"]])

    # MLflow: the run's metric history per step (keys as logged), the verdict as a run tag
    client, run = mlflow_run(tmp_path)
    for key in numbers + ("telemetry/verdict_code",):
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == steps, key
    assert run.data.metrics["gpu0/power_w"] == pytest.approx(last["metrics"]["gpu0/power_w"], abs=1e-3)
    assert run.data.metrics["telemetry/verdict_code"] == code
    assert run.data.tags["telemetry/verdict"] == verdict_line
    assert run.data.tags["telemetry/gpu_health"].startswith("rank 0: GPU 0: XID 79")

    # TensorBoard: scalars under the Trainer's "train/" prefix, the verdict in the TEXT tab at every log step
    scalars, texts = tensorboard_events(out / "runs")
    for key in numbers + ("telemetry/verdict_code",):
        assert [step for step, _ in scalars[f"train/{key}"]] == steps, key
    assert scalars["train/gpu0/power_w"][-1][1] == pytest.approx(last["metrics"]["gpu0/power_w"], abs=1e-3)
    assert texts["telemetry/verdict"] == [(w["step"], Verdict.from_dict(w["verdict"]).line()) for w in windows]
    assert [step for step, _ in texts["telemetry/gpu_health"]] == [4]  # said once, in the window that saw it

    # W&B offline: history rows against train/global_step, the latest of each in the run's summary
    history, summary = wandb_run(tmp_path)
    for key in numbers + ("telemetry/verdict_code",):
        assert [row["train/global_step"] for row in history if f"train/{key}" in row] == steps, key
    assert [(row["train/global_step"], row["telemetry/verdict"]) for row in history if "telemetry/verdict" in row] == [
        (w["step"], Verdict.from_dict(w["verdict"]).line()) for w in windows]
    assert summary["telemetry/verdict"] == verdict_line and summary["train/telemetry/verdict_code"] == code
    assert summary["train/gpu0/power_w"] == pytest.approx(last["metrics"]["gpu0/power_w"], abs=1e-3)


@pytest.mark.slow
def test_two_gloo_processes_put_each_ranks_figures_in_every_tracker(tmp_path, monkeypatch):
    """Rank 1 reads its data slowly (tests/callbacks/trackers_probe.py): its figures (its data wait the larger) and
    its straggler flag reach each tracker from rank 0, beside rank 0's."""
    env = tracker_env(monkeypatch, tmp_path)
    out = tmp_path / "run"
    run = launch(cpu_config(tmp_path), Path(__file__).with_name("trackers_probe.py"), str(out), env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    windows = [json.loads(line) for line in (out / "telemetry.jsonl").read_text().splitlines() if '"kind": "window"' in line]
    steps = [w["step"] for w in windows if w.get("ranks") and not w["final"]]
    assert steps == [2, 4, 6], windows

    client, mlrun = mlflow_run(tmp_path)
    for key in ("rank0/step_time_s", "rank1/step_time_s", "rank0/data_wait_pct", "rank1/data_wait_pct", "rank1/tokens",
                "rank0/straggler", "rank1/straggler", "telemetry/uneven_memory"):
        assert [m.step for m in client.get_metric_history(mlrun.info.run_id, key)] == steps, key
    def values(key):
        return [m.value for m in sorted(client.get_metric_history(mlrun.info.run_id, key), key=lambda m: m.step)]

    ranks = [[r for r in w["ranks"] if "rank" in r] for w in windows if w.get("ranks") and not w["final"]]
    for r in (0, 1):  # each rank's own figure, as rank 0 gathered it (rounded to 4 places as telemetry logs)
        assert values(f"rank{r}/data_wait_pct") == pytest.approx([w[r]["data_wait_pct"] for w in ranks], abs=1e-4)
        assert values(f"rank{r}/tokens") == [float(w[r]["tokens"]) for w in ranks]
    assert min(values("rank1/data_wait_pct")) > max(values("rank0/data_wait_pct"))  # rank 1 loads slowly
    # named by arrival (callbacks/arrivals.py) at step 4: the probe exchanges at every step, steps 2, 3 and 4 flag it
    assert values("rank0/straggler") == [0.0, 0.0, 0.0] and values("rank1/straggler") == [0.0, 1.0, 1.0]
    assert values("straggler/rank") == [1.0, 1.0]
    assert mlrun.data.tags["telemetry/straggler"].startswith("straggler: rank 1 is slow in data")
    assert mlrun.data.tags["telemetry/verdict"] == Verdict.from_dict(
        [w for w in windows if not w["final"]][-1]["verdict"]).line()

    scalars, texts = tensorboard_events(out / "runs")
    assert [step for step, _ in scalars["train/rank1/data_wait_pct"]] == steps
    assert [step for step, _ in scalars["train/rank0/straggler"]] == steps
    assert [step for step, _ in texts["telemetry/verdict"]] == steps
    assert [step for step, _ in texts["telemetry/straggler"]] == [4, 6]

    history, summary = wandb_run(tmp_path)
    assert [row["train/global_step"] for row in history if "train/rank1/straggler" in row] == steps
    assert "train/rank0/data_wait_pct" in summary and "telemetry/verdict" in summary
