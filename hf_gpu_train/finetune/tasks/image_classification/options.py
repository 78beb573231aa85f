"""``task=image-classification``'s own keys: the starting weights, which columns hold the image and the label, the
image's side and the training augmentation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...config import ConfigError, TaskOptions


@dataclass
class ImageClassificationOptions(TaskOptions):
    pretrained: bool = True  # start from pretrained weights (hub, pretrained_weights or builtin); false: from scratch
    pretrained_weights: str | None = None  # a local .safetensors/.pth file with the timm model's pretrained weights
    image_column: str = "image"
    label_column: str = "label"
    image_size: int = 224
    augmentation: dict[str, Any] = field(default_factory=dict)  # timm create_transform kwargs for training

    def check(self) -> None:
        if self.image_size < 1:
            raise ConfigError(f"image_size={self.image_size!r}: must be at least 1")
        if self.pretrained_weights is None:
            return
        if not self.pretrained:
            raise ConfigError(f"pretrained_weights={self.pretrained_weights!r} with pretrained=false: drop pretrained=false to "
                              "fine-tune from that file, or drop pretrained_weights to train from scratch")
        if not Path(self.pretrained_weights).expanduser().is_file():
            raise ConfigError(f"pretrained_weights={self.pretrained_weights!r} does not exist: give the path of a .safetensors "
                              "or .pth file, or pretrained=false to train from scratch")
