"""``method=``: ``full`` (every weight trains), ``lora`` (peft adapters on a frozen base), ``qlora`` (adapters on a
base quantized to 4-bit NF4 by bitsandbytes, CUDA only).

LoRA targets every linear layer but the output head by default (peft's ``"all-linear"``): adapting the attention
projections alone learns less per step (QLoRA paper, Dettmers et al. 2023, section 4). QLoRA is the paper's recipe:
NF4 with double quantization, compute in bf16 (fp16 on GPUs without bf16), and
``peft.prepare_model_for_kbit_training`` (norms in fp32, input gradients on for checkpointing).

What can fail is checked before the model loads: peft or bitsandbytes missing, QLoRA without CUDA.
"""

from __future__ import annotations

import importlib.util

from ...config import ConfigError
from .model import compute_dtype
from .options import CausalLMOptions

INSTALL_LLM = "pip install -e '.[llm]'  (or: pip install peft bitsandbytes)"


def check_method(method: str, runtime) -> None:
    if method == "full":
        return
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"method={method} needs the peft package: {INSTALL_LLM}")
    if method != "qlora":
        return
    if not runtime.on_cuda:
        raise ConfigError("method=qlora needs an NVIDIA GPU with CUDA (bitsandbytes' 4-bit kernels run there), and this run "
                          "has none: use method=lora on this machine, or run on a CUDA machine (hf-gpu-train doctor checks it)")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"method=qlora quantizes the base model with bitsandbytes, which is not installed: {INSTALL_LLM}")


def quantization_config(method: str, runtime):
    """bitsandbytes' 4-bit NF4 config for QLoRA, else None."""
    if method != "qlora":
        return None
    from transformers import BitsAndBytesConfig


    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype(runtime))


def target_modules(spec: str):
    names = [name.strip() for name in spec.split(",") if name.strip()]
    return "all-linear" if names == ["all-linear"] else names


def apply_method(model, options: CausalLMOptions, method: str, gradient_checkpointing: bool):
    """The model to train: itself for ``full``, a PeftModel with fresh adapters for ``lora``/``qlora``."""
    if method == "full":
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if method == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.enable_input_require_grads()  # a frozen embedding gives checkpointed layers no input that needs gradients
    config = LoraConfig(r=options.lora_r, lora_alpha=options.lora_alpha, lora_dropout=options.lora_dropout,
                        target_modules=target_modules(options.lora_target_modules), task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # target modules not found in the model
        raise ConfigError(f"lora_target_modules={options.lora_target_modules!r}: {str(error).splitlines()[0]}") from None


def trainable_summary(model) -> str:
    # ds_numel: under DeepSpeed ZeRO-3 each process holds a partition (numel() is 0), the parameter is this large
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    return f"{_count(trainable)} of {_count(total)} parameters train ({trainable / max(1, total):.2%})"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,}"
