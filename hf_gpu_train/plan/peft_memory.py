"""Memory of LoRA and QLoRA: a frozen base model, small trainable adapters.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", section 4): an adapted weight W
(d_out x d_in) gains B·A with A (r x d_in) and B (d_out x r): r·(d_in + d_out) trainable parameters per adapted
layer, and only they get gradients and optimizer states. Adapted layers: every linear layer but the output head
(peft's ``"all-linear"``, the finetune default), counted by ``model_spec``. What is held per GPU:

- the frozen base in the compute dtype, 2 bytes per parameter in bf16/fp16 (4 in fp32): the finetune loads a
  LoRA base in the compute dtype (``finetune.tasks.language_modeling.model.load_model``); no gradient, no optimizer state;
- the adapters in fp32 (peft upcasts adapters on a 16-bit base: ``autocast_adapter_dtype=True``), their fp32
  gradients and the optimizer's states on them (AdamW: 8 bytes per parameter); the fp32 adapters are their own
  master weights, so there is no separate master copy;
- autocast's 16-bit copy of every adapter (2 bytes per adapter parameter, cached for the step);
- DDP's gradient buckets for the adapters only (the base has no gradients).

QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", section 2, Double Quantization):
bitsandbytes stores each linear weight but the output head in 4-bit NF4, two per byte, with one absmax per block
of 64; double quantization stores those absmax in 8 bits with one fp32 constant per 256 of them, i.e.
4 + 8/64 + 32/(64·256) = 4.127 bits per parameter (4.5 without double quantization). Per-tensor codebooks
(256 fp32 values) are ignored. The rest (embeddings, output head, norms, biases) is cast to fp32 by
``peft.prepare_model_for_kbit_training`` (which the finetune calls for QLoRA). Transient buffers: the
dequantized weight of the largest linear layer in the compute dtype (bitsandbytes dequantizes then calls
``F.linear`` at training batch sizes, and again in ``MatMul4Bit.backward``), and autocast's 16-bit copy of the
fp32 output head, kept for the backward. bitsandbytes' 4-bit kernels need CUDA. A paged optimizer
(``paged_adamw_*``) pages its states to the host only under pressure: counted here as if resident.

LoRA under DeepSpeed ZeRO (a base too large to copy to every GPU; PEFT's documented LoRA + ZeRO-3): ZeRO partitions
only what it trains and holds, so the adapters' gradients and optimizer states are split over the N processes (ZeRO-2
and ZeRO-3 alike), with no DDP buckets; ZeRO-2 keeps the whole frozen base on every GPU, ZeRO-3 partitions it too
(1/N per GPU) and gathers one module at a time in forward and backward (the largest: an LLM's embedding or head, or
two decoder layers), as for full fine-tuning (memory.py), without a gradient for the frozen base. The optimizer offloaded to the CPU (``-offload``) holds no state on the GPU;
ZeRO-3's offload moves the base's partitions there too.
"""

from __future__ import annotations

from .activations import activation_bytes
from .model_spec import ModelSpec, adapter_shape, largest_linear, largest_parameter, quantized_params
from .strategies import DEEPSPEED, EVERYTHING, STRATEGIES, strategy_names
from .training_shape import TrainingShape

NF4_BYTES_PER_PARAM = 0.5  # two 4-bit codes per byte
BLOCKSIZE = 64  # first-level quantization block (QLoRA section 2; bitsandbytes' default for NF4)
DOUBLE_QUANT_BLOCKSIZE = 256  # blocks of first-level absmax per fp32 second-level constant (QLoRA section 2)
QLORA_BYTES_PER_PARAM = NF4_BYTES_PER_PARAM + 1 / BLOCKSIZE + 4 / (BLOCKSIZE * DOUBLE_QUANT_BLOCKSIZE)  # 4.127 bits
ADAPTER_DTYPE_BYTES = 4  # fp32 adapters, fp32 gradients


def adapter_params(spec: ModelSpec, rank: int) -> int:
    """r·(d_in + d_out) summed over the adapted linear layers (LoRA paper, section 4.1)."""
    found = adapter_shape(spec)
    if found is None:
        raise ValueError(f"{spec.name}: LoRA needs the model's linear layers (give --model, a config to read); "
                         "a parameter count alone is not enough")
    _, d_in, d_out = found
    return rank * (d_in + d_out)


def qlora_parts(spec: ModelSpec) -> tuple[int, int]:
    """(parameters stored in 4 bits, parameters kept in fp32)."""
    quantized = quantized_params(spec)
    if quantized is None:
        raise ValueError(f"{spec.name}: QLoRA needs the model's linear layers (give --model, a config to read)")
    return quantized, spec.params - quantized


def estimate_peft(spec: ModelSpec, shape: TrainingShape, strategy: str, optimizer_bytes_per_param: float) -> dict:
    """The MemoryBreakdown fields (bytes per GPU) of LoRA or QLoRA under ``strategy`` (single or ddp; LoRA also under
    DeepSpeed ZeRO)."""
    row = STRATEGIES.get(strategy)
    if row is not None and row.family == DEEPSPEED and shape.method in row.adapters:
        return _lora_under_zero(spec, shape, strategy, optimizer_bytes_per_param)
    if row is None or not row.replicated:
        whole_base = " or ".join(strategy_names(lambda s: s.replicated))
        raise ValueError(f"{shape.method} is planned with {whole_base} (a whole frozen base per GPU)"
                         + (" or, LoRA, under DeepSpeed ZeRO" if shape.method == "lora" else "") + f", not {strategy!r}")
    A = float(adapter_params(spec, shape.lora_rank))
    c = shape.compute_bytes
    autocast_copies = 2.0 * A if c == 2 else 0.0
    if shape.method == "lora":
        weights, quantized, transient = c * float(spec.params), 0.0, 0.0
    else:
        packed, kept = qlora_parts(spec)
        weights, quantized = 4.0 * kept, QLORA_BYTES_PER_PARAM * packed
        transient = c * float(largest_linear(spec) or 0)
        if spec.causal_lm and spec.vocab_size and spec.hidden_size and c == 2:
            transient += c * float(spec.vocab_size * spec.hidden_size)  # the fp32 output head's autocast copy
    return dict(weights=weights, quantized_weights=quantized, adapter_weights=ADAPTER_DTYPE_BYTES * A,
                gradients=ADAPTER_DTYPE_BYTES * A, optimizer=optimizer_bytes_per_param * A, master_weights=0.0,
                comm_buffers=ADAPTER_DTYPE_BYTES * A if row.several_processes and shape.num_gpus > 1 else 0.0,
                gathered_params=0.0, working_copies=autocast_copies + transient, activations=activation_bytes(spec, shape))


def _lora_under_zero(spec: ModelSpec, shape: TrainingShape, strategy: str, optimizer_bytes_per_param: float) -> dict:
    """LoRA's bytes per GPU under DeepSpeed ZeRO-2 or ZeRO-3 (the module docstring)."""
    A, N, c = float(adapter_params(spec, shape.lora_rank)), max(1, shape.num_gpus), shape.compute_bytes
    row = STRATEGIES[strategy]
    offload, stage3 = row.offload, row.shards == EVERYTHING
    layer = float(spec.largest_layer_params or spec.params / max(1, spec.num_layers or 12))
    base = 0.0 if stage3 and offload else c * float(spec.params) / (N if stage3 else 1)
    # ZeRO-3 gathers module by module: the largest frozen module (an LLM's embedding or head; two decoder layers where
    # larger), without a gradient (memory.py counts a full fine-tune's with one)
    gathered = max(2 * layer, largest_parameter(spec)) * c if stage3 else 0.0
    return dict(weights=base, quantized_weights=0.0, adapter_weights=ADAPTER_DTYPE_BYTES * A,
                gradients=ADAPTER_DTYPE_BYTES * A / N, optimizer=0.0 if offload else optimizer_bytes_per_param * A / N,
                master_weights=0.0, comm_buffers=0.0, gathered_params=gathered,
                working_copies=2.0 * A if c == 2 else 0.0, activations=activation_bytes(spec, shape))
