"""One arm of benchmarks/overhead_in_trl.py, run under ``hf-gpu-train launch`` (every rank runs it).

    overhead_in_trl_probe.py OUT MODE STEPS      MODE: off | on | on-oom (an OOM on rank 1 at the 3rd step)

TRL's SFTTrainer with LoRA on a small Llama built from a config (4 layers, hidden 256, rows of up to 128 tokens),
fp32 on the CPU. Rank 0 writes OUT/MODE.json (steps/s of train(), global step, restarts) and OUT/MODE.pt (LoRA weights).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)

WORDS = [f"w{i}" for i in range(200)]


def tokenizer():
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[BOS]", "[EOS]", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]")


def rows(n: int = 256) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        prompt, completion = (int(x) for x in torch.randint(10, 60, (2,), generator=g))
        words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (prompt + completion,), generator=g)]
        out.append({"prompt": " ".join(words[:prompt]), "completion": " " + " ".join(words[prompt:])})
    return out


def main() -> None:
    out, mode, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    tok = tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                         pad_token_id=0, bos_token_id=2, eos_token_id=3))
    args = SFTConfig(output_dir=str(out / mode), per_device_train_batch_size=8, max_steps=steps, learning_rate=1e-3,
                     logging_steps=5, save_strategy="no", report_to="none", use_cpu=True, bf16=False, max_length=128,
                     disable_tqdm=True, seed=0, data_seed=0, gradient_checkpointing=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows()), processing_class=tok,
                         peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                                task_type="CAUSAL_LM"))
    recovery = None
    if mode != "off":
        from hf_gpu_train import attach_telemetry, enable_oom_recovery

        attach_telemetry(trainer, write_report=False)
        recovery = enable_oom_recovery(trainer)
    if mode == "on-oom":
        from hf_gpu_train.oom import OOMFaultInjector

        OOMFaultInjector(max_batch=4, rank=1, phase="forward", times=1, start_after=2).install(trainer.model)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    if trainer.accelerator.is_main_process:
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        torch.save({n: p.detach().clone() for n, p in unwrapped.named_parameters() if p.requires_grad}, out / f"{mode}.pt")
        (out / f"{mode}.json").write_text(json.dumps({
            "steps_per_second": trainer.state.global_step / seconds, "global_step": trainer.state.global_step,
            "restarts": recovery.restarts if recovery else 0, "micro_batch": recovery.micro_batch if recovery else None,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}))
    from hf_gpu_train.process_group import leave_process_group

    leave_process_group()


if __name__ == "__main__":
    main()
