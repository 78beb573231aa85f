"""Activation memory of one micro-batch: what autograd keeps for the backward, by fine-tuning method.

Three models, from the most to the least specific:

- Llama-family decoders (``ModelSpec.gated_mlp``: RMSNorm, gate/up/down MLP, SDPA), counted tensor by tensor from
  transformers' ``modeling_llama`` and peft's ``LoraLayer.forward``, and checked byte for byte against
  ``torch.autograd.graph.saved_tensors_hooks`` on small Llama models on the CPU (tests/plan/test_activation_memory.py:
  full fine-tuning, LoRA and QLoRA, bf16 autocast and fp32, padded and unpadded). Per token and layer, with h the
  hidden size, q and kv the query and key/value widths, I the MLP width, a the heads, c the bytes of the compute
  dtype (2 under autocast, 4 in fp32):

  ============================  ========================  =====================  ========================
  kept for backward             full (fp32 weights)       LoRA (frozen base)     QLoRA (4-bit base)
  ============================  ========================  =====================  ========================
  two RMSNorms                  2 (8h + 4)                2 (4h + 4)             2 (4h + 4)
  linear inputs (autocast)      5ch: q,k,v,gate,up each   c (5h + q): each        same as LoRA
                                cast separately           adapter casts its own
  linear inputs (fp32)          2ch: shared               2ch: shared            2ch
  down projection's input       cI                        cI                     cI
  attention (SDPA)              c (2q + 2kv) + 4a         same                   same
  MLP gate, SiLU, up outputs    3cI                       3cI                    3 x 4I (fp32)
  adapter intermediates         -                         c r per adapted layer  c r per adapted layer
  ============================  ========================  =====================  ========================

  Why they differ: full fine-tuning keeps fp32 weights, so the residual stream is fp32 and each norm also keeps
  its fp32 output for the norm weight's gradient; autocast casts the norm output once per projection.
  peft casts each adapter's input to the adapter's fp32 (``LoraLayer._cast_input_dtype``) and autocast casts it
  back to 16 bits, a copy per adapted layer; frozen base layers keep nothing for themselves, but the backward
  still runs through them to reach earlier adapters. QLoRA's ``prepare_model_for_kbit_training`` casts norms and
  embeddings to fp32 and bitsandbytes' ``Linear4bit.forward`` returns its input's dtype, so the MLP intermediates
  are fp32. With padded batches (``TrainingShape.padded``) kv is the full query width (keys and values expanded
  to every head) and SDPA keeps a c-byte mask of s entries per token and layer.
- Other transformers (BERT, GPT-2): 34·h bytes per token and layer in 16-bit with fused attention (Korthikanti et
  al. 2022, "Reducing Activation Recomputation", eq. 1 without the 5·a·s² attention scores that SDPA/flash
  kernels do not store; + 5·a·s per token with eager attention), plus for LoRA the adapters' input copies and
  intermediates above.
- Vision models from timm: the activations measured at batch 1 by ``model_spec.from_timm``.

Gradient checkpointing (transformers' per-layer, non-reentrant) keeps each layer's input (the residual stream:
fp32 for full fine-tuning and QLoRA, the compute dtype for LoRA) and recomputes one layer at a time. A causal LM's
loss adds 12 bytes per token per vocabulary entry at its peak: transformers upcasts the logits to fp32
(``loss_utils.ForCausalLMLoss``), log-softmax keeps its fp32 output, and the backward holds its gradient and the
input gradient beside it. With the chunked head and loss (``TrainingShape.chunked_loss``) the logits exist for one
chunk of rows at a time (the same 12 bytes per vocabulary entry, for ``loss_chunk`` rows), and the backward keeps the
hidden states' gradient instead of the logits.
"""

from __future__ import annotations

from dataclasses import replace

from .model_spec import ModelSpec, adapter_shape
from .training_shape import SELECTIVE_POLICIES, TrainingShape, chunk_rows

KORTHIKANTI_BYTES_PER_HIDDEN = 34  # per token and layer, 16-bit, fused attention (Korthikanti et al. 2022, eq. 1)
EAGER_SCORES_BYTES_PER_HEAD_TOKEN = 5  # x a x s per token and layer: eager attention scores, softmax, dropout (ibid.)
LOGITS_PEAK_BYTES_PER_VOCAB = 12  # per token: fp32 logits' log-softmax, its gradient and the input gradient
NORM_STATS_BYTES = 4  # one fp32 rsqrt per token per RMSNorm
LSE_BYTES_PER_HEAD = 4  # one fp32 log-sum-exp per token per head, kept by flash / memory-efficient SDPA
CHUNKED_MASK_BYTES = 1  # per token: the boolean mask of labelled positions the chunked loss gathers by
OFFLOAD_RESIDENT_LAYERS = 2  # activation offloading: layers whose saved activations are on the GPU at once


def residual_bytes(shape: TrainingShape) -> int:
    """Bytes per element of the residual stream (what checkpointing keeps per layer): fp32 when the weights are
    fp32 (full fine-tuning) or the norms and embeddings are upcast (QLoRA); the compute dtype for LoRA."""
    return shape.compute_bytes if shape.method == "lora" else 4


def _adapters_per_layer(spec: ModelSpec) -> tuple[float, float]:
    """(adapted linear layers, summed input widths) per layer."""
    found = adapter_shape(spec)
    if found is None:
        raise ValueError(f"{spec.name}: LoRA needs the model's linear layers (a config to read); a parameter count is not enough")
    count, d_in, _ = found
    return count / spec.num_layers, d_in / spec.num_layers


def gated_layer_bytes_per_token(spec: ModelSpec, shape: TrainingShape) -> float:
    """One Llama-family decoder layer, per token (the table in the module docstring)."""
    h, q, inter, a = spec.hidden_size, spec.query_width, spec.intermediate_size, spec.num_heads
    kv = q if shape.padded else spec.kv_width
    c = shape.compute_bytes
    autocast = c == 2
    peft = shape.method in ("lora", "qlora")
    norms = 2 * (4 * h + NORM_STATS_BYTES) + (2 * 4 * h if not peft else 0)
    if autocast:
        inputs = c * (5 * h + (q if peft else 0))
    else:
        inputs = c * 2 * h
    attention = c * (2 * q + 2 * kv) + LSE_BYTES_PER_HEAD * a
    if shape.padded:
        attention += c * shape.seq_len
    if shape.attention == "eager":
        attention += EAGER_SCORES_BYTES_PER_HEAD_TOKEN * a * shape.seq_len * c / 2
    mlp = c * inter + 3 * (4 if shape.method == "qlora" else c) * inter
    adapters = 0.0
    if peft:
        per_layer, _ = _adapters_per_layer(spec)
        adapters = c * shape.lora_rank * per_layer
    return norms + inputs + attention + mlp + adapters


def generic_layer_bytes_per_token(spec: ModelSpec, shape: TrainingShape) -> float:
    """Korthikanti's 34·h (16-bit units, doubled in fp32), plus LoRA's copies and intermediates."""
    scale = shape.compute_bytes / 2
    per_token = KORTHIKANTI_BYTES_PER_HIDDEN * spec.hidden_size
    if shape.attention == "eager":
        per_token += EAGER_SCORES_BYTES_PER_HEAD_TOKEN * spec.num_heads * shape.seq_len
    per_token *= scale
    if shape.method in ("lora", "qlora"):
        per_layer, d_in = _adapters_per_layer(spec)
        per_token += shape.compute_bytes * (shape.lora_rank * per_layer + (d_in if shape.compute_bytes == 2 else 0))
    return per_token


def layer_projections(spec: ModelSpec) -> list[tuple[int, int]]:
    """(inner, output) width of each matmul of a layer: query, key, value and output projections; gate and up (or up),
    then down."""
    h, q, kv = spec.hidden_size, spec.query_width, spec.kv_width
    inter = spec.intermediate_size or 4 * h
    return [(h, q), (h, kv), (h, kv), (q, h)] + ([(h, inter), (h, inter)] if _gated(spec) else [(h, inter)]) + [(inter, h)]


def selective_kept_bytes_per_token(spec: ModelSpec, shape: TrainingShape) -> float:
    """What a layer under selective checkpointing keeps besides its input, per token: the outputs of its matmuls
    (q, k, v and output projections; gate, up and down for a gated MLP, up and down otherwise; for LoRA each adapter's
    A and B products) and of attention (its output and log-sum-exp; eager attention its score matrix instead).
    Measured byte for byte on small Llamas (tests/plan/test_activation_memory.py)."""
    a = spec.num_heads
    q = spec.query_width
    c = shape.compute_bytes
    matmuls = c * sum(d_out for _, d_out in layer_projections(spec))
    # SDPA's output and log-sum-exp; eager attention's score matrix and output (it keeps no log-sum-exp)
    attention = c * q + (c * a * shape.seq_len if shape.attention == "eager" else LSE_BYTES_PER_HEAD * a)
    adapters = 0.0
    if shape.method in ("lora", "qlora"):
        count, _, d_out = adapter_shape(spec) or (0, 0, 0)
        adapters = c * (shape.lora_rank * count + d_out) / spec.num_layers
    return matmuls + attention + adapters


def lean_kept_bytes_per_token(spec: ModelSpec, shape: TrainingShape) -> float:
    """What a layer under lean selective checkpointing keeps besides its input, per token: the outputs of the matmuls
    that narrow what they read (inner dimension above the output's: the key and value projections under grouped
    attention, the MLP's down projection, each adapter's A), and attention's output and log-sum-exp (eager attention:
    its score matrix)."""
    q, a = spec.query_width, spec.num_heads
    c = shape.compute_bytes
    matmuls = c * sum(d_out for d_in, d_out in layer_projections(spec) if d_in > d_out)
    if shape.attention == "eager":  # its two batched matmuls by the same rule: scores (inner: head_dim), output (inner: s)
        head_dim = q // a
        attention = c * a * shape.seq_len * (head_dim > shape.seq_len) + c * q * (shape.seq_len > head_dim)
    else:
        attention = c * q + LSE_BYTES_PER_HEAD * a  # SDPA's output and log-sum-exp: always kept
    adapters = 0.0
    if shape.method in ("lora", "qlora"):
        count, _, _ = adapter_shape(spec) or (0, 0, 0)
        adapters = c * shape.lora_rank * count / spec.num_layers
    return matmuls + attention + adapters


def narrow_share(spec: ModelSpec) -> float:
    """The share of a layer's matmul FLOPs lean selective checkpointing keeps (does not recompute)."""
    projections = layer_projections(spec)
    total = sum(i * o for i, o in projections)
    return sum(i * o for i, o in projections if i > o) / total if total else 0.0


def _checkpointed_terms(spec: ModelSpec, shape: TrainingShape, layer: float, kept: float, tokens: int) -> dict[str, float]:
    """``layer inputs`` (what the checkpointed layers keep through the forward) and ``layers`` (the layers that are not
    checkpointed, and the one being recomputed at the backward's peak)."""
    L = spec.num_layers
    if shape.checkpoint_layers in SELECTIVE_POLICIES:
        per_token = (selective_kept_bytes_per_token if shape.checkpoint_layers == "selective" else lean_kept_bytes_per_token)
        saved = min(layer, per_token(spec, shape))
        return {"layer inputs": (kept + saved) * resident_layers(L, shape) * tokens, "layers": (layer - saved) * tokens}
    checkpointed = shape.checkpointed_layers(L)
    plain = L - checkpointed  # every-N: the layers outside the checkpoints keep everything (offloaded too)
    return {"layer inputs": kept * resident_layers(checkpointed, shape) * tokens,
            "layers": layer * (resident_layers(plain, shape) + 1) * tokens}


def resident_layers(layers: int, shape: TrainingShape) -> int:
    """Of ``layers`` layers' saved activations, how many stay on the GPU: all, or with activation offloading two (the
    one whose copy to the host is in flight in the forward, the one brought back for the backward)."""
    return min(layers, OFFLOAD_RESIDENT_LAYERS) if shape.offload_activations else layers


def offloaded_bytes(spec: ModelSpec, shape: TrainingShape) -> float:
    """Host (pinned) memory activation offloading needs per process: what it takes off the GPU."""
    if not shape.offload_activations:
        return 0.0
    return activation_bytes(spec, replace(shape, offload_activations=False)) - activation_bytes(spec, shape)


def _gated(spec: ModelSpec) -> bool:
    return bool(spec.gated_mlp and spec.intermediate_size and spec.is_transformer_shaped)


def activation_terms(spec: ModelSpec, shape: TrainingShape) -> dict[str, float]:
    """Activation bytes of one micro-batch, by part: ``layers`` (every layer, or with checkpointing one layer
    recomputed), ``layer inputs`` (checkpointing), ``output head`` (final norm and head input) and ``loss``
    (the logits' peak)."""
    b, s = shape.micro_batch, shape.seq_len
    if spec.activation_bytes_per_sample_fp32:  # measured (vision): autocast keeps most in 16-bit
        per_sample = spec.activation_bytes_per_sample_fp32 * (0.55 if shape.compute_bytes == 2 else 1.0)
        if shape.gradient_checkpointing:
            per_sample *= 0.25  # block inputs only, plus one block being recomputed
        return {"layers": per_sample * b}
    if not spec.is_transformer_shaped:
        return {}
    L, h = spec.num_layers, spec.hidden_size
    terms: dict[str, float] = {}
    if _gated(spec):
        layer = gated_layer_bytes_per_token(spec, shape)
        kept = residual_bytes(shape) * h
        # the final norm as in the layers; a trained output head also keeps its input (a cast copy under autocast).
        # Chunked, the head keeps nothing (its gradients are computed in the forward), but the final norm keeps its
        # normalised input for its weight's gradient (measured: tests/plan/test_activation_memory.py)
        chunked = shape.chunked_loss and spec.causal_lm
        trained_head = (4 * h if chunked else (4 + shape.compute_bytes) * h) if shape.method == "full" else 0
        head = 4 * h + NORM_STATS_BYTES + trained_head
        terms["output head"] = head * s * b
    else:
        layer = generic_layer_bytes_per_token(spec, shape)
        kept = 2 * h * shape.compute_bytes / 2  # Korthikanti's layer input, 16-bit units
    if shape.gradient_checkpointing:
        terms.update(_checkpointed_terms(spec, shape, layer, kept, s * b))
    else:
        terms["layers"] = layer * resident_layers(L, shape) * s * b
    if spec.causal_lm and spec.vocab_size:
        if shape.chunked_loss:
            # the logits' peak of one chunk, and kept for the backward: the hidden states' gradient (the final
            # norm's output dtype, the residual's) and the mask of labelled positions (every position counted)
            rows = min(shape.loss_chunk or chunk_rows(spec.vocab_size), s * b)
            kept = (residual_bytes(shape) if _gated(spec) else shape.compute_bytes) * h + CHUNKED_MASK_BYTES
            terms["loss"] = LOGITS_PEAK_BYTES_PER_VOCAB * spec.vocab_size * rows + kept * s * b
        else:
            terms["loss"] = LOGITS_PEAK_BYTES_PER_VOCAB * spec.vocab_size * s * b
    return terms


def activation_bytes(spec: ModelSpec, shape: TrainingShape) -> float:
    """Activation memory of one micro-batch."""
    return float(sum(activation_terms(spec, shape).values()))
