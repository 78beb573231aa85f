"""``task=image-classification``: a timm model (starting weights from ``pretrained``, classifier reset to the labels),
images opened once to check them, transformed per batch (``finetune/vision.py``)."""

from __future__ import annotations

from .base import Prepared, register_task
from .classification import ClassificationTask


@register_task
class ImageClassification(ClassificationTask):
    name = "image-classification"
    images = True
    throughput_unit = "samples/s"

    def learning_rate(self, model):
        from ..learning_rates import (
            vision_learning_rate,  # lazy: the config reads this registry, and the finetune modules import the config
        )

        return vision_learning_rate(model)

    def data_columns(self, cfg) -> dict[str, str]:
        return {cfg.label_column: "label_column", cfg.image_column: "image_column"}

    def check_rows(self, dataset, cfg, split: str) -> None:
        from ..data import verify_images  # lazy: looked up when called, so a replacement (a test's) is seen

        verify_images(dataset, cfg.image_column, split)

    def prepare(self, cfg, runtime, say) -> Prepared:
        from ..data import (
            open_classification_data,  # lazy: the config reads this registry, and the finetune modules import the config
        )
        from ..learning_rates import (
            resolve_learning_rate,  # lazy: the config reads this registry, and the finetune modules import the config
        )
        from ..pretrained import (
            resolve_vision_weights,  # lazy: the config reads this registry, and the finetune modules import the config
        )
        from ..vision import (  # lazy: the config reads this registry, and the finetune modules import the config
            attach_transforms,
            image_collator,
            load_vision_model,
        )

        weights = resolve_vision_weights(cfg)
        opened = open_classification_data(cfg)
        model = load_vision_model(cfg, opened.label_names, weights)
        chosen = resolve_learning_rate(cfg, model)
        say([weights.describe(cfg.learning_rate), *([chosen] if chosen else [])])  # which weights, at which learning rate
        _, data = self.open_and_process(cfg, opened, (None,), say)
        if runtime.on_cuda:
            import torch

            model = model.to(memory_format=torch.channels_last)
        train, validation = attach_transforms(cfg, data, model)
        return Prepared(model, train, validation, image_collator(runtime.on_cuda), None, data)
