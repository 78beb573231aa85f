"""Issue 20: report.md tells the run's story from the files a fine-tune leaves (the final metrics, training and
evaluation loss, learning rate and gradient norm against steps, the resolved config, the launch plan applied or its
absence), and `hf-gpu-train report` redraws it from output_dir, with telemetry or without."""

from __future__ import annotations

import json
import re

import yaml

from hf_gpu_train.cli import main
from hf_gpu_train.report.story import log_series

HISTORY = [{"step": 2, "loss": 0.9, "learning_rate": 2e-5, "grad_norm": 3.5}, {"step": 4, "loss": 0.7, "learning_rate": 4e-5, "grad_norm": 2.1},
           {"step": 4, "eval_loss": 0.75, "eval_accuracy": 0.6}, {"step": 6, "loss": 0.5, "learning_rate": 3e-5, "grad_norm": 1.2},
           {"step": 8, "loss": 0.4, "learning_rate": 1e-5, "grad_norm": 0.9}, {"step": 8, "eval_loss": 0.55, "eval_accuracy": 0.8},
           {"step": 8, "train_runtime": 12.0, "train_loss": 0.6}]


def finished_run(out, **config):
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer_state.json").write_text(json.dumps({"log_history": HISTORY, "global_step": 8}))
    (out / "eval_results.json").write_text(json.dumps({"eval_loss": 0.55, "eval_accuracy": 0.8, "eval_f1": 0.79,
                                                       "eval_runtime": 1.5, "eval_samples_per_second": 100.0, "eval_model_preparation_time": 0.002}))
    (out / "finetune_config.yaml").write_text(yaml.safe_dump({"task": "text-classification", "model": "builtin:minilm",
                                                              "dataset": "builtin:text", "learning_rate": 5e-5,
                                                              "gradient_checkpointing": False, "checkpoint_layers": "all",
                                                              "method": "full", "lora_r": 16, **config}))
    (out / "run_summary.json").write_text(json.dumps({"global_step": 8}))  # scripts/finetune.py's, without a plan
    return out


def polyline_points(svg: str) -> list[int]:
    return [len(p.split()) for p in re.findall(r'points="([^"]*)"', svg)]


def test_the_report_of_a_run_without_telemetry_tells_its_story(tmp_path, capsys):
    out = finished_run(tmp_path / "run")
    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    metrics = report.split("## Final metrics")[1].split("##")[0]
    assert "| accuracy | 0.8 |" in metrics and "| f1 | 0.79 |" in metrics and "runtime" not in metrics and "preparation" not in metrics
    for chart in ("run_loss.svg", "run_learning_rate.svg", "run_grad_norm.svg"):
        assert f"({chart})" in report and (out / chart).is_file()
    assert sorted(polyline_points((out / "run_loss.svg").read_text())) == [2, 4]  # evaluation at 2 steps, training at 4
    config = report.split("## Configuration")[1].split("##")[0]
    assert "| model | builtin:minilm |" in config and "| learning_rate | 5e-05 |" in config
    assert "lora_r" not in config and "checkpoint_layers" not in config  # not this run's (another task's keys are not
    # in a run's config: finetune_config.yaml holds its own task's)
    assert "## Launch plan\n\nnone" in report and "not recorded (telemetry=false" in report


def test_the_report_names_the_plan_applied_and_not_applied(tmp_path):
    out = finished_run(tmp_path / "run")
    plan = {"file": "box.plan.json", "machine": "1x-h200", "strategy": "single", "found_by": "HF_GPU_TRAIN_PLAN",
            "values": {"per_device_train_batch_size": {"plan": 64, "used": 32, "reason": "largest micro-batch that fits"}},
            "overridden": [{"source": "config", "key": "per_device_train_batch_size", "user_value": 32, "plan_value": 64}]}
    (out / "run_summary.json").write_text(json.dumps({"global_step": 8, "plan": plan}))
    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "| per_device_train_batch_size | 64 | 32 |" in report and "overridden by config" in report


def test_a_folder_without_a_run_is_a_usage_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no run" in capsys.readouterr().err


def test_the_series_skip_logs_without_the_value():
    series = log_series(HISTORY)
    assert series["loss"] == ([2.0, 4.0, 6.0, 8.0], [0.9, 0.7, 0.5, 0.4]) and series["eval_loss"][0] == [4.0, 8.0]


def test_the_evaluation_before_training_is_the_evaluation_loss_at_step_0():
    series = log_series(HISTORY, {"eval_loss": 1.6, "eval_accuracy": 0.25})
    assert series["eval_loss"] == ([0.0, 4.0, 8.0], [1.6, *log_series(HISTORY)["eval_loss"][1]])
    assert log_series(HISTORY, {"eval_accuracy": 0.25})["eval_loss"][0] == [4.0, 8.0]  # no loss measured before: none drawn


def test_a_plain_trainer_with_telemetry_gets_its_loss_curves(tmp_path):
    """Anyone's Trainer with attach_telemetry: the Trainer writes trainer_state.json only in save_state(), which a
    plain train() never calls; telemetry hands the report the log history at train end."""
    from transformers import Trainer

    from hf_gpu_train.callbacks import attach_telemetry
    from tests.callbacks.tiny import TokenDataset, tiny_args, tiny_bert

    out = tmp_path / "plain"
    trainer = Trainer(model=tiny_bert(), args=tiny_args(out, max_steps=8, logging_steps=2, eval_strategy="steps", eval_steps=4),
                      train_dataset=TokenDataset(64), eval_dataset=TokenDataset(16))
    attach_telemetry(trainer)
    trainer.train()
    assert not (out / "trainer_state.json").exists()
    report = (out / "report.md").read_text()
    assert "## Training" in report and "(run_loss.svg)" in report and "From `log_history.json`" in report
    assert sorted(polyline_points((out / "run_loss.svg").read_text())) == [2, 4]  # evaluations at 4 and 8, 4 training logs
    assert "not recorded (scripts/finetune.py records the launch plan it applied)" in report


def test_a_killed_run_is_drawn_from_its_newest_checkpoint(tmp_path, capsys):
    out = tmp_path / "killed"
    for step, history in ((4, HISTORY[:3]), (8, HISTORY[:5])):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "From `checkpoint-8/trainer_state.json`" in report
    assert sorted(polyline_points((out / "run_loss.svg").read_text())) == [1, 4]  # the newest: 4 training logs, 1 evaluation


def test_files_cut_short_or_of_another_shape_are_not_a_traceback(tmp_path, capsys):
    out = finished_run(tmp_path / "odd")
    (out / "eval_results.json").write_text("[1, 2]")
    (out / "run_summary.json").write_text(json.dumps({"plan": {"values": {"a": 1, "b": {"plan": 2, "used": 2, "reason": "r"}},
                                                               "overridden": "x", "memory": {"estimate_bytes": 1}}}))
    (out / "telemetry.jsonl").write_text(json.dumps({"kind": "sample", "t": 0.0}) + "\n" + '{"kind": "wind')  # a killed writer
    (out / "telemetry_summary.json").write_text("{}")
    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "| b | 2 | 2 | r |" in report and "## Training" in report
    (out / "trainer_state.json").write_text(json.dumps({"log_history": "not a list"}))
    assert main(["report", str(out)]) == 0
    (out / "telemetry_summary.json").write_text(json.dumps({"metrics": {"loop/samples_per_s": 3}}))  # not {mean, max}
    assert main(["report", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not in the shape the toolkit writes" in err and "Traceback" not in err


def test_the_newest_of_the_runs_own_histories_is_drawn(tmp_path):
    """Someone's own Trainer writing log_history.json into an output_dir where an earlier run saved trainer_state.json:
    the report draws the newer one."""
    import os

    from hf_gpu_train.report.story import read_history

    out = finished_run(tmp_path / "reused")
    (out / "log_history.json").write_text(json.dumps({"log_history": HISTORY[:2]}))
    old = (out / "trainer_state.json").stat().st_mtime_ns
    os.utime(out / "log_history.json", ns=(old + 10**9, old + 10**9))
    history, source = read_history(out)
    assert source == "log_history.json" and history == HISTORY[:2]


def test_a_baseline_measured_on_a_sample_is_said_to_be_one_beside_its_figures_and_its_point_on_the_loss_curve(tmp_path):
    out = finished_run(tmp_path / "run")
    (out / "baseline_results.json").write_text(json.dumps({"eval_loss": 1.6, "eval_accuracy": 0.2, "rows": 512,
                                                           "validation_rows": 5000}))
    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert ("Before training (the same evaluation on a seeded sample of 512 of the 5000 validation rows of the model as "
            "it was loaded): loss 1.6, accuracy 0.2") in report  # its row counts are not figures
    assert "The evaluation loss at step 0 is the evaluation before training's, on a seeded sample of 512 of the 5000" in report
    (out / "baseline_results.json").write_text(json.dumps({"eval_loss": 1.6, "eval_accuracy": 0.2, "rows": 64,
                                                           "validation_rows": 64}))
    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "Before training (the same evaluation of the model as it was loaded): loss 1.6, accuracy 0.2" in report
    assert "seeded sample" not in report
