"""The LM head and its loss in chunks: neither the full logits nor their gradient ever exist at once.

A causal LM's forward computes ``logits = hidden @ W.T`` for every position (batch x length x vocabulary: SmolLM2's
49k vocabulary makes 0.4 GB of fp32 logits for 2 rows of 1024 tokens), then upcasts them to fp32 for the loss, and
backward keeps their gradient as large again. Here, when the forward is given labels:

1. positions whose (shifted) label is ignored (-100: prompts, padding) are dropped before the head's matmul: their
   logits were computed and thrown away;
2. the rest go through the head and the cross-entropy ``chunk`` rows at a time, and each chunk's gradients (with
   respect to the hidden states, and to the head's weight when it trains) are computed at once from its softmax and
   accumulated, so backward is one multiplication by the incoming gradient. Per chunk, the logits and their gradient
   are ``chunk x vocabulary``; nothing is recomputed (a checkpointed chunk would run its matmul twice).

On CUDA a fused kernel may do step 2 instead (``kernel``: Liger's ``liger_fused_linear_cross_entropy``, Triton, or
Cut Cross-Entropy's ``linear_cross_entropy``, with its gradient filtering off so it stays exact): the same rows and
targets, summed, then the same scale. ``KERNELS`` names what each needs.

Exact: the loss is transformers' ``ForCausalLMLoss`` (labels shifted left, fp32 cross-entropy, summed and divided by
``num_items_in_batch`` when the Trainer passes it, else averaged), the gradients those of the same expression; only
the order of the fp32 sums differs. Without labels (generation, a caller that wants logits) the model's own forward
runs. Models whose head does more than a matmul (logit soft-capping, a logit scale, a loss of their own) are left as
they are: ``support`` says why.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass

import torch

from ....plan.model_spec import lm_head_extras  # what the config adds beyond hidden @ W.T: the chunked path would not be exact
from ....plan.training_shape import chunk_rows
from ...deepspeed_env import zero3_requested
from .model_probe import agreed, probe_tokens, why_not_runnable

IGNORE = -100
DEFAULT_CHUNK = 1024  # rows at a time when the vocabulary is unknown; else launch.training_shape.chunk_rows(vocabulary)


# chunked_lm_loss value -> (module to import, the pip package): the fused kernels used instead of the chunks on CUDA
KERNELS = {"liger": ("liger_kernel.transformers.functional", "liger-kernel"),
           "cce": ("cut_cross_entropy", "cut-cross-entropy")}


@dataclass(frozen=True)
class Support:
    supported: bool
    reason: str


VOCAB_SLICE_BYTES = 64 * 2**20  # the 16-bit weight-gradient product is made this much at a time (not vocabulary x hidden)


def _autocast_dtype(device_type: str):
    """The 16-bit dtype autocast runs matmuls in on ``device_type``, or None (fp32 training, or autocast off)."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def accumulate_weight_grad(grad_weight, grad, h, dtype=None) -> None:
    """``grad_weight += grad.T @ h`` (fp32 buffer). In fp32 training, in place (no vocabulary x hidden temporary). Under
    autocast the product runs in its 16-bit dtype, as the model's own head's backward does: an in-place fp32 ``addmm_``
    escapes autocast, and that GEMM (vocabulary x hidden x rows) would run in full fp32, an order of magnitude slower on
    tensor cores; the 16-bit product is made a slice of the vocabulary at a time (``VOCAB_SLICE_BYTES``) and added
    into the fp32 buffer."""
    if dtype is None:
        grad_weight.addmm_(grad.t(), h.float())
        return
    g, h16 = grad.to(dtype), h.to(dtype)
    rows = max(1, VOCAB_SLICE_BYTES // (h.shape[1] * torch.finfo(dtype).bits // 8))
    for start in range(0, grad_weight.shape[0], rows):
        grad_weight[start:start + rows] += g[:, start:start + rows].t() @ h16


class LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i @ W.T + b, target_i) * scale, with the gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, chunk: int, grad_enabled: bool = True):
        ctx.weight_dtype = weight.dtype  # gradients accumulate in fp32 and leave in the parameter's dtype
        # the dtype the model's own head's backward would multiply in: autocast's, or a 16-bit weight's (pure bf16
        # training, DeepSpeed's bf16 module cast)
        autocast_dtype = _autocast_dtype(hidden.device.type) or (weight.dtype if weight.dtype in (torch.float16, torch.bfloat16)
                                                                 else None)
        # needs_input_grad follows requires_grad only, not the grad mode: an evaluation under no_grad computes no grads
        needs_hidden, needs_weight, needs_bias = (n and grad_enabled for n in ctx.needs_input_grad[:3])
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, t = hidden[start:start + chunk], targets[start:start + chunk]
            logits = torch.nn.functional.linear(h, weight, bias).float()
            total += torch.nn.functional.cross_entropy(logits, t, reduction="sum")
            if not (needs_hidden or needs_weight or needs_bias):
                continue
            grad = torch.softmax(logits, dim=-1)  # d(sum CE)/d(logits) = softmax - one-hot
            grad[torch.arange(t.shape[0], device=t.device), t] -= 1.0
            grad *= scale
            if needs_hidden:
                grad_hidden[start:start + chunk] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
            if needs_weight:
                accumulate_weight_grad(grad_weight, grad, h, autocast_dtype)
            if needs_bias:
                grad_bias += grad.sum(0)
        for buffer in (grad_hidden, grad_weight, grad_bias):  # gradients, not activations: activation offloading leaves them
            if buffer is not None:
                buffer._hf_gpu_train_keep_on_device = True
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return total * scale

    @staticmethod
    def backward(ctx, grad_output):
        # scaled in place: the buffers made in forward become the gradients (no second copy of the head's gradient)
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_output.float()
        if grad_hidden is not None:
            grad_hidden.mul_(scale.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(scale).to(ctx.weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(scale).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def linear_cross_entropy(hidden, weight, bias, targets, scale, chunk: int = DEFAULT_CHUNK, kernel: str | None = None):
    """sum_i CE(hidden_i @ W.T + b, target_i) * scale: in chunks here, or by a fused kernel (``KERNELS``)."""
    if kernel == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(hidden, weight, targets, bias=bias, reduction="sum") * scale
    if kernel == "cce":
        from cut_cross_entropy import linear_cross_entropy as cut_cross_entropy

        # filter_eps=None: no gradient entry below a threshold is skipped (its default "high" skips some: not exact)
        return cut_cross_entropy(hidden, weight, targets, reduction="sum", filter_eps=None) * scale
    return LinearCrossEntropy.apply(hidden, weight, bias, targets, scale, chunk, torch.is_grad_enabled())


def kernel_problem(kernel: str, on_cuda: bool) -> str | None:
    """Why ``kernel`` cannot run here (None: it can)."""

    module, package = KERNELS[kernel]
    if not on_cuda:
        return "its kernels run on CUDA only (this run is on the CPU): chunked_lm_loss=true chunks the head in plain PyTorch"
    try:
        importlib.import_module(module)
    except ImportError as error:
        return f"{package} is not installed ({error}): pip install {package}, or chunked_lm_loss=true"
    return None


def causal_lm_of(model):
    """The ``*ForCausalLM`` module inside a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def support(model, precision: str | None = None) -> Support:
    """Whether the chunked head and loss is exact for ``model`` (trained in ``precision``), and why not."""
    base = causal_lm_of(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or not hasattr(base, "get_decoder") or not type(base).__name__.endswith("ForCausalLM"):
        return Support(False, f"{type(base).__name__} is not a decoder with a linear output head (*ForCausalLM)")
    extras = lm_head_extras(base.config)  # the planner's reading of the same config (plan/model_spec.py)
    if extras:
        return Support(False, f"its head or loss does more than a matmul and transformers' cross-entropy: {', '.join(extras)}")
    if hasattr(head, "base_layer") or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return Support(False, "its output head is adapted (LoRA on lm_head) or quantized")
    if precision == "fp16":
        # the gradients are scaled by 1/tokens before the GradScaler's factor reaches them (in backward): in fp16
        # they would flush to zero on a large global batch
        return Support(False, "fp16 training (the loss scale arrives after the gradients are made)")
    from transformers.integrations import is_deepspeed_zero3_enabled


    if is_deepspeed_zero3_enabled() or zero3_requested():  # the launch's ZeRO-3, before TrainingArguments exist too
        return Support(False, "DeepSpeed ZeRO-3 partitions the head's weight outside its own forward")
    return Support(True, "the head's matmul and the loss in chunks of rows with a label")


HEAD_PROBE_TOLERANCE = 1e-3  # of the logits' (or the loss's) scale: both paths run the same ops, a head extra moves far more
PROBED_ATTENTION = ("sdpa", "eager")  # the probe runs these: flash-attn needs 16-bit CUDA inputs, flex attention compiles


def _autocast_for(precision: str | None, device: torch.device):
    """The run's autocast on ``device`` (bf16/fp16), for a probe that runs the model as training runs it."""

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision or "")
    if dtype is None or device.type not in ("cuda", "cpu"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def head_probe(model, precision: str | None = None) -> Support:
    """Run the model on a few tokens, as it trains (its device, the run's autocast), and compare its own logits with
    the head's matmul of the decoder's output, and its own loss with the cross-entropy of those logits. A model whose
    head or loss does anything beyond ``hidden @ W.T + b`` and transformers' causal-LM cross-entropy (a logit
    multiplier no config list names, Falcon-H1's ``lm_head_multiplier``; soft-capping; a loss of its own) gives other
    figures, and keeps its own head. The logits are compared row for row from the same GEMM shape, and the loss from the
    model's own logits, so a kernel's rounding for another row count cannot refuse a plain model. Not run where this
    process cannot run the model (``model_probe.why_not_runnable``) or its attention kernel is not SDPA's or eager: the
    config checks of ``support`` stand."""

    base = causal_lm_of(model)
    original = getattr(base, "_hf_gpu_train_original_forward", base.forward)  # the model's own, installed or not
    attention = getattr(base.config, "_attn_implementation", None) or "eager"
    not_runnable = why_not_runnable(base) or (
        None if attention in PROBED_ATTENTION else f"attn_implementation={attention} is not run for the check")
    if not_runnable:
        return Support(True, f"the head's matmul and the loss in chunks of rows with a label ({not_runnable}: not probed)")
    embeddings = base.get_input_embeddings()
    ids = torch.tensor([probe_tokens(embeddings.num_embeddings, 6, 13)], device=embeddings.weight.device)
    was_training = base.training
    base.eval()
    try:
        with torch.no_grad(), _autocast_for(precision, ids.device):
            own = original(input_ids=ids, labels=ids, use_cache=False)
            hidden = base.get_decoder()(input_ids=ids, use_cache=False)[0]
            head = base.get_output_embeddings()
            logits = torch.nn.functional.linear(hidden, head.weight, head.bias).float()
    except (TypeError, ValueError, RuntimeError) as error:  # a model that cannot run a plain forward here
        return Support(False, f"its forward could not be probed ({type(error).__name__}: {str(error).splitlines()[0]})")
    finally:
        base.train(was_training)
    if getattr(own, "logits", None) is None or getattr(own, "loss", None) is None:
        return Support(False, "its forward gives no logits or no loss to compare with")
    own_logits = own.logits.float()
    moved = float((own_logits - logits).abs().max())
    if moved > HEAD_PROBE_TOLERANCE * max(1.0, float(logits.abs().max())):
        return Support(False, f"its logits are not its head's matmul of the decoder's output (they differ by {moved:.3g} on a "
                              "probe: a logit scale or cap of its own)")
    cross_entropy = torch.nn.functional.cross_entropy(own_logits[0, :-1], ids[0, 1:])
    gap = abs(float(own.loss) - float(cross_entropy))
    if gap > HEAD_PROBE_TOLERANCE * max(1.0, abs(float(cross_entropy))):
        return Support(False, f"its loss is not transformers' causal-LM cross-entropy of its logits (it differs by {gap:.3g} "
                              "on a probe: a loss of its own)")
    return Support(True, f"the head's matmul and the loss in chunks of rows with a label (checked on this model, on {ids.device})")


def chunked_loss(base, hidden, labels, num_items_in_batch, chunk: int, kernel: str | None = None):
    """transformers' ForCausalLMLoss on ``hidden`` through ``base``'s head, in chunks of the labelled rows only."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:].to(hidden.device)
    keep = shifted != IGNORE
    rows, targets = hidden[keep], shifted[keep]
    count = num_items_in_batch if num_items_in_batch is not None else targets.shape[0]
    if torch.is_tensor(count):
        scale = 1.0 / count.to(hidden.device, torch.float32)
    else:
        scale = torch.tensor(1.0 / max(int(count), 1), device=hidden.device)
    if num_items_in_batch is None and targets.shape[0] == 0:  # transformers' mean over no token: nan
        scale = torch.tensor(float("nan"), device=hidden.device)
    head = base.get_output_embeddings()
    return linear_cross_entropy(rows, head.weight, head.bias, targets, scale, chunk, kernel)


def install(model, chunk: int | None = None, precision: str | None = None, kernel: str | None = None,
            probe: bool = True) -> Support:
    """Give ``model``'s causal LM the chunked head and loss (when ``support`` allows), or a fused kernel's (``kernel``:
    a key of ``KERNELS``; the caller checked it can run); returns the verdict. ``probe``: run ``head_probe`` now, where
    the model is; scripts/finetune.py installs without it and calls ``confirm`` once the Trainer has placed the model
    where it trains."""

    verdict = support(model, precision)
    base = causal_lm_of(model)
    if verdict.supported and kernel == "cce" and base.get_output_embeddings().bias is not None:
        verdict = Support(False, "its output head has a bias, which Cut Cross-Entropy does not take")
    if chunk is None and verdict.supported:  # the planner's rows: plan/activations.py counts one chunk's logits

        chunk = chunk_rows(base.get_output_embeddings().weight.shape[0])
    if verdict.supported and probe:
        verdict = head_probe(model, precision)
    verdict = _agreed(verdict)
    if not verdict.supported:
        return verdict
    original = base.forward

    @functools.wraps(original)  # its signature: the Trainer keeps the columns the model's forward names
    def forward(*args, **kwargs):
        # the model's own forward, as called, unless it is given labels by keyword and asked for nothing but the loss
        # (logits, hidden states or attentions, a labels shift of its own: context parallelism's shift_labels)
        own = (args or kwargs.get("labels") is None or kwargs.get("output_hidden_states") or kwargs.get("output_attentions")
               or "shift_labels" in kwargs or kwargs.get("return_dict") is False)
        if own:
            return original(*args, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        labels = kwargs.pop("labels")
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        outputs = base.get_decoder()(**kwargs)
        loss = chunked_loss(base, outputs[0], labels, num_items_in_batch, chunk, kernel)
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(outputs, "past_key_values", None))

    base._hf_gpu_train_original_forward = original
    base.forward = forward
    base._hf_gpu_train_chunked_loss = chunk
    if kernel:
        return Support(True, f"the head's matmul and the loss fused by {KERNELS[kernel][1]}'s kernel, rows with a label only")
    return verdict


def _agreed(verdict: Support) -> Support:
    """One decision on every rank (only some may be able to run the probe): ranks with the model's own head beside
    ranks with the chunked one would train other gradients."""

    return Support(*agreed(verdict.supported, verdict.reason, "every rank keeps the model's own head"))


def installed(model) -> bool:
    return hasattr(causal_lm_of(model), "_hf_gpu_train_original_forward")


def uninstall(model) -> None:
    """The model's own forward again."""
    base = causal_lm_of(model)
    original = base.__dict__.pop("_hf_gpu_train_original_forward", None)
    if original is None:
        return
    if getattr(original, "__func__", None) is getattr(type(base), "forward", None) and getattr(original, "__self__", None) is base:
        base.__dict__.pop("forward", None)  # the class's own forward
    else:
        base.forward = original
    base.__dict__.pop("_hf_gpu_train_chunked_loss", None)


def confirm(model, precision: str | None = None) -> Support | None:
    """``head_probe`` on a model with the chunked head installed, where it trains now (call it once the Trainer has
    placed the model), agreed across ranks; a refused head is taken off again. None when no head is installed."""
    if not installed(model):
        return None
    verdict = _agreed(head_probe(model, precision))
    if not verdict.supported:
        uninstall(model)
    return verdict
