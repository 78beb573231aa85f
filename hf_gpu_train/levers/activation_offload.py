"""Activation offloading: what autograd saves in the forward is held in pinned host memory until the backward needs it.

Through ``torch.autograd.graph.saved_tensors_hooks``: each saved CUDA tensor of at least ``min_bytes`` (not a
parameter, nor a view of one) is copied to pinned host memory on a side stream, so the copy overlaps the next
kernels; the GPU tensor's memory is reused once its copy has finished (``record_stream``), and the backward copies it back just before use.
With gradient checkpointing, what the forward saves is each layer's input (the rest is recomputed inside the
checkpoint): offloading then moves the last per-layer term off the GPU. Without checkpointing it moves every
layer's activations. Either way the GPU keeps about one layer's worth, and the host needs room for the rest
(the planner counts both: ``plan/activations.py``).

transformers' ``activation_checkpointing_kwargs={"offload": true}`` does the checkpointed half with
``torch.autograd.graph.save_on_cpu``, whose copies run on the compute stream and stall it; torchtune's
``OffloadActivations`` is the side-stream design this follows.

Exact: a copy out and back is bitwise the same tensor (tests/levers/test_memory_levers.py runs the copy path on
the CPU, with ``offload_cpu_tensors``; the GPU saving is measured by ``scripts/gpu_check.py``). On a CPU run the
activations already live in host memory: ``attach`` says so and does nothing. The copies back are made on the compute
stream when the backward needs each tensor (no prefetch): the planner counts them as never hidden
(``plan/lever_table.py``). Not beside FSDP or DeepSpeed, whose gathered parameters the hooks would copy too.
"""

from __future__ import annotations

import functools

import torch
from torch.multiprocessing.reductions import StorageWeakRef

MIN_BYTES = 1 << 20  # smaller tensors (norm statistics, masks) are not worth a copy and a stream sync
# Tests only: a CPU run of scripts/finetune.py takes the copy path (``offload_cpu_tensors``) for saved tensors of at
# least this many bytes, so a multi-process test proves offloading through the entry point, not a message. Not for
# users: on the CPU there is nothing to gain.
TEST_CPU_MIN_BYTES_ENV = "HF_GPU_TRAIN_TEST_OFFLOAD_CPU_MIN_BYTES"
MAX_PENDING_COPIES = 64  # copies in flight before the forward waits for the oldest: bounds what stays on the GPU


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """The saved-tensor hooks; ``offloaded_bytes`` counts what went to the host in this context's forwards."""

    def __init__(self, parameters=(), min_bytes: int = MIN_BYTES, offload_cpu_tensors: bool = False):
        self.min_bytes = min_bytes
        self.offload_cpu_tensors = offload_cpu_tensors  # tests: the copy path on a machine without a GPU
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self.offloaded_bytes = 0
        self._stream = None
        self._copies: dict[tuple, tuple] = {}
        self._pending: list = []  # copy-done events, oldest first
        super().__init__(self._pack, self._unpack)

    def _offloads(self, t: torch.Tensor) -> bool:
        if t.device.type != "cuda" and not (self.offload_cpu_tensors and t.device.type == "cpu"):
            return False
        if isinstance(t, torch.nn.Parameter) or t.untyped_storage().data_ptr() in self.parameter_storages:
            return False
        if getattr(t, "_hf_gpu_train_keep_on_device", False):  # the chunked LM head's gradients (lm_head_loss.py)
            return False
        return t.numel() * t.element_size() >= self.min_bytes

    def _pack(self, t: torch.Tensor):
        if not self._offloads(t):
            return t
        # a tensor saved by several nodes (a norm's output feeds the q, k and v projections) is copied once
        # (while its storage lives: a freed storage's address is reused by the next allocation)
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
        alive, packed = self._copies.get(key, (None, None))
        if alive is not None and not alive.expired():
            return packed
        packed = self._copy(t)
        self._copies[key] = (StorageWeakRef(storage), packed)
        return packed

    def _copy(self, t: torch.Tensor):
        self.offloaded_bytes += t.numel() * t.element_size()
        if t.device.type == "cpu":
            return (t.device, t.clone(), None)
        if self._stream is None:
            self._stream = torch.cuda.Stream(t.device)
        self._stream.wait_stream(torch.cuda.current_stream(t.device))  # t was made on the compute stream
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        with torch.cuda.stream(self._stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        t.record_stream(self._stream)  # the allocator keeps t's memory until the side stream's copy is done
        # back-pressure: a forward that outruns PCIe would keep every pending tensor alive; wait for the oldest copy
        self._pending.append(done)
        if len(self._pending) > MAX_PENDING_COPIES:
            self._pending.pop(0).synchronize()
        return (t.device, host, done)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, done = packed
        if done is None:
            return host
        torch.cuda.current_stream(device).wait_event(done)
        return host.to(device, non_blocking=True)


def _innermost(model):
    inner = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def attach(model, on_cuda: bool, min_bytes: int = MIN_BYTES, offload_cpu_tensors: bool = False) -> str:
    """Every training forward of ``model`` (its innermost transformers or timm module, so a peft or DDP wrapper runs
    it) under ``OffloadActivations``; the line to print. ``on_cuda``: the run trains on CUDA (the model may not be on
    the GPU yet: the Trainer moves it in train())."""
    target = _innermost(model)
    if not on_cuda and not offload_cpu_tensors:
        return "activation offloading: nothing to do on the CPU (the activations are in host memory already)"
    forward = target.forward

    @functools.wraps(forward)
    def offloading_forward(*args, **kwargs):
        if not (target.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        # the parameters' storages as they are now: moving the model to the GPU gives every parameter a new one
        hooks = OffloadActivations(target.parameters(), min_bytes, offload_cpu_tensors)
        with hooks:
            out = forward(*args, **kwargs)
        target._hf_gpu_train_offloaded_bytes = hooks.offloaded_bytes
        return out

    offloading_forward._hf_gpu_train_original = forward
    target.forward = offloading_forward
    target._hf_gpu_train_offloads_activations = True
    return f"activation offloading: saved activations of {min_bytes >> 20} MiB and more go to pinned host memory on a side stream"


def offloaded_bytes(model) -> int | None:
    """What the last training forward of ``model`` sent to host memory (None: offloading is not attached)."""
    target = _innermost(model)
    if not getattr(target, "_hf_gpu_train_offloads_activations", False):
        return None
    return int(getattr(target, "_hf_gpu_train_offloaded_bytes", 0))


def detach(model) -> bool:
    """Take ``attach``'s forward off again (tune's trials share one model); whether it was on."""
    target = _innermost(model)
    original = getattr(target.__dict__.get("forward"), "_hf_gpu_train_original", None)
    if original is None:
        return False
    if getattr(original, "__func__", None) is getattr(type(target), "forward", None) and getattr(original, "__self__", None) is target:
        del target.forward  # the class's own forward again
    else:
        target.forward = original
    target._hf_gpu_train_offloads_activations = False
    return True
