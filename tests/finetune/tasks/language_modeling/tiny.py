"""Fast stand-ins for a real causal LM: a byte-level BPE tokenizer trained in milliseconds on a fixed corpus, with
SmolLM2-135M-Instruct's chat template and special tokens, and a randomly initialised Llama of 2 layers of 32."""

from __future__ import annotations

import json
from pathlib import Path

# SmolLM2-135M-Instruct's chat template, as its tokenizer ships it (a default system prompt when there is none)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are "
    "a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
CORPUS = ["You are a helpful AI assistant named SmolLM, trained by Hugging Face", "system user assistant",
          "What is the capital of France? The capital of France is Paris.", "Name a prime number. Seven is prime.",
          "Return the sum of the numbers. Split the string at the separator and return a list of the parts.",
          "the quick brown fox jumps over the lazy dog 0 1 2 3 4 5 6 7 8 9"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(template: str | None = SMOLLM2_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                        unk_token="<|endoftext|>")
    tokenizer.chat_template = template
    return tokenizer


def tiny_llama(vocab_size: int, seed: int = 0, attn_implementation: str = "sdpa", layers: int = 2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=2, pad_token_id=2)
    config._attn_implementation = attn_implementation
    return LlamaForCausalLM(config).eval()


def save_tiny_model(folder: Path, template: str | None = SMOLLM2_TEMPLATE) -> Path:
    tokenizer = tiny_tokenizer(template)
    model = tiny_llama(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def chat_rows(count: int, offset: int = 0) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is the sum of {i} and {i % 7}?"},
                          {"role": "assistant", "content": f"The sum is {i + i % 7}."}]} for i in range(offset, offset + count)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_case(root: Path, train_rows: int, validation_rows: int, *settings: str) -> list[str]:
    """The key=value arguments of a causal-LM run on a saved tiny model and chat data written under ``root``."""
    model = save_tiny_model(root / "model")
    return [f"model={model}", f"train_file={write_jsonl(root / 'train.jsonl', chat_rows(train_rows))}",
            f"validation_file={write_jsonl(root / 'validation.jsonl', chat_rows(validation_rows, offset=100))}",
            "task=causal-lm", *settings]
