"""LoRA and QLoRA per-GPU memory for real model shapes, every number worked out by hand.

Shapes from configs alone (no weights): Llama-3-8B (hidden 4096, MLP 14336, 32 layers, 32 heads, 8 key/value
heads, vocabulary 128256, untied head) and SmolLM2-135M (hidden 576, MLP 1536, 30 layers, 9 heads, 3 key/value
heads, vocabulary 49152, tied embeddings), read through ``model_spec.from_config`` on the meta device.
"""

import pytest

from hf_gpu_train.plan.memory import CUDA_CONTEXT_BYTES, TrainingShape, estimate
from hf_gpu_train.plan.model_spec import ModelSpec, from_config
from hf_gpu_train.plan.peft_memory import QLORA_BYTES_PER_PARAM, adapter_params

LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}
SMOLLM2_135M = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}

# Llama-3-8B by hand. Per layer: q and o 4096x4096, k and v 4096x1024, gate/up/down 4096x14336.
L3_LAYER_LINEAR = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 4096 * 14336 * 3  # 218,103,808
L3_QUANTIZED = 32 * L3_LAYER_LINEAR  # 6,979,321,856: every linear weight but lm_head
L3_PARAMS = 2 * 128256 * 4096 + 32 * (L3_LAYER_LINEAR + 2 * 4096) + 4096  # embeddings, head, layers, norms = 8,030,261,248
# r(d_in + d_out) at r=16, per layer: q 8192, k 5120, v 5120, o 8192, gate/up/down 18432 each = 81,920
L3_ADAPTERS_R16 = 16 * 81920 * 32  # 41,943,040: peft's print_trainable_parameters for Llama-3-8B, r=16, all linear


@pytest.fixture(scope="module")
def llama3():
    return from_config(dict(LLAMA3_8B), name="llama-3-8b")


@pytest.fixture(scope="module")
def smollm2():
    return from_config(dict(SMOLLM2_135M), name="smollm2-135m")


def test_config_dict_read_on_meta_counts_what_lora_adapts_and_qlora_quantizes(llama3, smollm2):
    assert llama3.params == L3_PARAMS == 8_030_261_248  # Meta's published count for Llama-3-8B
    assert llama3.causal_lm and llama3.gated_mlp and not llama3.tied_embeddings
    assert (llama3.num_kv_heads, llama3.head_dim, llama3.kv_width) == (8, 128, 1024)
    assert adapter_params(llama3, 16) == L3_ADAPTERS_R16 == 41_943_040
    assert llama3.quantized_params == L3_QUANTIZED
    assert llama3.largest_linear_params == 4096 * 14336
    # SmolLM2-135M: per layer q,o 576x576, k,v 576x192, gate/up/down 576x1536; tied embeddings (one 49152x576)
    layer = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3  # 3,538,944
    assert smollm2.params == 49152 * 576 + 30 * (layer + 2 * 576) + 576 == 134_515_008
    assert smollm2.tied_embeddings and smollm2.quantized_params == 30 * layer
    # r=16: q (576+576), k and v (576+192) each, o (576+576), gate/up/down (576+1536) each = 10,176 per layer
    assert adapter_params(smollm2, 16) == 16 * 10176 * 30 == 4_884_480


def test_lora_breakdown_by_hand(llama3):
    shape = TrainingShape(micro_batch=1, seq_len=2048, precision="bf16", method="lora", lora_rank=16, gradient_checkpointing=True)
    b = estimate(llama3, shape, "single")
    A = L3_ADAPTERS_R16
    assert b.weights == 2 * L3_PARAMS  # frozen base in bf16
    assert (b.adapter_weights, b.gradients, b.optimizer, b.working_copies) == (4 * A, 4 * A, 8 * A, 2 * A)
    assert b.quantized_weights == b.master_weights == b.comm_buffers == b.gathered_params == 0
    # activations per token: checkpointed layer inputs 2h x 32 (bf16 residual); one layer recomputed:
    # norms 2(4h+4) = 32,776; adapter input copies 2(5h + 4096) = 49,152; down input 2I = 28,672;
    # SDPA, padded: 2(2*4096 + 2*4096) + 4*32 + 2*2048 = 36,992; MLP 3*2I = 86,016; adapters 2*16*7 = 224
    layer = 32776 + 49152 + 28672 + 36992 + 86016 + 224  # 233,832
    head = 4 * 4096 + 4  # the final norm (the frozen head keeps nothing)
    loss = 12 * 128256  # fp32 logits' peak per token
    assert b.activations == (2 * 4096 * 32 + layer + head + loss) * 2048
    assert b.total == 2 * L3_PARAMS + 18 * A + b.activations + CUDA_CONTEXT_BYTES
    assert 20.0 < b.total / 2**30 < 20.1  # 20.07 GiB: inside a 24 GB card's 22.1 usable, barely


def test_qlora_breakdown_by_hand(llama3):
    assert QLORA_BYTES_PER_PARAM * 8 == 4 + 8 / 64 + 32 / (64 * 256) == 4.126953125  # QLoRA paper, section 2: 4.127 bits
    shape = TrainingShape(micro_batch=1, seq_len=2048, precision="bf16", method="qlora", lora_rank=16, gradient_checkpointing=True)
    b = estimate(llama3, shape, "single")
    A = L3_ADAPTERS_R16
    assert b.quantized_weights == L3_QUANTIZED * (0.5 + 1 / 64 + 4 / 16384)  # 3.35 GiB
    assert b.weights == 4 * (L3_PARAMS - L3_QUANTIZED) == 4 * 1_050_939_392  # embeddings, head, norms in fp32
    # autocast copies of the adapters, the largest layer dequantized to bf16, the fp32 head's bf16 copy
    assert b.working_copies == 2 * A + 2 * 4096 * 14336 + 2 * 128256 * 4096
    # fp32 residual (4h per checkpointed layer); the MLP's three intermediates in fp32: 233,832 + 3*(4-2)*14336
    layer = 233832 + 86016
    assert b.activations == (4 * 4096 * 32 + layer + 4 * 4096 + 4 + 12 * 128256) * 2048
    assert 14.1 < b.total / 2**30 < 14.2


def test_fp32_lora_holds_the_base_in_fp32_and_no_autocast_copies(smollm2):
    b = estimate(smollm2, TrainingShape(micro_batch=2, seq_len=512, precision="fp32", method="lora", lora_rank=8), "single")
    assert b.weights == 4 * 134_515_008 and b.working_copies == 0
    assert b.adapter_weights == 4 * 8 * 10176 * 30


def test_ddp_buckets_only_the_adapters_and_sharding_is_refused(llama3):
    shape = TrainingShape(seq_len=1024, method="lora", num_gpus=2)
    assert estimate(llama3, shape, "ddp").comm_buffers == 4 * L3_ADAPTERS_R16
    with pytest.raises(ValueError, match="single or ddp"):
        estimate(llama3, shape, "fsdp")


def test_lora_needs_the_layers_not_a_parameter_count():
    with pytest.raises(ValueError, match="linear layers"):
        estimate(ModelSpec(name="7e9", params=7_000_000_000), TrainingShape(method="lora"), "single")
