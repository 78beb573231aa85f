"""End to end on the CPU: real models, real Trainer, 1 and 2 processes, resume after SIGKILL, bad input."""

import json
from pathlib import Path

import pytest
import yaml

from hf_gpu_train.finetune.builtin import PYTHON_DOCS_SECTIONS
from hf_gpu_train.finetune.run import main
from tests.launching import cpu_config, launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "finetune.py")
pytestmark = pytest.mark.slow

TEXT_SMALL = ["max_train_samples=96", "max_eval_samples=64", "max_length=32", "per_device_train_batch_size=16",
              "num_train_epochs=1", "logging_steps=2", "telemetry=false"]
VISION_SMALL = ["task=image-classification", "model=timm/test_resnet", "pretrained=false", "dataset=builtin:digits", "image_size=32",
                "max_train_samples=128", "max_eval_samples=64", "per_device_train_batch_size=32", "num_train_epochs=1",
                "learning_rate=1e-3", "telemetry=false"]


def results(out: Path) -> dict:
    return json.loads((out / "eval_results.json").read_text())


def figures_by_hand(out: Path, arguments: list[str], trained: bool = True, rows: list[int] | None = None) -> dict[str, float]:
    """The saved model (``trained=False``: the model as the run loaded it, the same seed first), its validation split
    rebuilt from the same arguments (``rows``: those of it), a plain forward and argmax, scored by scikit-learn: what
    the Trainer's evaluation (class ids gathered across ranks, padding duplicates dropped, our numpy metrics) reported."""
    import torch
    from safetensors.torch import load_file
    from sklearn.metrics import accuracy_score, f1_score
    from transformers import set_seed

    from hf_gpu_train.finetune.loading import load_config
    from hf_gpu_train.finetune.run import prepared_for
    from hf_gpu_train.finetune.runtime import resolve_runtime

    cfg = load_config(None, [*arguments, f"output_dir={out.parent / 'by-hand'}"])
    set_seed(cfg.seed)  # what the run does before it loads the model: the new head's weights
    p = prepared_for(cfg, resolve_runtime(cfg))
    model, validation, collator = p.model, p.validation, p.collator
    if trained:
        model.load_state_dict(load_file(out / "model.safetensors"))
    model.eval()
    chosen = list(range(len(validation))) if rows is None else rows
    predicted, labels = [], []
    with torch.no_grad():
        for start in range(0, len(chosen), 16):
            batch = collator([validation[i] for i in chosen[start:start + 16]])
            labels += batch.pop("labels").tolist()
            predicted += model(**batch)["logits"].argmax(-1).tolist()
    return {"eval_accuracy": accuracy_score(labels, predicted), "eval_f1": f1_score(labels, predicted, average="macro")}


def assert_scored_as_by_hand(out: Path, arguments: list[str]) -> None:
    reported = results(out)
    expected = figures_by_hand(out, arguments)
    assert {k: reported[k] for k in expected} == pytest.approx(expected, abs=1e-9)


def test_text_one_process(tmp_path, capsys):
    out = tmp_path / "text"
    assert main([*TEXT_SMALL, f"output_dir={out}"]) == 0  # the default data: builtin:python-docs
    printed = capsys.readouterr().out
    assert_scored_as_by_hand(out, TEXT_SMALL)
    assert json.loads((out / "label_map.json").read_text()) == sorted(PYTHON_DOCS_SECTIONS)
    assert (out / "finetune_config.yaml").is_file()
    assert not list(out.glob("checkpoint-*"))  # save_strategy=auto: a run shorter than checkpoint_minutes saves at the end only
    assert '"eval_accuracy"' in printed
    after, before = results(out), json.loads((out / "baseline_results.json").read_text())
    last = printed.strip().splitlines()[-1]
    assert last.startswith(f"hf_gpu_train: accuracy {after['eval_accuracy']:.4g}, macro F1 {after['eval_f1']:.4g}")
    assert f"on 64 validation examples; before training (the model as loaded): " \
           f"accuracy {before['eval_accuracy']:.4g}" in last
    # the learning rate the model chose is the run's: the same command with it written out is the same run, finished
    saved = yaml.safe_load((out / "finetune_config.yaml").read_text())
    assert saved["learning_rate"] == pytest.approx(1e-4)  # MiniLM's width 384
    assert json.loads((out / "hf_gpu_train_run.json").read_text())["training"]["learning_rate"] == pytest.approx(1e-4)
    assert main([*TEXT_SMALL, "learning_rate=1e-4", f"output_dir={out}"]) == 0
    assert "already holds this run, finished" in capsys.readouterr().out
    assert main(["--config", str(out / "finetune_config.yaml"), f"output_dir={out}"]) == 0
    assert "already holds this run, finished" in capsys.readouterr().out
    assert main([*TEXT_SMALL, "learning_rate=3e-4", f"output_dir={out}"]) == 2  # another rate: another run, refused
    assert "learning_rate: 0.0001 -> 0.0003" in capsys.readouterr().err


def test_evaluating_before_training_on_a_sample_scores_those_rows_and_changes_nothing_the_run_trains(tmp_path, capsys,
                                                                                                     monkeypatch):
    """The evaluation before training draws from the random generators (its DataLoader's seed); the run puts them back,
    so the weights equal those of a run that did not evaluate first. Above SAMPLE_ROWS validation rows (16 here, 512
    as shipped) it scores the seeded sample's rows, as a plain forward over those rows of the model as loaded does,
    and says so on the last line and in baseline_results.json."""
    from safetensors.torch import load_file

    from hf_gpu_train.finetune import evaluate_before
    from tests.scaling.equivalence import assert_same_params

    monkeypatch.setattr(evaluate_before, "SAMPLE_ROWS", 16)
    arguments = [*TEXT_SMALL, "max_train_samples=48", "save_strategy=no"]
    outs = {flag: tmp_path / f"before-{flag}" for flag in ("true", "false")}
    for flag, out in outs.items():
        assert main([*arguments, f"evaluate_before={flag}", f"output_dir={out}"]) == 0
    assert not (outs["false"] / "baseline_results.json").exists()
    assert_same_params(load_file(outs["true"] / "model.safetensors"), load_file(outs["false"] / "model.safetensors"), atol=0)
    baseline = json.loads((outs["true"] / "baseline_results.json").read_text())
    rows = evaluate_before.sample_indices(64)
    assert len(rows) == 16 and rows == sorted(set(rows)) and {"rows": 16, "validation_rows": 64}.items() <= baseline.items()
    by_hand = figures_by_hand(outs["true"], [*arguments, "evaluate_before=true"], trained=False, rows=rows)
    assert {k: baseline[k] for k in by_hand} == pytest.approx(by_hand, abs=1e-9)
    last = [line for line in capsys.readouterr().out.splitlines() if "before training (the model as loaded" in line][0]
    assert "on 64 validation examples; before training (the model as loaded on a sample of 16 of 64 validation examples): " \
           f"accuracy {baseline['eval_accuracy']:.4g}" in last


def test_vision_one_process(tmp_path):
    out = tmp_path / "vision"
    assert main([*VISION_SMALL, f"output_dir={out}"]) == 0
    assert_scored_as_by_hand(out, VISION_SMALL)
    assert json.loads((out / "label_map.json").read_text()) == [str(i) for i in range(10)]


# text through scripts/finetune.py on 2 processes: tests/finetune/test_resume.py (a rank killed, the command again)
@pytest.mark.parametrize("task_args", [VISION_SMALL], ids=["vision"])
def test_two_ddp_processes_through_the_generated_cpu_config(tmp_path, task_args):
    out = tmp_path / "ddp"
    arguments = [*task_args, "max_eval_samples=63"]  # an odd count: the evaluation must drop the padding duplicate
    run = launch(cpu_config(tmp_path), SCRIPT, *arguments, f"output_dir={out}", timeout=420)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "CPU x2" in run.stdout
    summary = json.loads((out / "run_summary.json").read_text())
    per_step = 16 * 2 if task_args is TEXT_SMALL else 32 * 2  # batch x 2 processes: half the steps of one process
    assert summary["global_step"] == -(-(96 if task_args is TEXT_SMALL else 128) // per_step)
    assert_scored_as_by_hand(out, arguments)


def snapshot_dir(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("args, message", [
    (["model=/no/such/model"], "does not exist"),
    (["task=summarization"], "task='summarization'"),
    (["dataset=none", "train_file=/no/such/file.csv"], "does not exist"),
    (["label_column=sentiment"], "label_column='sentiment'"),
    (["per_device_train_batch_size=0"], "must be at least 1"),
    (["task=image-classification", "model=timm/not_a_model_xyz", "dataset=builtin:digits"], "not a timm model"),
])
def test_bad_input_exits_2_with_a_clear_error(tmp_path, capsys, args, message):
    assert main([*args, f"output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_other_runs_checkpoints_with_different_labels_are_left_alone(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoint-10").mkdir(parents=True)
    (out / "checkpoint-10" / "model.safetensors").write_bytes(b"weights of another run")
    (out / "label_map.json").write_text(json.dumps(["cat", "dog"]))
    before = snapshot_dir(out)
    assert main([*TEXT_SMALL, f"output_dir={out}"]) == 2
    assert "trained with labels ['cat', 'dog']" in capsys.readouterr().err
    assert snapshot_dir(out) == before


def test_resume_never_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoint-3").mkdir(parents=True)
    assert main([*TEXT_SMALL, f"output_dir={out}", "resume=never"]) == 2
    assert "resume=never" in capsys.readouterr().err


def test_unreadable_image_exits_2(tmp_path, capsys):
    from PIL import Image

    root = tmp_path / "imgs"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (8, 8)).save(root / label / f"{i}.png")
    (root / "a" / "bad.jpg").write_bytes(b"\x00garbage")
    assert main(["task=image-classification", "model=timm/test_resnet", "pretrained=false", f"dataset=imagefolder:{root}",
                 f"output_dir={tmp_path / 'o'}"]) == 2
    assert "bad.jpg" in capsys.readouterr().err
