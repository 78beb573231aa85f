"""Vision models start pretrained: hub by default, a local file, or the shipped EfficientNet-Lite0; from scratch only
when asked, at a learning rate suited to it. And every cheap check runs before any pass over the data."""

import json
from types import SimpleNamespace

import pytest
import timm
import torch
import yaml
from safetensors.torch import save_file

from hf_gpu_train.finetune import data as data_module
from hf_gpu_train.finetune.config import ConfigError
from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.run import main, prepared_for
from hf_gpu_train.finetune.tasks.image_classification.model import load_vision_model
from hf_gpu_train.finetune.tasks.image_classification.pretrained import SCRATCH_LEARNING_RATE, resolve_vision_weights

VISION = ["task=image-classification", "dataset=builtin:digits"]


def vision_model(cfg, labels):
    return load_vision_model(cfg.model, cfg.options, labels)


def weights_for(cfg):
    return resolve_vision_weights(cfg.model, cfg.options)
CPU = SimpleNamespace(on_cuda=False)


@pytest.fixture
def offline(monkeypatch):
    """The hub as an offline user meets it, without the minute of connection retries: huggingface_hub's offline mode."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def weights_file(tmp_path, name="test_resnet", seed=0):
    torch.manual_seed(seed)
    model = timm.create_model(name)
    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model, path


def test_pretrained_is_the_default_and_offline_the_error_names_both_fixes(offline):
    cfg = load_config(None, [*VISION, "model=timm/test_resnet"])
    assert cfg.pretrained is True
    with pytest.raises(ConfigError, match=r"model='timm/test_resnet' with pretrained=true: .*hub.*"
                                          r"pretrained_weights=/path/to/test_resnet\.safetensors.*pretrained=false"):
        load_vision_model(cfg.model, cfg.options, ["a", "b"])


def test_pretrained_weights_file_gives_the_backbone_and_a_new_head(tmp_path):
    source, path = weights_file(tmp_path)
    model = vision_model(load_config(None, [*VISION, "model=timm/test_resnet", f"pretrained_weights={path}"]), ["a", "b", "c"])
    assert torch.equal(model.model.conv1[0].weight, source.conv1[0].weight)
    assert model.model.fc.out_features == 3


@pytest.mark.parametrize("suffix", ["safetensors", "pth"])
def test_a_fine_tuned_checkpoint_of_the_same_classes_keeps_its_head(tmp_path, suffix):
    """timm drops a file's classifier when its class count differs from the ImageNet default, even when it is this
    run's: a warm start from our own 3-class fine-tune would begin with a random head."""
    torch.manual_seed(1)
    source = timm.create_model("test_resnet", num_classes=3)
    path = tmp_path / f"mine.{suffix}"
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    save_file(state, str(path)) if suffix == "safetensors" else torch.save(state, path)
    model = vision_model(load_config(None, [*VISION, "model=timm/test_resnet", f"pretrained_weights={path}"]), ["a", "b", "c"])
    assert torch.equal(model.model.fc.weight, source.fc.weight) and torch.equal(model.model.fc.bias, source.fc.bias)
    assert torch.equal(model.model.conv1[0].weight, source.conv1[0].weight)


def test_weights_of_another_architecture_are_a_config_error(tmp_path):
    _, path = weights_file(tmp_path, "test_efficientnet")
    cfg = load_config(None, [*VISION, "model=timm/test_resnet", f"pretrained_weights={path}"])
    with pytest.raises(ConfigError, match=r"test_efficientnet\.safetensors' cannot be loaded into timm model test_resnet"):
        load_vision_model(cfg.model, cfg.options, ["a", "b"])


def test_from_scratch_only_when_asked_and_at_its_own_learning_rate(monkeypatch):
    cfg = load_config(None, [*VISION, "model=timm/test_resnet", "pretrained=false"])
    assert cfg.learning_rate == SCRATCH_LEARNING_RATE == 1e-3
    assert "from scratch (pretrained=false) at learning_rate=0.001 (the from-scratch default" in resolve_vision_weights(cfg.model, cfg.options).describe(
        cfg.learning_rate)
    assert load_config(None, [*VISION, "model=timm/test_resnet", "pretrained=false", "learning_rate=5e-5"]).learning_rate == 5e-5
    assert load_config(None, [*VISION, "model=timm/test_resnet"]).learning_rate is None  # pretrained: by the model
    assert load_config(None, []).learning_rate is None

    def no_downloads(*args, **kwargs):
        raise AssertionError("pretrained=false fetched weights")

    monkeypatch.setattr(timm.models._builder, "load_pretrained", no_downloads)
    assert load_vision_model(cfg.model, cfg.options, ["a", "b"]).model.fc.out_features == 2


@pytest.mark.parametrize("overrides, pattern", [
    (["model=timm/cspresnet50d"], r"has no pretrained weights in timm .*pretrained_weights=.*pretrained=false"),
    (["model=timm/resnet18.no_such_tag"], r"model='timm/resnet18.no_such_tag': Invalid pretrained tag"),
    (["model=timm/resnet18_typo"], r"model='timm/resnet18_typo' is not a timm model; similar: \['resnet18"),
    (["model=builtin:efficientnet_lite0", "pretrained_weights=/etc/hostname"], r"brings its own weights"),
])
def test_what_the_weights_would_be_is_checked_without_loading_anything(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        weights_for(load_config(None, [*VISION, *overrides]))


@pytest.mark.parametrize("overrides, pattern", [
    (["pretrained_weights=/no/such/weights.safetensors"], r"pretrained_weights='/no/such/weights.safetensors' does not exist"),
    (["pretrained_weights=/etc/hostname", "pretrained=false"], r"with pretrained=false: drop"),
])
def test_weights_settings_are_checked_with_the_config(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [*VISION, "model=timm/test_resnet", *overrides])
    with pytest.raises(ConfigError, match=r"pretrained \(task=image-classification\): not a key of task=text-classification"):
        load_config(None, ["pretrained=false"])


@pytest.fixture
def processing_spy(monkeypatch):
    """Counts the passes over the data: Dataset.map (label encoding, tokenizing) and opening every image."""
    import datasets

    calls = {"map": 0, "verify_images": 0}
    real_map, real_verify = datasets.Dataset.map, data_module.verify_images

    def counting_map(self, *args, **kwargs):
        calls["map"] += 1
        return real_map(self, *args, **kwargs)

    def counting_verify(*args, **kwargs):
        calls["verify_images"] += 1
        return real_verify(*args, **kwargs)

    monkeypatch.setattr(datasets.Dataset, "map", counting_map)
    monkeypatch.setattr(data_module, "verify_images", counting_verify)
    return calls


def string_labelled_images(tmp_path):
    """A parquet file of images with string labels: label encoding is a .map, and every image gets opened."""
    from datasets import Dataset, Features, Image, Value
    from PIL import Image as PILImage

    images = [PILImage.new("RGB", (8, 8), (i * 20, 0, 0)) for i in range(12)]
    path = tmp_path / "images.parquet"
    features = Features({"image": Image(), "label": Value("string")})
    Dataset.from_dict({"image": images, "label": ["cat", "dog"] * 6}, features=features).to_parquet(str(path))
    return path


@pytest.mark.parametrize("task_args", [
    ["model=/no/such/model"],  # text: a missing model directory
    ["model=EMPTY_DIR"],  # text: a directory that holds no model
    ["task=image-classification", "model=timm/resnet18_typo", "dataset=none", "train_file=IMAGES"],  # vision: a timm name typo
    ["task=image-classification", "model=timm/test_resnet", "dataset=none", "train_file=IMAGES"],  # vision: offline, no weights
], ids=["text-missing-dir", "text-empty-dir", "vision-typo", "vision-offline"])
def test_model_mistakes_fail_before_any_pass_over_the_data(tmp_path, offline, processing_spy, task_args):
    (tmp_path / "empty").mkdir()
    dataset = tmp_path / "data.csv"
    dataset.write_text("text,label\n" + "".join(f"sample {i},{'pos' if i % 2 else 'neg'}\n" for i in range(40)))
    args = [a.replace("EMPTY_DIR", str(tmp_path / "empty")) for a in task_args]
    if "task=image-classification" in args:
        args = [a.replace("IMAGES", str(string_labelled_images(tmp_path))) for a in args]
    else:
        args += ["dataset=none", f"train_file={dataset}"]
    with pytest.raises(ConfigError):
        prepared_for(load_config(None, args), CPU)
    assert processing_spy == {"map": 0, "verify_images": 0}


def test_a_small_run_fine_tunes_the_shipped_efficientnet_lite0(tmp_path, capsys):
    out = tmp_path / "lite0"
    assert main(["task=image-classification", "model=builtin:efficientnet_lite0", "dataset=builtin:digits", "image_size=32",
                 "max_train_samples=64", "max_eval_samples=32", "per_device_train_batch_size=32", "num_train_epochs=1",
                 "telemetry=false", "save_strategy=no", f"output_dir={out}"]) == 0
    first, second = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hf_gpu_train:")][:2]
    assert "fine-tuning tf_efficientnet_lite0 from its ImageNet weights" in first and "learning_rate=0.001" in first
    assert "learning_rate=0.001: the default for vision models normalised by BatchNorm only" in second
    assert yaml.safe_load((out / "finetune_config.yaml").read_text())["learning_rate"] == 1e-3
    assert json.loads((out / "label_map.json").read_text()) == [str(i) for i in range(10)]
