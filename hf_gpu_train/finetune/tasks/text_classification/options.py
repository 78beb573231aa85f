"""``task=text-classification``'s own keys: which columns hold the text and the label, and how long a row may be."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import ConfigError, TaskOptions


@dataclass
class TextClassificationOptions(TaskOptions):
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    max_length: int = 128

    def check(self) -> None:
        if self.max_length < 1:
            raise ConfigError(f"max_length={self.max_length!r}: must be at least 1")
