"""hf_gpu_train inside TRL's DPOTrainer (LoRA; the reference is the base model, by disabling the adapter): telemetry
counts training forwards only, and an OOM is recovered in micro-batches of whole chosen/rejected pairs.

    python examples/trl_dpo.py                                   # a tiny Llama, seconds on a CPU
    hf-gpu-train launch --config-file launch_configs/cpu-only.yaml examples/trl_dpo.py --inject-oom
"""

from __future__ import annotations

import torch
from common import arguments, maybe_inject_oom, model_and_tokenizer, preferences
from datasets import Dataset
from peft import LoraConfig
from trl import DPOConfig, DPOTrainer

from hf_gpu_train import attach_telemetry, enable_oom_recovery


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    model, tokenizer = model_and_tokenizer(args.model)
    config = DPOConfig(output_dir=args.output or "outputs/examples/trl_dpo", per_device_train_batch_size=4,
                       max_steps=args.max_steps, learning_rate=1e-3, logging_steps=2, save_strategy="no", report_to="none",
                       max_length=128, bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
                       use_cpu=not torch.cuda.is_available())
    trainer = DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(preferences()), processing_class=tokenizer,
                         peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                                task_type="CAUSAL_LM"))
    attach_telemetry(trainer)      # the two lines
    enable_oom_recovery(trainer)
    maybe_inject_oom(trainer, args.inject_oom)
    trainer.train()


if __name__ == "__main__":
    main()
