import pytest
import yaml

from hf_gpu_train.finetune.config import ConfigError, FinetuneConfig, save_resolved
from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.recipe_names import RECIPES_DIR


def test_defaults_live_in_one_place_and_validate():
    """The run's defaults (FinetuneConfig) and the default task's own (its options), resolved by the task."""
    from hf_gpu_train.finetune.loading import resolve
    from hf_gpu_train.finetune.tasks.text_classification.options import TextClassificationOptions

    cfg = load_config()
    assert cfg == resolve(FinetuneConfig(options=TextClassificationOptions()))
    assert cfg.method == "full" and cfg.max_length == 128
    assert cfg.model == "builtin:minilm" and cfg.dataset == "builtin:python-docs"


def test_yaml_plus_overrides_with_types(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: image-classification\nmodel: timm/test_resnet\nlearning_rate: 1e-3\nimage_size: 64\n")
    cfg = load_config(recipe, ["learning_rate=3e-5", "gradient_checkpointing=true", "max_train_samples=100",
                               "validation_split=none", "augmentation={hflip: 0.0}", "dataloader_num_workers=2"])
    assert cfg.task == "image-classification" and cfg.image_size == 64
    assert cfg.learning_rate == 3e-5 and cfg.gradient_checkpointing is True and cfg.max_train_samples == 100
    assert cfg.validation_split is None and cfg.augmentation == {"hflip": 0.0} and cfg.dataloader_num_workers == 2


@pytest.mark.parametrize("overrides, pattern", [
    (["learning_rat=1e-4"], "unknown config key 'learning_rat'; did you mean 'learning_rate'"),
    (["per_device_train_batch_size=0"], "per_device_train_batch_size=0: must be at least 1"),
    (["task=translation"], "task='translation': use one of text-classification, image-classification"),
    (["precision=int4"], "precision='int4'"),
    (["num_train_epochs=abc"], "expected float"),
    (["learning_rate"], "write key=value"),
    (["save_strategy=steps"], "save_strategy=steps needs save_steps"),
    (["resume=/no/such/checkpoint"], "resume="),
    (["max_steps=0"], "max_steps=0"),
])
def test_bad_values_name_the_key_and_the_fix(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config(None, overrides)


def test_unknown_key_in_yaml_and_bad_files(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("modle: x\n")
    with pytest.raises(ConfigError, match="did you mean 'model'"):
        load_config(recipe)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.yaml")
    recipe.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="key: value"):
        load_config(recipe)


def test_resolved_config_is_saved(tmp_path):
    cfg = load_config(None, ["learning_rate=1e-4"])
    path = save_resolved(cfg, tmp_path)
    assert yaml.safe_load(path.read_text())["learning_rate"] == 1e-4


@pytest.mark.parametrize("path", sorted(RECIPES_DIR.glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_recipe_loads_and_names_its_command(path):
    assert path.read_text().startswith("# ") and "finetune.py" in path.read_text().splitlines()[0]
    load_config(path)


def test_yaml_no_stays_a_word(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("eval_strategy: no\nsave_strategy: no\ntorch_compile: false\n")
    cfg = load_config(recipe, ["gradient_checkpointing=true"])
    assert cfg.eval_strategy == "no" and cfg.save_strategy == "no" and cfg.torch_compile is False
    assert load_config(None, ["eval_strategy=no"]).eval_strategy == "no"


@pytest.mark.parametrize("overrides, pattern", [
    (["checkpoint_layers=selective"], "add gradient_checkpointing=true"),
    (["gradient_checkpointing=true", "checkpoint_layers=every-1"], "every-N with N >= 2"),
    (["gradient_checkpointing=true", "checkpoint_layers=some"], "use all, selective, selective-lean or every-N"),
    (["task=image-classification", "model=timm/test_resnet", "gradient_checkpointing=true", "checkpoint_layers=every-2"],
     "timm models checkpoint every block"),
    (["task=causal-lm", "model=some/llm", "method=qlora", "gradient_checkpointing=true", "checkpoint_layers=selective"],
     "bitsandbytes' 4-bit matmul"),
    (["task=causal-lm", "model=some/llm", "optimizer_in_backward=true"], "method=lora: it saves the gradients of full"),
    (["optimizer_in_backward=true", "extra={max_grad_norm: 1.0}"], "max_grad_norm=1.0: each parameter steps"),
    (["offload_activations=true", "torch_compile=true"], "choose one"),
    (["task=causal-lm", "model=some/llm", "gradient_checkpointing=true", "checkpoint_layers=selective",
      "attn_implementation=flash_attention_2"], "would recompute this kernel; use attn_implementation=sdpa"),
])
def test_memory_levers_that_cannot_apply_name_the_fix(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config(None, overrides)


def test_memory_levers_that_apply_validate():
    cfg = load_config(None, ["gradient_checkpointing=true", "checkpoint_layers=every-3", "offload_activations=true",
                             "optimizer_in_backward=true"])
    assert (cfg.checkpoint_layers, cfg.offload_activations, cfg.optimizer_in_backward) == ("every-3", True, True)


def test_the_resolved_config_loads_back_as_the_same_config(tmp_path):
    """finetune_config.yaml is a recipe: its nulls (text_pair_column, max_eval_samples, ...) load as None, and it holds
    the run's keys and its task's own only."""
    cfg = load_config(None, ["learning_rate=1e-4", "max_train_samples=64"])
    path = save_resolved(cfg, tmp_path)
    assert "text_pair_column: null" in path.read_text() and "image_size" not in path.read_text()
    assert load_config(path, []) == cfg


@pytest.mark.parametrize("extra, owner", [("{learning_rate: 3e-5}", "learning_rate"), ("{eval_on_start: true}", "evaluate_before"),
                                          ("{gradient_accumulation_steps: 4}", "global_batch_size"), ("{bf16: true}", "precision")])
def test_extra_cannot_override_what_the_config_sets(extra, owner):
    """extra goes to TrainingArguments last: a key the run derives from its own config would silently win over what the
    run printed and recorded (learning_rate=1e-4 said, 3e-5 trained; eval_on_start evaluating twice)."""
    from hf_gpu_train.finetune.run import OWNED_BY_CONFIG, check_extra_arguments

    cfg = load_config(None, [f"extra={extra}"])
    with pytest.raises(ConfigError, match=f"set {owner}= instead"):
        check_extra_arguments(cfg)
    check_extra_arguments(load_config(None, ["extra={max_grad_norm: 0.5, optim: adafactor, warmup_steps: 100}"]))  # no config key
    from dataclasses import fields

    from hf_gpu_train.finetune.config import FinetuneConfig

    assert set(OWNED_BY_CONFIG.values()) <= {f.name for f in fields(FinetuneConfig)}
