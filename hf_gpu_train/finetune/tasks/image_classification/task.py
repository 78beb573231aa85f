"""``task=image-classification``: a timm model (starting weights from ``pretrained``, classifier reset to the labels),
images opened once to check them, transformed per batch (``model.py``)."""

from __future__ import annotations

from ... import data as classification_data
from ...learning_rates import resolve_learning_rate, vision_learning_rate
from ..base import PlannerInput, Prepared, register_task
from ..classification import ClassificationTask
from .options import ImageClassificationOptions
from .pretrained import SCRATCH_LEARNING_RATE, resolve_vision_weights


@register_task
class ImageClassification(ClassificationTask):
    name = "image-classification"
    options = ImageClassificationOptions
    layered = False  # timm models checkpoint every block
    throughput_unit = "samples/s"

    def default_learning_rate(self, cfg) -> float | None:
        # from random weights the steps must be far larger than a pretrained model's (SCRATCH_LEARNING_RATE); a
        # pretrained model's rate waits for the model (learning_rates.vision_learning_rate)
        return None if cfg.pretrained else SCRATCH_LEARNING_RATE

    def learning_rate(self, model):
        return vision_learning_rate(model)

    def planner_input(self, cfg) -> PlannerInput:
        return PlannerInput(seq_len=None, image_size=cfg.image_size, method="full")

    def groups_by_length(self, packed: bool) -> bool:
        return False  # every image is image_size square

    def data_columns(self, cfg) -> dict[str, str]:
        return {cfg.label_column: "label_column", cfg.image_column: "image_column"}

    def check_rows(self, dataset, cfg, split: str) -> None:
        classification_data.verify_images(dataset, cfg.image_column, split)  # looked up when called: a test replaces it

    def prepare(self, cfg, runtime, say) -> Prepared:
        from .model import attach_transforms, image_collator, load_vision_model  # lazy: torch and timm

        weights = resolve_vision_weights(cfg.model, cfg.options)
        opened = self.open(cfg)
        model = load_vision_model(cfg.model, cfg.options, opened.label_names, weights)
        cfg.learning_rate, chosen = resolve_learning_rate(cfg.learning_rate, model, self.learning_rate)
        say([weights.describe(cfg.learning_rate), *([chosen] if chosen else [])])  # which weights, at which learning rate
        _, data = self.open_and_process(cfg, opened, (None,), say)
        if runtime.on_cuda:
            import torch  # lazy: torch

            model = model.to(memory_format=torch.channels_last)
        train, validation = attach_transforms(cfg.options, data, model)
        return Prepared(model, train, validation, image_collator(runtime.on_cuda), None, data)
