"""``task=causal-lm``'s own keys: the adapters, the data's columns and what the loss covers, packing and the chunked
head, the attention kernel, and the generation samples."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...config import ConfigError, TaskOptions


@dataclass
class CausalLMOptions(TaskOptions):
    max_length: int = 128
    text_column: str = "text"  # plain text data
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0  # peft's default; 0 skips the dropout copy of every adapted layer's input
    lora_target_modules: str = "all-linear"  # every linear layer but the output head, or names: q_proj,v_proj
    merge_adapter: bool = False  # also save the base model with the adapter merged in, in output_dir/merged
    messages_column: str = "messages"  # chat data: a list of {role, content}, rendered with the tokenizer's chat template
    prompt_column: str = "prompt"  # prompt + completion data
    completion_column: str = "completion"
    completion_only_loss: bool = True  # loss on the completion / assistant turns only; false: on every token
    chat_template: str | None = None  # a Jinja file replacing (or supplying) the tokenizer's chat template
    packing: bool | str = "auto"  # auto: padding-free packing where the model's attention keeps examples apart
    chunked_lm_loss: bool | str = "auto"  # auto: the LM head and loss in chunks of labelled rows where exact (lm_head_loss.py);
    # liger | cce: Liger's or Cut Cross-Entropy's fused kernel instead, on CUDA, when installed
    attn_implementation: str | None = None  # None: transformers' default (sdpa); eager, flash_attention_2, ...
    generation_samples: int = 3  # held-out prompts generated before and after training (0: none)
    generation_max_new_tokens: int = 64

    def check(self) -> None:
        def bad(key: str, fix: str) -> ConfigError:
            return ConfigError(f"{key}={getattr(self, key)!r}: {fix}")

        if self.max_length < 1:
            raise bad("max_length", "must be at least 1")
        if self.lora_r < 1:
            raise bad("lora_r", "must be at least 1 (16 is a good start)")
        if self.lora_alpha <= 0:
            raise bad("lora_alpha", "must be positive (commonly 2 x lora_r)")
        if not 0 <= self.lora_dropout < 1:
            raise bad("lora_dropout", "must be in [0, 1)")
        if not self.lora_target_modules.strip():
            raise bad("lora_target_modules", "use all-linear or comma-separated module names such as q_proj,v_proj")
        if self.packing not in (True, False, "auto"):
            raise bad("packing", "use auto, true or false")
        if self.chunked_lm_loss not in (True, False, "auto", "liger", "cce"):
            raise bad("chunked_lm_loss", "use auto, true or false (or, on CUDA, liger or cce: their fused kernels)")
        if self.generation_samples < 0:
            raise bad("generation_samples", "must be >= 0 (0: no samples)")
        if self.generation_max_new_tokens < 1:
            raise bad("generation_max_new_tokens", "must be at least 1")
        if self.chat_template is not None and not Path(self.chat_template).expanduser().is_file():
            raise bad("chat_template", "give the path of a Jinja chat template file that exists")
