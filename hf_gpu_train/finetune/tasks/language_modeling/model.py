"""Which causal LM, and how it is loaded: path, tokenizer (chat template, padding token), dtype and attention.

Weights are loaded in the dtype that trains them: full fine-tuning keeps fp32 master weights (mixed precision
computes in bf16/fp16 and updates in fp32); LoRA freezes the base, so it is loaded in the compute dtype (half the
memory of fp32, and no cast per step), while peft keeps the adapters in fp32; QLoRA loads it in 4 bits
(``methods.quantization_config``), on this process's GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...config import ConfigError
from ..model_dirs import check_text_model, resolve_model_path
from . import smollm2
from .options import CausalLMOptions

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def check_model(model: str) -> None:
    """The cheap check, before the data is read: the builtin is installed, a local directory holds a model."""
    if model == smollm2.BUILTIN_NAME:
        smollm2.check_available()
        return

    check_text_model(model)  # a local path must exist and hold config.json; a hub id is checked when it loads


def model_path(model: str, say=print) -> str:
    """The directory or hub id to load; the builtin is converted on first use."""
    if model == smollm2.BUILTIN_NAME:
        return str(smollm2.ensure_converted(say))

    return resolve_model_path(model)


def load_tokenizer(model: str, options: CausalLMOptions, path: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as error:
        raise ConfigError(f"model={model!r}: cannot load its tokenizer ({str(error).splitlines()[0]})") from None
    if options.chat_template:
        tokenizer.chat_template = Path(options.chat_template).expanduser().read_text()
    if tokenizer.eos_token is None:
        raise ConfigError(f"model={model!r}: its tokenizer has no end-of-sequence token, so a trained model could not "
                          "learn to stop: use a model whose tokenizer defines eos_token")
    if tokenizer.pad_token_id is None:  # Llama 3 and others ship none; padding is masked out of attention and loss
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def compute_dtype(runtime):
    import torch

    return getattr(torch, DTYPES[runtime.precision])


def load_model(model: str, options: CausalLMOptions, method: str, path: str, runtime, quantization=None):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if options.attn_implementation:
        kwargs["attn_implementation"] = options.attn_implementation
    if quantization is not None:
        kwargs["quantization_config"] = quantization
        kwargs["device_map"] = {"": int(os.environ.get("LOCAL_RANK", "0"))}
        kwargs["dtype"] = compute_dtype(runtime)
    elif method == "lora":
        kwargs["dtype"] = compute_dtype(runtime)
    else:
        kwargs["dtype"] = torch.float32
    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as error:
        raise ConfigError(f"model={model!r}: cannot load ({str(error).splitlines()[0]})") from None
    except ValueError as error:  # an architecture without a causal-LM head, an unknown attn_implementation
        raise ConfigError(f"model={model!r}: {str(error).splitlines()[0]}") from None
