"""``task=image-classification``: a timm model (starting weights from ``pretrained``, classifier reset to the labels),
images opened once to check them, transformed per batch. ``task.py`` (the task), ``options.py`` (its keys),
``model.py`` (the timm model and its transforms), ``pretrained.py`` (which starting weights), ``efficientnet_lite.py``
(the shipped EfficientNet-Lite0 weights in timm's layout)."""

from .task import ImageClassification

__all__ = ["ImageClassification"]
