"""What one training step looks like to the memory planner: batch, sequence, precision, optimizer, method."""

from __future__ import annotations

from dataclasses import dataclass

# full: every weight trains (fp32 master weights under mixed precision); lora: peft adapters on a frozen base
# held in the compute dtype; qlora: adapters on a base whose linear weights bitsandbytes stores in 4-bit NF4.
METHODS = ("full", "lora", "qlora")
DEFAULT_LORA_RANK = 16  # the finetune config's lora_r default (hf_gpu_train/finetune/config.py)


@dataclass(frozen=True)
class TrainingShape:
    micro_batch: int = 1
    seq_len: int = 512
    image_size: int = 224
    precision: str = "bf16"  # bf16 | fp16 | fp32: the compute dtype (autocast for bf16/fp16)
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    num_gpus: int = 1
    attention: str = "sdpa"  # sdpa | eager
    method: str = "full"  # full | lora | qlora
    lora_rank: int = DEFAULT_LORA_RANK
    # Padded batches carry an attention mask: transformers then expands grouped key/value heads to every
    # query head before SDPA (``integrations.sdpa_attention.use_gqa_in_sdpa`` is False with a mask) and SDPA
    # turns the boolean mask into one in the query dtype per layer. Packed, padding-free batches do neither.
    padded: bool = True
    # The LM head and its loss in chunks of labelled rows (finetune/tasks/language_modeling/lm_head_loss.py; the entry point's
    # default for causal LMs): no full logits, see activations.activation_terms.
    chunked_loss: bool = False
    loss_chunk: int | None = None  # rows of the chunked head at a time; None: ``chunk_rows`` of the model's vocabulary
    # With gradient_checkpointing: which layers and what they keep (finetune config ``checkpoint_layers``): "all"
    # (each layer keeps its input), "every-N" (every N-th layer checkpointed, the others keep everything),
    # "selective" (each layer keeps its matmuls' and attention's outputs) or "selective-lean" (attention's and the
    # narrowing projections' outputs only: levers/selective_checkpoint.py).
    checkpoint_layers: str = "all"
    # Saved activations held in pinned host memory (levers/activation_offload.py): the GPU keeps one layer's.
    offload_activations: bool = False
    # Each parameter stepped as its gradient is ready (levers/optimizer_in_backward.py): one layer's gradients.
    optimizer_in_backward: bool = False

    def checkpointed_layers(self, layers: int) -> int:
        """How many of ``layers`` are checkpointed (transformers' ``every_n_layers``: indices 0, N, 2N, ...)."""
        if not self.gradient_checkpointing:
            return 0
        return -(-layers // checkpoint_every(self.checkpoint_layers)) if self.checkpoint_layers.startswith("every-") else layers

    @property
    def compute_bytes(self) -> int:
        """Bytes of one activation element: 2 under bf16/fp16 autocast, 4 in fp32."""
        return 2 if self.precision in ("bf16", "fp16") else 4


SELECTIVE_POLICIES = ("selective", "selective-lean")
# attention implementations whose kernels the selective policies keep (levers/selective_checkpoint.SAVED_OPS: SDPA's
# aten kernels; eager attention is matmuls and a softmax). flash-attn's and flex attention's kernels are other ops,
# which the policies would recompute, the one thing they exist not to recompute, while the planner counts them as kept.
ATTENTION_KEPT = ("sdpa", "eager")
CHUNK_LOGITS_BYTES = 64 * 2**20  # the fp32 logits of one chunk of the head at most (its gradient is as large again)
CHUNK_ROWS_RANGE = (128, 1024)


def chunk_rows(vocab_size: int | None) -> int:
    """Rows of the chunked LM head at a time: the largest power of two whose fp32 logits stay within
    ``CHUNK_LOGITS_BYTES`` (48 MiB for a 49k vocabulary at 256 rows, 63 MiB for 128k at 128), kept in
    ``CHUNK_ROWS_RANGE``: a matmul of 128 rows against the head is still efficient, the loss's transient stays small."""
    low, high = CHUNK_ROWS_RANGE
    if not vocab_size:
        return high
    rows = high
    while rows > low and rows * vocab_size * 4 > CHUNK_LOGITS_BYTES:
        rows //= 2
    return rows


def checkpoint_every(policy: str) -> int:
    """N of "every-N" (1 for "all" and the selective policies); ValueError for anything else."""
    if policy == "all" or policy in SELECTIVE_POLICIES:
        return 1
    head, _, count = policy.partition("-")
    if head != "every" or not count.isdigit() or int(count) < 2:
        raise ValueError(f"checkpoint_layers={policy!r}: use all, selective, selective-lean or every-N with N >= 2 (every-2: half "
                         "the layers)")
    return int(count)
