"""``--config NAME_OR_PATH``: a shipped recipe by its name, a file by its path, anything else one usage line that lists
the shipped names; a shipped recipe's data files are found wherever the package is (finetune/recipe_names.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_gpu_train.errors import UsageError
from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.recipe_names import RECIPES_DIR, shipped_names
from hf_gpu_train.finetune.run import main, parse_args

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_names_are_the_recipes_in_the_package():
    assert "minilm_text_demo" in shipped_names() and "smollm2_lora_demo" in shipped_names()
    assert RECIPES_DIR == ROOT / "hf_gpu_train" / "finetune" / "recipes"


@pytest.mark.parametrize("value", ["minilm_text_demo", "minilm_text_demo.yaml"])
def test_a_name_is_the_shipped_recipe_from_any_directory(monkeypatch, tmp_path, value):
    monkeypatch.chdir(tmp_path)
    assert parse_args(["--config", value, "max_steps=2"]) == (str(RECIPES_DIR / "minilm_text_demo.yaml"), ["max_steps=2"])


def test_a_file_that_exists_is_used_as_a_path(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "minilm_text_demo.yaml").write_text("task: text-classification\n")
    assert parse_args(["--config", "minilm_text_demo.yaml"]) == ("minilm_text_demo.yaml", [])
    assert parse_args([]) == (None, [])


@pytest.mark.parametrize("value", ["minilm_txt_demo", "minilm_txt_demo.yaml", "somewhere/minilm_txt_demo.yaml"])
def test_neither_a_file_nor_a_name_is_one_usage_line_with_the_names(monkeypatch, tmp_path, capsys, value):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as raised:
        parse_args(["--config", value])
    message = str(raised.value)
    assert repr(value) in message and all(name in message for name in shipped_names())
    assert message.endswith("nearest: minilm_text_demo") and "\n" not in message
    assert main(["--config", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("finetune: error: --config") and "nearest: minilm_text_demo" in err


def test_a_shipped_recipes_data_files_are_found_from_any_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    recipe, overrides = parse_args(["--config", "smollm2_lora_demo", "max_steps=1"])
    cfg = load_config(recipe, overrides)
    assert Path(cfg.train_file) == RECIPES_DIR / "data" / "python_docs_chat" / "train.jsonl" and Path(cfg.train_file).is_file()
    assert Path(cfg.validation_file).is_file() and overrides[-1] == "max_steps=1" and cfg.max_steps == 1
    recipe, overrides = parse_args(["--config", "smollm2_lora_demo", "train_file=mine.jsonl"])
    assert load_config(recipe, overrides).train_file == "mine.jsonl"  # the command line's own file wins


def test_the_old_recipes_path_of_a_clone_still_reads_the_shipped_recipe(monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes/ at the repository root: a link to the package's folder
    recipe, overrides = parse_args(["--config", "recipes/smollm2_lora_demo.yaml"])
    assert recipe == "recipes/smollm2_lora_demo.yaml"
    assert Path(load_config(recipe, overrides).train_file) == RECIPES_DIR / "data" / "python_docs_chat" / "train.jsonl"


def test_the_config_loader_itself_finds_a_shipped_recipes_data_and_the_record_does_not_name_the_install(
        monkeypatch, tmp_path):
    from hf_gpu_train.finetune.recipe_names import shipped_path
    from hf_gpu_train.finetune.run_record import RunIdentity

    monkeypatch.chdir(tmp_path)  # not the repository: nothing relative to here
    cfg = load_config(shipped_path("smollm2_lora_demo"))  # no parse_args: hf_gpu_train.load_config(recipe) as a user would
    assert Path(cfg.train_file) == RECIPES_DIR / "data" / "python_docs_chat" / "train.jsonl"
    identity = RunIdentity.of(cfg, "fp32", 8)
    assert identity.training["train_file"] == "recipes/data/python_docs_chat/train.jsonl"  # as a clone names it
    mine = tmp_path / "recipe.yaml"
    mine.write_text("task: causal-lm\nmodel: builtin:smollm2\ntrain_file: data/python_docs_chat/train.jsonl\n")
    assert load_config(mine).train_file == "data/python_docs_chat/train.jsonl"  # your recipe: read from where you are


@pytest.mark.parametrize("value", ["minilm_text_demo", "minilm_text_demo.yaml"])
def test_load_config_takes_a_recipe_name_as_config_does(monkeypatch, tmp_path, value):
    """Issue 38, item 5: load_config("minilm_text_demo") refused the name --config takes."""
    from hf_gpu_train.finetune.recipe_names import shipped_path

    monkeypatch.chdir(tmp_path)  # a pip user's directory: no recipes/ folder
    cfg = load_config(value, ["max_steps=3"])
    assert cfg == load_config(shipped_path("minilm_text_demo"), ["max_steps=3"]) and cfg.max_steps == 3
    assert cfg.output_dir == "outputs/minilm_text_demo"


@pytest.mark.parametrize("value", ["minilm_txt_demo", "somewhere/minilm_txt_demo.yaml"])
def test_load_config_of_neither_names_the_shipped_recipes_not_a_folder_a_pip_install_lacks(monkeypatch, tmp_path, value):
    from hf_gpu_train.finetune.config import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as raised:
        load_config(value)
    message = str(raised.value)
    assert message.startswith(f"config {value!r}: ") and all(name in message for name in shipped_names())
    assert message.endswith("nearest: minilm_text_demo") and "recipes/" not in message and "\n" not in message
