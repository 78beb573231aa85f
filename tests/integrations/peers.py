"""The peers of the integration matrix, small enough for 2 CPU cores: a word-level tokenizer, a tiny Llama, and
the trainers people use (the plain Trainer, a subclass whose ``compute_loss`` issues collectives of its own,
``Seq2SeqTrainer``, TRL's ``SFTTrainer``, ``DPOTrainer`` and ``GRPOTrainer``), each built the way its docs show.

No dropout anywhere (a split batch would draw other masks), so a run split by the OOM recovery must equal the
run that was not split, within fp32 reduction order (``tests/scaling/equivalence.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

WORDS = ("what is plus minus times it the answer yes no good bad right wrong one two three four five six seven eight "
         "nine ten ? . ,").split()
ADAM_EPSILON = 1e-6
MAX_STEPS = 3


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[BOS]", "[EOS]", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]")


def llama(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                        eos_token_id=tok.eos_token_id, tie_word_embeddings=False))


NUMBERS = WORDS[WORDS.index("one"):WORDS.index("ten") + 1]


def prompt_completion(n: int = 48) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = NUMBERS[i % 5], NUMBERS[(i * 3) % 5]
        length = 1 + (i * i + i // 3) % 5  # completions of different lengths: every batch (and rank) has its own token count
        rows.append({"prompt": f"what is {a} plus {b} ?", "completion": " it is " + " ".join(NUMBERS[: length]) + " ."})
    return rows


def preferences(n: int = 48) -> list[dict]:
    return [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": " no it is wrong" + " bad" * (i % 3)}
            for i, r in enumerate(prompt_completion(n))]


def lora(task: str = "CAUSAL_LM"):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type=task)


def subclass_with_collectives():
    """A Trainer subclass whose ``compute_loss`` gathers the loss and all-reduces a token count on every call (as
    TRL's do), and keeps tallies of its own."""
    from transformers import Trainer

    class CollectiveTrainer(Trainer):
        hf_gpu_train_state = ("calls", "tokens_seen")  # its own tallies: put back when a step runs again

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls = 0
            self.tokens_seen = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            result = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            loss = result[0] if return_outputs else result
            self.accelerator.gather_for_metrics(loss.detach().reshape(1))
            if dist.is_available() and dist.is_initialized():
                count = inputs["attention_mask"].sum().reshape(1).clone()
                dist.all_reduce(count)
                self.tokens_seen += int(count.item())
            else:
                self.tokens_seen += int(inputs["attention_mask"].sum())
            self.calls += 1
            return result

    return CollectiveTrainer


class CausalRows(torch.utils.data.Dataset):
    """Right-padded prompt+completion token rows (labels -100 on padding): for the Trainer and its subclasses."""

    def __init__(self, tok, seq: int = 16):
        self.rows = []
        for row in prompt_completion():
            ids = tok(row["prompt"] + row["completion"])["input_ids"][:seq]
            pad = seq - len(ids)
            self.rows.append({"input_ids": torch.tensor(ids + [tok.pad_token_id] * pad),
                              "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                              "labels": torch.tensor(ids + [-100] * pad)})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def common_args(out: str, per_device: int, accumulation: int = 1, **overrides) -> dict:
    return dict(dict(output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
                     gradient_accumulation_steps=accumulation,
                     max_steps=MAX_STEPS, learning_rate=1e-2,
                     lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                     disable_tqdm=True, seed=0, data_seed=0, adam_epsilon=ADAM_EPSILON, bf16=False), **overrides)


def build(kind: str, out: str, per_device: int, accumulation: int = 1, **overrides):
    """(trainer, model): the peer ``kind`` as its documentation builds it, on the tiny Llama. ``overrides``: training
    arguments of the plain Trainer, its subclass and Seq2SeqTrainer (given when it is built: accelerate reads some then)."""
    from datasets import Dataset

    tok = tokenizer()
    model = llama(tok)
    if kind in ("Trainer", "subclass", "Seq2SeqTrainer"):
        from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

        cls = {"Trainer": Trainer, "subclass": subclass_with_collectives(), "Seq2SeqTrainer": Seq2SeqTrainer}[kind]
        args_cls = Seq2SeqTrainingArguments if kind == "Seq2SeqTrainer" else TrainingArguments
        rows = CausalRows(tok)
        trainer = cls(model=model, args=args_cls(**common_args(out, per_device, accumulation, **overrides)), train_dataset=rows,
                      eval_dataset=torch.utils.data.Subset(rows, range(16)))
    elif kind == "SFTTrainer":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**common_args(out, per_device, accumulation), max_length=32, gradient_checkpointing=False)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(prompt_completion()),
                             eval_dataset=Dataset.from_list(prompt_completion(16)), processing_class=tok, peft_config=lora())
    elif kind == "DPOTrainer":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common_args(out, per_device, accumulation), max_length=32, gradient_checkpointing=False)
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(preferences()), processing_class=tok,
                             peft_config=lora())
    elif kind == "GRPOTrainer":
        from trl import GRPOConfig, GRPOTrainer

        def reward_length(completions, **kwargs):
            return [float(len(c.split())) for c in completions]

        common = common_args(out, per_device, accumulation)
        args = GRPOConfig(**common, num_generations=2, max_completion_length=6, gradient_checkpointing=False)
        prompts = [{"prompt": r["prompt"]} for r in prompt_completion()]
        trainer = GRPOTrainer(model=model, args=args, reward_funcs=reward_length, train_dataset=Dataset.from_list(prompts),
                              processing_class=tok, peft_config=lora())
    elif kind in FAMILIES:
        trainer = family_trainer(kind, out, per_device, accumulation)
    else:
        raise ValueError(kind)
    return trainer


# the families whose losses average over other things than a causal LM's (tests/oom/families.py): an
# encoder-decoder in Seq2SeqTrainer evaluated with generation, token classification and masked LM (means over labelled
# tokens), a vision model in a plain Trainer (ViT: its loss is normalised by num_items_in_batch), and a mixture-of-experts
# causal LM whose loss adds its router's load-balancing term, computed over the whole batch (Mixtral)
FAMILIES = {"T5Seq2Seq": "t5", "TokenClassification": "token", "MaskedLM": "mlm", "ViT": "vit", "MoECausalLM": "moe"}


def family_trainer(kind: str, out: str, per_device: int, accumulation: int = 1):
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

    from tests.oom.families import Rows, model

    family = FAMILIES[kind]
    rows = Rows(family, n=48)
    common = common_args(out, per_device, accumulation)
    if family == "t5":
        args = Seq2SeqTrainingArguments(**common, predict_with_generate=True, generation_max_length=30)
        cls = Seq2SeqTrainer
    else:
        args, cls = TrainingArguments(**common), Trainer
    return cls(model=model(family), args=args, train_dataset=rows, eval_dataset=torch.utils.data.Subset(rows, range(16)))
