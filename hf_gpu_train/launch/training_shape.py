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
    # The LM head and its loss in chunks of labelled rows (finetune/causal_lm/lm_head_loss.py; the entry point's
    # default for causal LMs): no full logits, see activations.activation_terms.
    chunked_loss: bool = False
    loss_chunk: int = 1024

    @property
    def compute_bytes(self) -> int:
        """Bytes of one activation element: 2 under bf16/fp16 autocast, 4 in fp32."""
        return 2 if self.precision in ("bf16", "fp16") else 4
