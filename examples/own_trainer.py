"""hf_gpu_train inside your own Trainer subclass: telemetry to your report_to sinks, and OOM recovery that keeps the
step and the effective batch, even when your compute_loss gathers across ranks.

    python examples/own_trainer.py                                   # one process, a tiny Llama, seconds on a CPU
    python examples/own_trainer.py --inject-oom                      # watch an out-of-memory error recovered in place
    hf-gpu-train launch --config-file launch_configs/cpu-only.yaml examples/own_trainer.py --inject-oom   # 2 processes
"""

from __future__ import annotations

import torch
from common import arguments, maybe_inject_oom, model_and_tokenizer, prompt_completion
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

from hf_gpu_train import attach_telemetry, enable_oom_recovery


class MyTrainer(Trainer):
    """A subclass with its own compute_loss that gathers a metric across ranks on every call, as many do."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        self.gathered_tokens = int(self.accelerator.gather_for_metrics(inputs["attention_mask"].sum().reshape(1)).sum())
        return result


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    model, tokenizer = model_and_tokenizer(args.model)
    rows = [tokenizer(r["prompt"] + r["completion"]) for r in prompt_completion()]
    trainer = MyTrainer(
        model=model,
        args=TrainingArguments(output_dir=args.output or "outputs/examples/own_trainer", per_device_train_batch_size=4,
                               max_steps=args.max_steps, learning_rate=1e-3, logging_steps=2, save_strategy="no",
                               report_to="none", use_cpu=not torch.cuda.is_available()),
        train_dataset=rows,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    attach_telemetry(trainer)      # the two lines
    enable_oom_recovery(trainer)
    maybe_inject_oom(trainer, args.inject_oom)
    trainer.train()


if __name__ == "__main__":
    main()
