"""``task=token-classification``'s own keys: the columns of words and of their tags, and how long a row may be."""

from __future__ import annotations

from dataclasses import dataclass

from hf_gpu_train.finetune.config import ConfigError, TaskOptions


@dataclass
class TokenClassificationOptions(TaskOptions):
    tokens_column: str = "tokens"  # a list of words per row
    tags_column: str = "tags"  # a list of tags (strings), one per word
    max_length: int = 64

    def check(self) -> None:
        if self.max_length < 2:
            raise ConfigError(f"max_length={self.max_length!r}: must be at least 2 (a word and its start token)")
