"""What the memory planner needs to know about a model, read without loading its weights.

From a Hugging Face config (a local directory, a config.json, a config object or a plain dict; a hub id in a
user's world): the parameter count is exact (the model is built on the ``meta`` device, which allocates
nothing) and the transformer shape (layers, hidden size, heads, key/value heads, MLP width, vocabulary) feeds
the activation formulas. The same meta model is walked once for what LoRA and QLoRA need: every linear layer
peft's ``target_modules="all-linear"`` adapts (``nn.Linear`` and GPT-2's ``Conv1D`` but the output head:
``peft.tuners.tuners_utils._maybe_include_all_linear_layers``) with its input and output widths, and the
weights bitsandbytes quantizes to 4 bits (the same classes but the output embedding, tied weights and the
module of the last parameter: ``transformers.quantizers.base.get_keys_to_not_convert``, and
``integrations.bitsandbytes.replace_with_bnb_linear``). From a timm model name: the parameter count the same
way, and the activations are measured once at batch 1 on the CPU with ``saved_tensors_hooks`` (what autograd
really keeps for backward). Or just ``--params N`` with shape options.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..builtin_models import minilm_path
from ..errors import UsageError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: int
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None
    causal_lm: bool = False
    # Measured activation bytes per sample at fp32 (vision models); None: use the transformer formula.
    activation_bytes_per_sample_fp32: int | None = None
    largest_layer_params: int | None = None
    layer_class: str | None = None
    # The shape details LLM activations depend on (None: unknown, the generic formula is used).
    num_kv_heads: int | None = None  # grouped-query attention: fewer key/value heads than query heads
    head_dim: int | None = None  # hidden_size // num_heads unless the config says otherwise (Gemma)
    intermediate_size: int | None = None
    gated_mlp: bool = False  # gate_proj/up_proj/down_proj (Llama family: SwiGLU / GeGLU)
    tied_embeddings: bool = False
    # What LoRA adapts and QLoRA quantizes, counted on the meta model (None: derived from the shape when it can be).
    adapted_linears: int | None = None  # linear layers "all-linear" adapts
    adapted_in_features: int | None = None  # their summed input widths (d_in)
    adapted_out_features: int | None = None  # their summed output widths (d_out)
    quantized_params: int | None = None  # weights bitsandbytes stores in 4 bits
    largest_linear_params: int | None = None  # the largest of those: QLoRA's dequantized buffer
    # what a causal LM's head and loss do beyond hidden @ W.T and a cross-entropy (config attributes: soft-capping, a
    # logit scale, a router's auxiliary loss, a loss of its own): the chunked head steps aside for such a model
    lm_head_extras: tuple[str, ...] = ()

    @property
    def is_transformer_shaped(self) -> bool:
        return bool(self.num_layers and self.hidden_size and self.num_heads)

    @property
    def query_width(self) -> int | None:
        """Width of the attention's query projection output (heads x head_dim)."""
        if not (self.num_heads and self.hidden_size):
            return None
        return self.num_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def kv_width(self) -> int | None:
        """Width of the key (and value) projection output; equals query_width without GQA."""
        if not self.query_width:
            return None
        return (self.num_kv_heads or self.num_heads) * (self.head_dim or self.hidden_size // self.num_heads)


def model_fingerprint(spec: ModelSpec) -> dict:
    """What makes two specs the same model for the planner: a plan's memory values were made for this (recorded in
    NAME.plan.json, compared by every run before it applies them)."""
    return {"params": spec.params, "layers": spec.num_layers, "hidden size": spec.hidden_size, "vocabulary": spec.vocab_size}


def decoder_linear_shapes(spec: ModelSpec) -> list[tuple[int, int]] | None:
    """(d_in, d_out) of the seven linear layers of one Llama-family decoder layer, from the config alone:
    q (h -> heads*head_dim), k and v (h -> kv_heads*head_dim), o (heads*head_dim -> h), gate and up (h -> I),
    down (I -> h). None unless the spec is a gated-MLP decoder with all those numbers."""
    if not (spec.gated_mlp and spec.is_transformer_shaped and spec.intermediate_size):
        return None
    h, q, kv, inter = spec.hidden_size, spec.query_width, spec.kv_width, spec.intermediate_size
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def adapter_shape(spec: ModelSpec) -> tuple[int, int, int] | None:
    """(adapted linear layers, summed d_in, summed d_out) over the model: the meta census when there is one,
    else the Llama-family shapes x layers; None when neither is known."""
    if spec.adapted_linears is not None and spec.adapted_in_features is not None and spec.adapted_out_features is not None:
        return spec.adapted_linears, spec.adapted_in_features, spec.adapted_out_features
    shapes = decoder_linear_shapes(spec)
    if shapes is None:
        return None
    L = spec.num_layers
    return len(shapes) * L, sum(i for i, _ in shapes) * L, sum(o for _, o in shapes) * L


def quantized_params(spec: ModelSpec) -> int | None:
    """Weights stored in 4 bits under QLoRA: the census, else the decoder layers' linear weights."""
    if spec.quantized_params is not None:
        return spec.quantized_params
    shapes = decoder_linear_shapes(spec)
    return None if shapes is None else sum(i * o for i, o in shapes) * spec.num_layers


def largest_linear(spec: ModelSpec) -> int | None:
    if spec.largest_linear_params is not None:
        return spec.largest_linear_params
    shapes = decoder_linear_shapes(spec)
    return None if shapes is None else max(i * o for i, o in shapes)


def _linear_widths(module, conv1d_class) -> tuple[int, int] | None:
    """(d_in, d_out) of a layer peft's "all-linear" and bitsandbytes treat as linear, else None."""
    import torch

    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if conv1d_class is not None and isinstance(module, conv1d_class):
        return module.weight.shape[0], module.weight.shape[1]  # Conv1D stores (in, out)
    return None


def _census(model) -> dict:
    """Parameter count, the largest repeated block, and the linear layers LoRA adapts / bitsandbytes quantizes."""
    import torch

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        Conv1D = None
    total = sum(p.numel() for p in model.parameters())
    block_sizes: dict[str, int] = {}
    for module in model.modules():
        children = list(module.children())
        if len(children) >= 2 and len({type(c) for c in children}) == 1 and isinstance(module, torch.nn.ModuleList | torch.nn.Sequential):
            size = sum(p.numel() for p in children[0].parameters())
            block_sizes[type(children[0]).__name__] = max(block_sizes.get(type(children[0]).__name__, 0), size)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else (
        model.get_classifier() if hasattr(model, "get_classifier") else None)
    names = list(model.named_parameters())
    last_module = names[-1][0].rsplit(".", 1)[0] if names else None
    tied = set()
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        tied.update((target.removesuffix(".weight"), source.removesuffix(".weight")))
    adapted = [0, 0, 0]  # count, sum d_in, sum d_out
    quantized, largest = 0, 0
    for name, module in model.named_modules():
        widths = _linear_widths(module, Conv1D)
        if widths is None or module is head:
            continue
        adapted[0] += 1
        adapted[1] += widths[0]
        adapted[2] += widths[1]
        if name != last_module and name not in tied:
            quantized += widths[0] * widths[1]
            largest = max(largest, widths[0] * widths[1])
    module_names = [name for name, _ in model.named_modules()]
    gated = any(n.endswith("gate_proj") for n in module_names) and any(n.endswith("up_proj") for n in module_names)
    layer_class = max(block_sizes, key=block_sizes.get) if block_sizes else None
    return dict(params=total, largest_layer_params=block_sizes[layer_class] if layer_class else None, layer_class=layer_class,
                adapted_linears=adapted[0], adapted_in_features=adapted[1], adapted_out_features=adapted[2],
                quantized_params=quantized, largest_linear_params=largest or None, gated_mlp=gated)


def _meta_census(build) -> dict:
    import torch

    with torch.device("meta"):
        model = build()
    return _census(model)


def _is_causal(config) -> bool:
    """From ``architectures`` when the config names them; else a decoder model type (one transformers maps to a
    causal LM and not to a masked LM: Llama, GPT-2, Qwen2 yes; BERT, RoBERTa no)."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return any("CausalLM" in a or "LMHeadModel" in a for a in archs)
    if getattr(config, "is_decoder", False):
        return True
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

    kind = getattr(config, "model_type", None)
    return kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


# config attributes that change what the LM head computes beyond hidden @ W.T (+ b)
HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale", "lm_head_multiplier",
               "output_multiplier")


def lm_head_extras(config) -> tuple[str, ...]:
    """What the config's head and loss do beyond a matmul and transformers' causal-LM cross-entropy (empty: the
    chunked head and loss is exact for it; finetune/tasks/language_modeling/lm_head_loss.support says the same of a loaded model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = {name for name in HEAD_EXTRAS for c in (config, text) if getattr(c, name, None) not in (None, 1, 1.0)}
    if getattr(text, "output_router_logits", False) or getattr(config, "output_router_logits", False):
        found.add("output_router_logits")
    if getattr(config, "loss_type", None) not in (None, "ForCausalLM", "ForCausalLMLoss"):
        found.add(f"loss_type={config.loss_type}")
    return tuple(sorted(found))


def from_config(config, name: str | None = None, causal_lm: bool | None = None) -> ModelSpec:
    """A ModelSpec from a transformers config object or a config dict (``model_type`` plus the config's keys,
    as in config.json), built on the meta device: no weights, no hub. ``causal_lm`` None: decided from the
    config (``architectures``, else the model type)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    if isinstance(config, dict):
        if "model_type" not in config:
            raise UsageError(f"model config {name or ''}: a config dict needs 'model_type' (e.g. 'llama'), as config.json has")
        try:
            config = AutoConfig.for_model(**config)
        except ValueError as error:
            raise UsageError(f"model config {name or ''}: {str(error).splitlines()[0]}") from None
    causal = _is_causal(config) if causal_lm is None else causal_lm
    builder = AutoModelForCausalLM if causal else AutoModel
    census = _meta_census(lambda: builder.from_config(config))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    return ModelSpec(
        name=name or getattr(config, "name_or_path", None) or getattr(config, "model_type", "model"),
        num_layers=getattr(text, "num_hidden_layers", None),
        hidden_size=hidden,
        num_heads=heads,
        vocab_size=getattr(text, "vocab_size", None),
        causal_lm=causal,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or (hidden // heads if hidden and heads else None),
        intermediate_size=getattr(text, "intermediate_size", None),
        tied_embeddings=bool(getattr(text, "tie_word_embeddings", False)) and causal,
        lm_head_extras=lm_head_extras(config) if causal else (),
        **census,
    )


def from_hf_config(name_or_path: str) -> ModelSpec:
    try:
        from transformers import AutoConfig
    except ImportError as error:  # pragma: no cover - transformers is a dependency
        raise UsageError(f"reading --model needs transformers: {error}") from None
    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:
        raise UsageError(f"--model {name_or_path!r}: cannot read a model config ({str(error).splitlines()[0]}). "
                         "Give a local model directory (with config.json), a hub id reachable from here, or --params N.") from None
    return from_config(config, name=name_or_path)


def from_timm(name: str, image_size: int, num_classes: int = 1000) -> ModelSpec:
    import timm

    try:
        census = _meta_census(lambda: timm.create_model(name, pretrained=False, num_classes=num_classes))
    except RuntimeError as error:
        raise UsageError(f"--model {name!r}: timm cannot build it ({error}); see timm.list_models()") from None
    per_sample = None
    if census["params"] <= 400_000_000:  # measuring needs a real model on the CPU: only for sizes that fit easily
        model = timm.create_model(name, pretrained=False, num_classes=num_classes)
        # what one more sample adds: per sample, no weight counted in it, and never a batch of one (BatchNorm refuses
        # one value per channel in training mode, which a small image leaves at the last stage)
        per_sample = _saved_bytes(model, 3, image_size) - _saved_bytes(model, 2, image_size)
    return ModelSpec(name=f"timm/{name}", activation_bytes_per_sample_fp32=per_sample or None, **census)


def _saved_bytes(model, batch: int, image_size: int) -> int:
    """The bytes autograd saves for backward in one training forward of ``batch`` random images."""
    import torch

    saved = 0

    def pack(tensor):
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(batch, 3, image_size, image_size)).sum()
    return saved


BUILTIN_MODELS = {"builtin:efficientnet_lite0": "timm/tf_efficientnet_lite0"}  # finetune/tasks/image_classification/pretrained.py: the shipped weights


def resolve_model(name_or_path: str, image_size: int = 224) -> ModelSpec:
    """``timm/NAME`` or a timm model name -> timm; ``builtin:minilm`` -> the shipped MiniLM's config; anything
    else -> a Hugging Face config (local directory or hub id)."""
    if name_or_path == "builtin:minilm":

        return from_hf_config(minilm_path())
    name_or_path = BUILTIN_MODELS.get(name_or_path, name_or_path)
    if name_or_path.startswith("timm/"):
        return from_timm(name_or_path.split("/", 1)[1], image_size)
    if not Path(name_or_path).exists():
        try:
            import timm

            if timm.is_model(name_or_path):
                return from_timm(name_or_path, image_size)
        except ImportError:
            pass
    return from_hf_config(name_or_path)


def largest_parameter(spec: ModelSpec) -> float:
    """The largest single parameter: the embedding or output head (vocabulary x hidden) or the largest linear weight."""
    embedding = (spec.vocab_size or 0) * (spec.hidden_size or 0)
    linear = spec.largest_linear_params or (spec.largest_layer_params or spec.params / max(1, spec.num_layers or 12))
    return float(min(spec.params, max(embedding, linear)))
