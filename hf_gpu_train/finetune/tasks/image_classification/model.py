"""Image classification with timm: the model (starting weights from ``pretrained``, classifier reset to the
dataset's classes), timm's data config and transforms, and a Trainer-friendly wrapper that returns the loss."""

from __future__ import annotations

import torch
from torch import nn

from ...config import ConfigError
from ...data import ClassificationData
from .options import ImageClassificationOptions
from .pretrained import VisionWeights, create_timm_model, resolve_vision_weights


class TimmClassifier(nn.Module):
    """``forward(pixel_values, labels)`` -> {"loss", "logits"}, as the Trainer expects."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.supports_gradient_checkpointing = hasattr(model, "set_grad_checkpointing")

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.model(pixel_values)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        if not self.supports_gradient_checkpointing:
            raise ConfigError(f"gradient_checkpointing=true: timm model {type(self.model).__name__} does not support it")
        self.model.set_grad_checkpointing(True)

    def gradient_checkpointing_disable(self):
        if self.supports_gradient_checkpointing:
            self.model.set_grad_checkpointing(False)


def load_vision_model(model: str, options: ImageClassificationOptions, label_names: list[str],
                      weights: VisionWeights | None = None) -> TimmClassifier:
    """The timm model with its starting weights (see ``pretrained``) and a classifier for ``label_names``."""
    weights = weights or resolve_vision_weights(model, options)
    return TimmClassifier(create_timm_model(model, options, weights, len(label_names)))


def attach_transforms(options: ImageClassificationOptions, data: ClassificationData, model: TimmClassifier):
    """timm's data config (mean, std, interpolation) at the image size; train-time augmentation."""
    import timm.data

    config = timm.data.resolve_data_config({"input_size": (3, options.image_size, options.image_size)}, model=model.model)
    augmentation = dict(options.augmentation)
    if "scale" in augmentation:
        augmentation["scale"] = tuple(augmentation["scale"])
    try:
        train_tf = timm.data.create_transform(**config, is_training=True, **augmentation)
    except TypeError as error:
        raise ConfigError(f"augmentation={options.augmentation!r}: {error} (keys of timm.data.create_transform)") from None
    eval_tf = timm.data.create_transform(**config, is_training=False)
    column = options.image_column

    def make(transform):
        def apply(batch):
            return {"pixel_values": [transform(img.convert("RGB")) for img in batch[column]], "labels": batch["labels"]}

        return apply

    train = data.train.with_transform(make(train_tf))
    validation = data.validation.with_transform(make(eval_tf))
    return train, validation


def image_collator(on_cuda: bool):
    def collate(items):
        pixels = torch.stack([item["pixel_values"] for item in items])
        if on_cuda:
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        return {"pixel_values": pixels, "labels": torch.tensor([item["labels"] for item in items])}

    return collate
