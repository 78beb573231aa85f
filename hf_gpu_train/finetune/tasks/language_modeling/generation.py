"""A few held-out prompts answered before and after training: what the loss curve means, in words.

The prompts are the first ``generation_samples`` rows of the validation split, cut where the model should take
over: a conversation before its last assistant turn (rendered with the generation prompt), a prompt without its
completion, or a text's first half (at most 32 tokens). Greedy decoding, ``generation_max_new_tokens`` new tokens,
with the KV cache; the same token ids as training would see (chat rendered by the template, no special tokens
added; a plain prompt tokenized as in training). The reference answer is kept beside them.

Written to ``output_dir/generations.json`` and as a section of ``report.md``. Generated on the main process only,
with the unwrapped model; skipped under FSDP and DeepSpeed, where every process holds only a shard of the weights.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ....report.generations import GENERATIONS
from ....report.writer import render_report
from ...fsdp import is_sharded
from .chat import render
from .data import CHAT, TEXT, CausalLMData
from .options import CausalLMOptions

log = logging.getLogger("hf_gpu_train.finetune")
TEXT_PROMPT_TOKENS = 32


@dataclass(frozen=True)
class Prompt:
    input_ids: list[int]
    shown: str  # what the report shows as the prompt
    reference: str  # the held-out answer


def _conversation_prompt(messages: list[dict], tokenizer, max_length: int) -> Prompt | None:
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if not last:  # no assistant turn, or only one that opens the conversation
        return None
    ids = tokenizer(render(tokenizer, messages[:last], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    return Prompt(ids, str(messages[last - 1]["content"]), str(messages[last]["content"])) if len(ids) < max_length else None


def pick_prompts(data: CausalLMData, tokenizer, options: CausalLMOptions) -> list[Prompt]:
    prompts: list[Prompt] = []
    for row in data.validation:
        if len(prompts) >= options.generation_samples:
            break
        form = data.form
        if form.kind == CHAT:
            prompt = _conversation_prompt(list(row[options.messages_column]), tokenizer, options.max_length)
        elif form.conversational:
            prompt = _conversation_prompt(list(row[options.prompt_column]) + list(row[options.completion_column])[:1], tokenizer,
                                          options.max_length)
        elif form.kind == TEXT:
            ids = tokenizer(str(row[options.text_column] or ""))["input_ids"]
            cut = min(len(ids) // 2, TEXT_PROMPT_TOKENS)
            prompt = Prompt(ids[:cut], tokenizer.decode(ids[:cut], skip_special_tokens=True),
                            tokenizer.decode(ids[cut:cut + options.generation_max_new_tokens], skip_special_tokens=True)) if cut else None
        else:
            ids = tokenizer(str(row[options.prompt_column]))["input_ids"]
            prompt = Prompt(ids, str(row[options.prompt_column]), str(row[options.completion_column])) if len(ids) < options.max_length else None
        if prompt is not None:
            prompts.append(prompt)
    return prompts


def generate(model, tokenizer, prompts: list[Prompt], max_new_tokens: int) -> list[str]:
    """Greedy answers to ``prompts`` in one left-padded batch."""

    import torch

    device = next(model.parameters()).device
    width = max(len(p.input_ids) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p.input_ids)) + p.input_ids for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p.input_ids)) + [1] * len(p.input_ids) for p in prompts], device=device)
    config = copy.deepcopy(model.generation_config)
    config.update(do_sample=False, temperature=None, top_p=None, top_k=None, max_new_tokens=max_new_tokens,
                  pad_token_id=pad, use_cache=True)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
    finally:
        model.train(was_training)
    return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out]


class GenerationSamples:
    """The prompts, and what the model said to them before and after training."""

    def __init__(self, options: CausalLMOptions, output_dir: str, prompts: list[Prompt], tokenizer):
        self.max_new_tokens = options.generation_max_new_tokens
        self.output_dir = output_dir
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.before: list[str] | None = None
        self.after: list[str] | None = None

    def _runs_here(self, trainer) -> bool:

        if not self.prompts or not trainer.is_world_process_zero():
            return False
        if is_sharded(trainer) or trainer.is_deepspeed_enabled:
            log.warning("hf_gpu_train: generation samples are skipped: the weights are sharded across processes")
            return False
        return True

    def _generate(self, trainer) -> list[str] | None:
        if not self._runs_here(trainer):
            return None
        model = trainer.accelerator.unwrap_model(trainer.model)
        return generate(model, self.tokenizer, self.prompts, self.max_new_tokens)

    def generate_before(self, trainer) -> None:
        self.before = self._generate(trainer)

    def generate_after(self, trainer) -> Path | None:
        """The answers after training, written with the earlier ones to generations.json and report.md."""
        self.after = self._generate(trainer)
        if self.after is None:
            return None
        records = [{"prompt": p.shown, "reference": p.reference, "before": b, "after": a}
                   for p, b, a in zip(self.prompts, self.before or [None] * len(self.prompts), self.after)]
        out = Path(self.output_dir)
        path = out / GENERATIONS
        path.write_text(json.dumps({"max_new_tokens": self.max_new_tokens, "decoding": "greedy",
                                    "samples": records}, indent=2, ensure_ascii=False))
        if (out / "report.md").is_file():  # telemetry wrote a report: draw it again with this section

            render_report(out)
        return path
