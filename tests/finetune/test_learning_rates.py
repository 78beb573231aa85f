"""The default learning rate follows the model's family: BatchNorm conv nets far above layer-normalised ones, text
encoders scaled by width; what a user sets is never replaced."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import timm
import torch

from hf_gpu_train.finetune.learning_rates import (
    BATCHNORM_LEARNING_RATE,
    FINETUNE_LEARNING_RATE,
    normalised_by_batchnorm,
    resolve_learning_rate,
    text_learning_rate,
    vision_learning_rate,
)
from hf_gpu_train.finetune.loading import load_config

VISION = ["task=image-classification", "dataset=builtin:digits"]


def timm_on_meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):  # the family is read from the modules; no weights are needed
        return timm.create_model(name)


@pytest.mark.parametrize("name, batchnorm", [
    ("test_resnet", True), ("test_efficientnet", True), ("tf_efficientnet_lite0", True), ("mobilenetv3_small_100", True),
    ("test_vit", False), ("test_convnext", False), ("test_efficientnet_ln", False), ("test_efficientnet_gn", False),
    ("maxvit_tiny_tf_224", False),  # BatchNorm in its conv blocks, LayerNorm in its attention: the careful rate
])
def test_the_vision_family_is_read_from_the_normalisation_layers(name, batchnorm):
    model = timm_on_meta(name)
    assert normalised_by_batchnorm(model) is batchnorm
    assert vision_learning_rate(model)[0] == (BATCHNORM_LEARNING_RATE if batchnorm else FINETUNE_LEARNING_RATE)


@pytest.mark.parametrize("name, named", [("levit_128s", "BatchNorm only"), ("resnetv2_50x1_bit", "group normalisation"),
                                         ("test_vit", "layer or group normalisation (LayerNorm")])
def test_the_reason_names_what_normalises_the_model_not_a_family_it_is_not(name, named):
    """LeViT is an attention model normalised by BatchNorm only, BiT a conv net normalised by GroupNorm: the line says
    what was found, not "convolutional nets" or "layer-normalised models (ViT)"."""
    reason = vision_learning_rate(timm_on_meta(name))[1]
    assert named in reason and "convolutional nets" not in reason


def test_a_model_without_normalisation_gets_the_careful_rate_and_says_why():
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert not normalised_by_batchnorm(plain)
    assert vision_learning_rate(plain) == (FINETUNE_LEARNING_RATE, vision_learning_rate(plain)[1])
    assert "no normalisation layer" in vision_learning_rate(plain)[1]
    with_rms = torch.nn.Sequential(torch.nn.BatchNorm2d(4), torch.nn.RMSNorm(4))
    assert not normalised_by_batchnorm(with_rms)  # an RMSNorm is a layer norm


def test_a_composite_config_is_scaled_by_its_text_models_width():
    composite = SimpleNamespace(text_config=SimpleNamespace(hidden_size=384), vision_config=SimpleNamespace(hidden_size=1152))
    assert text_learning_rate(SimpleNamespace(config=composite))[0] == pytest.approx(1e-4)
    encoder_decoder = SimpleNamespace(encoder=SimpleNamespace(d_model=1536))
    assert text_learning_rate(SimpleNamespace(config=encoder_decoder))[0] == pytest.approx(2.5e-5)


@pytest.mark.parametrize("config, rate", [
    (SimpleNamespace(hidden_size=768), 5e-5),  # BERT-base: the reference
    (SimpleNamespace(hidden_size=384), 1e-4),  # MiniLM-L6
    (SimpleNamespace(hidden_size=1024), 3.75e-5),  # BERT-large
    (SimpleNamespace(hidden_size=128), 3e-4),  # BERT-tiny: 3e-4 by the rule, the top of the range
    (SimpleNamespace(hidden_size=64), 3e-4),  # clamped
    (SimpleNamespace(hidden_size=8192), 1e-5),  # clamped
    (SimpleNamespace(dim=384), 1e-4),  # DistilBERT's name for it
    (SimpleNamespace(d_model=1536), 2.5e-5),
    (SimpleNamespace(), FINETUNE_LEARNING_RATE),  # no width named: the reference rate
])
def test_a_text_encoder_gets_the_reference_rate_scaled_by_its_width(config, rate):
    assert text_learning_rate(SimpleNamespace(config=config))[0] == pytest.approx(rate)


def test_the_shipped_minilm_resolves_to_its_width_rate():
    from transformers import AutoConfig

    from hf_gpu_train.builtin_models import minilm_path

    assert AutoConfig.from_pretrained(minilm_path()).hidden_size == 384
    rate, line = resolve_learning_rate(load_config().learning_rate, SimpleNamespace(config=AutoConfig.from_pretrained(minilm_path())),
                                       text_learning_rate)
    assert rate == pytest.approx(1e-4) and "width 384" in line


def test_what_the_user_set_is_kept_and_said_nothing_about():
    cfg = load_config(None, [*VISION, "learning_rate=3e-5"])
    assert resolve_learning_rate(cfg.learning_rate, timm_on_meta("test_resnet"), vision_learning_rate) == (3e-5, None)
    scratch = load_config(None, [*VISION, "model=timm/test_resnet", "pretrained=false"])
    assert resolve_learning_rate(scratch.learning_rate, timm_on_meta("test_vit"), vision_learning_rate) == (1e-3, None)
    pretrained = load_config(None, [*VISION, "model=timm/test_vit"])
    rate, line = resolve_learning_rate(pretrained.learning_rate, timm_on_meta("test_vit"), vision_learning_rate)
    assert "layer or group normalisation" in line and rate == FINETUNE_LEARNING_RATE
