"""What the memory planner needs to know about a model, read without loading its weights.

From a Hugging Face config (a local directory, a config.json, or a hub id in a user's world): the
parameter count is exact (the model is built on the ``meta`` device, which allocates nothing) and
the transformer shape (layers, hidden size, heads, vocabulary) feeds the activation formula. From
a timm model name: the parameter count the same way, and the activations are measured once at
batch 1 on the CPU with ``saved_tensors_hooks`` (what autograd really keeps for backward).
Or just ``--params N`` with shape options.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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

    @property
    def is_transformer_shaped(self) -> bool:
        return bool(self.num_layers and self.hidden_size and self.num_heads)


def _meta_param_count(build) -> tuple[int, int | None, str | None]:
    """(total params, params of the largest repeated block, its class name), building on meta."""
    import torch

    with torch.device("meta"):
        model = build()
    total = sum(p.numel() for p in model.parameters())
    block_sizes: dict[str, int] = {}
    for module in model.modules():
        children = list(module.children())
        if len(children) >= 2 and len({type(c) for c in children}) == 1 and isinstance(module, torch.nn.ModuleList | torch.nn.Sequential):
            size = sum(p.numel() for p in children[0].parameters())
            block_sizes[type(children[0]).__name__] = max(block_sizes.get(type(children[0]).__name__, 0), size)
    if not block_sizes:
        return total, None, None
    name = max(block_sizes, key=block_sizes.get)
    return total, block_sizes[name], name


def from_hf_config(name_or_path: str) -> ModelSpec:
    try:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError as error:  # pragma: no cover - transformers is a dependency
        raise UsageError(f"reading --model needs transformers: {error}") from None
    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:
        raise UsageError(f"--model {name_or_path!r}: cannot read a model config ({str(error).splitlines()[0]}). "
                         "Give a local model directory (with config.json), a hub id reachable from here, or --params N.") from None
    arch = " ".join(getattr(config, "architectures", None) or [])
    causal = "CausalLM" in arch or bool(getattr(config, "is_decoder", False))
    builder = AutoModelForCausalLM if causal else AutoModel
    total, largest, layer_class = _meta_param_count(lambda: builder.from_config(config))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelSpec(
        name=name_or_path,
        params=total,
        num_layers=getattr(text, "num_hidden_layers", None),
        hidden_size=getattr(text, "hidden_size", None),
        num_heads=getattr(text, "num_attention_heads", None),
        vocab_size=getattr(text, "vocab_size", None),
        causal_lm=causal,
        largest_layer_params=largest,
        layer_class=layer_class,
    )


def from_timm(name: str, image_size: int, num_classes: int = 1000) -> ModelSpec:
    import timm
    import torch

    try:
        total, largest, layer_class = _meta_param_count(lambda: timm.create_model(name, pretrained=False, num_classes=num_classes))
    except RuntimeError as error:
        raise UsageError(f"--model {name!r}: timm cannot build it ({error}); see timm.list_models()") from None
    saved = 0
    if total <= 400_000_000:  # measuring needs a real model on the CPU: only for sizes that fit easily

        def pack(tensor):
            nonlocal saved
            saved += tensor.numel() * tensor.element_size()
            return tensor

        model = timm.create_model(name, pretrained=False, num_classes=num_classes)
        x = torch.randn(1, 3, image_size, image_size)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).sum()
    return ModelSpec(name=f"timm/{name}", params=total, activation_bytes_per_sample_fp32=saved or None,
                     largest_layer_params=largest, layer_class=layer_class)


def resolve_model(name_or_path: str, image_size: int = 224) -> ModelSpec:
    """``timm/NAME`` or a timm model name -> timm; anything else -> a Hugging Face config."""
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
