"""What a causal-LM run leaves in ``output_dir`` beyond the Trainer's files: perplexity beside the eval loss, and
for adapters the merged model on request.

The adapter itself (``adapter_config.json`` + ``adapter_model.safetensors``) is what the Trainer's ``save_model``
writes for a PeftModel, and what its checkpoints hold, so a run resumes from them. ``merge_adapter=true`` also
writes ``output_dir/merged``: the base model with the adapter added into its weights (``merge_and_unload``) and the
tokenizer, loadable with ``AutoModelForCausalLM.from_pretrained`` without peft. A QLoRA adapter is merged into the
base reloaded in the compute dtype (bf16/fp16), not into its 4-bit copy: adding an update to NF4 weights would round
it away.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from ...fsdp import is_sharded

log = logging.getLogger("hf_gpu_train.finetune")
MERGED_DIR = "merged"


def with_perplexity(metrics: dict) -> dict:
    """``eval_perplexity = exp(eval_loss)``. The Trainer's eval loss is each evaluation batch's token cross-entropy (nats
    per token) averaged over batches weighted by their rows: the per-token mean when batches hold similar token counts
    (packed rows), close to it when padded."""
    if "eval_loss" not in metrics:
        return metrics
    loss = float(metrics["eval_loss"])
    return {**metrics, "eval_perplexity": math.exp(loss) if loss < 700 else float("inf")}


def merge_and_save(merge_adapter: bool, method: str, output_dir: str, trainer, tokenizer, base_path: str,
                   dtype) -> Path | None:
    """Save base + adapter merged into ``output_dir/merged`` (main process); None when there is nothing to merge."""
    if not merge_adapter:
        return None

    if is_sharded(trainer):
        log.warning("hf_gpu_train: merge_adapter=true is skipped under FSDP (the adapter is sharded); merge afterwards with "
                    "peft: PeftModel.from_pretrained(base, %s).merge_and_unload()", output_dir)
        return None
    if not trainer.is_world_process_zero():
        return None
    target = Path(output_dir) / MERGED_DIR
    model = trainer.accelerator.unwrap_model(trainer.model)
    if method == "qlora":
        model = _reload_with_adapter(base_path, output_dir, dtype)
    merged = model.merge_and_unload()
    merged.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def _reload_with_adapter(base_path: str, adapter_dir: str, dtype):
    """The base in ``dtype`` on the CPU with the saved adapter: the QLoRA merge target."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    return PeftModel.from_pretrained(base, adapter_dir)
