"""The learning rate of a classification run whose config sets none, chosen from the model it trains.

Why by model, not one number: the fine-tuning guides of timm, fastai and transformers give rates that differ by a factor
of twenty between families, and one default fits only one of them. Measured with this toolkit (``benchmarks/
learning_rates.py``): EfficientNet-Lite0 at 5e-5 (BERT's rate) barely moves its new head in three epochs, while at 1e-3
it learns both image sets; MiniLM-L6 (width 384) at 5e-5 is still far from what 1e-4 reaches in the same steps.

- **Images, models normalised by BatchNorm only** (ResNet, EfficientNet, MobileNet, RegNet; LeViT and FastViT too):
  ``BATCHNORM_LEARNING_RATE`` = 1e-3, Adam's own step size, the order of fastai's ``fine_tune`` (base_lr 2e-3) and
  what timm's recipes give AdamW on small batches. BatchNorm makes each layer's output indifferent to its weights'
  scale, so these nets take large steps without diverging.
- **Images, everything else** (ViT, DeiT, Swin, ConvNeXt, BiT, hybrids: any LayerNorm or GroupNorm; nets without
  normalisation): 5e-5, the rate of transformers' image-classification guide for ViT; layer-normalised transformers are
  sensitive to large steps, and a net with nothing to tell its family by gets the careful rate.

Warm-up is the same for every family, 10% of the steps (``warmup_ratio``): the ratio of transformers' ViT guide, below
fastai's one-cycle (25%) and above none at all (transformers' text-classification guide). benchmarks/learning_rates.py
measured the rates with it; a warm-up per family was not measured, so none is claimed.
- **Text encoders**: 5e-5 at BERT-base's width (768, Devlin et al. 2019), scaled as 1/width (Adam's update per weight
  is about the learning rate, so a layer's output moves with its fan-in: muP, Yang et al. 2022), within
  [1e-5, 3e-4], the range Google's BERT README searched for its small BERTs. MiniLM-L6 (384) gets 1e-4, BERT-large
  (1024) 3.75e-5.

Resolved once the model exists (the family is read from its modules), on every rank the same way, before the
resolved config is written: ``finetune_config.yaml`` holds the number, and the run prints why it was chosen.
Causal LMs and runs from scratch get theirs when the task resolves the config (``Task.resolve``): they do not depend on
the model.
"""

from __future__ import annotations

from collections import Counter

FINETUNE_LEARNING_RATE = 5e-5  # BERT-base and ViT fine-tuning: the reference the families are measured against
BATCHNORM_LEARNING_RATE = 1e-3
REFERENCE_WIDTH = 768  # BERT-base's hidden size, at which a text encoder gets FINETUNE_LEARNING_RATE
TEXT_RANGE = (1e-5, 3e-4)
WIDTH_KEYS = ("hidden_size", "d_model", "dim", "n_embd")  # what transformers' configs call the width


def _norm_layers(model) -> list:
    from torch import nn

    kinds = [nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm]
    if hasattr(nn, "RMSNorm"):
        kinds.append(nn.RMSNorm)
    return [m for m in model.modules() if isinstance(m, tuple(kinds)) or type(m).__name__.endswith(("RMSNorm", "LayerNorm"))]


def normalised_by_batchnorm(model) -> bool:
    """Every normalisation layer is a BatchNorm (timm's BatchNormAct2d included), and there is at least one."""
    from torch import nn

    norms = _norm_layers(model)
    return bool(norms) and all(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in norms)


def _norm_kinds(model) -> str:
    """The normalisation layers' class names, most frequent first (what the printed reason names)."""

    counts = Counter(type(m).__name__ for m in _norm_layers(model))
    return ", ".join(name for name, _ in counts.most_common(3))


def vision_learning_rate(model) -> tuple[float, str]:
    """By what normalises the model, the property the rate depends on (not by its name: LeViT and FastViT are attention
    models normalised by BatchNorm only, BiT a convolutional net normalised by GroupNorm)."""
    if normalised_by_batchnorm(model):
        return BATCHNORM_LEARNING_RATE, f"the default for vision models normalised by BatchNorm only ({_norm_kinds(model)})"
    if not _norm_layers(model):
        return FINETUNE_LEARNING_RATE, "the careful default: the model has no normalisation layer to tell its family by"
    return FINETUNE_LEARNING_RATE, (f"the default for vision models with layer or group normalisation ({_norm_kinds(model)}: "
                                    "ViT, ConvNeXt, BiT, hybrids)")


def model_width(config) -> int | None:
    """The hidden size, from the config or, for composite models, from its text model's or encoder's config."""
    for key in WIDTH_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    for part in ("text_config", "encoder", "decoder"):
        sub = getattr(config, part, None)
        if sub is not None and not isinstance(sub, (int, float, str, bool)) and sub is not config:
            width = model_width(sub)
            if width is not None:
                return width
    return None


def text_learning_rate(model) -> tuple[float, str]:
    width = model_width(getattr(model, "config", None))
    if width is None:
        return FINETUNE_LEARNING_RATE, "the text default (the model's config names no width to scale it by)"
    low, high = TEXT_RANGE
    rate = min(high, max(low, FINETUNE_LEARNING_RATE * REFERENCE_WIDTH / width))
    return rate, f"the default for a text encoder of width {width}: {FINETUNE_LEARNING_RATE:g} at {REFERENCE_WIDTH}, scaled as 1/width"


def resolve_learning_rate(learning_rate: float | None, model, rate_for) -> tuple[float, str | None]:
    """The learning rate to train at: ``learning_rate`` where the config set one (nothing said), else the model's
    (``rate_for(model)``: the task's choice, ``(rate, why)``) with the line saying why."""
    if learning_rate is not None:
        return learning_rate, None

    rate, why = rate_for(model)
    return rate, f"learning_rate={rate:g}: {why} (set learning_rate= to choose)"
