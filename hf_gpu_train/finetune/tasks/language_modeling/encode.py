"""Rows -> ``input_ids`` and ``labels`` (``-100``: no loss), once, truncated to ``max_length`` and counted.

- chat: the conversation as the chat template renders it, tokenized once (the template writes the special tokens,
  so none are added); labels on the assistant turns (``completion_only_loss``), found by ``chat.assistant_spans``;
- prompt + completion: ``tokenizer(prompt)`` then ``tokenizer(completion)`` and the end-of-sequence token, joined
  as ids, not as text: generation sees exactly these prompt tokens and continues from them, so the boundary is the
  one training learnt (a joined string can merge the prompt's last characters with the completion's first);
  conversational ones are a chat ``prompt + completion`` with the loss on the completion's messages;
- text: ``tokenizer(text)`` and the end-of-sequence token, loss on every token.

An example longer than ``max_length`` keeps its first ``max_length`` tokens (and is counted). One with no token
left to learn (its prompt fills ``max_length``; the first token is never a target, there is nothing before it) is
dropped and counted. Empty completions are an error: a model trained on them learns to say nothing; empty plain
texts are dropped with a note (text corpora hold blank lines).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...config import ConfigError
from .chat import assistant_spans, labels_from_spans, render
from .data import CHAT, TEXT, Form
from .options import CausalLMOptions

IGNORE = -100
PARALLEL_ROWS = 20_000  # tokenize in several processes above this many rows


@dataclass(frozen=True)
class EncodingReport:
    rows: int
    truncated: int
    dropped: int  # no token left to learn after truncation
    empty: int  # empty plain texts, dropped
    longest_prompt: int  # tokens before the first learnt one, over the dropped rows (0 when none was dropped)

    def notes(self, split: str, max_length: int) -> list[str]:
        said = []
        if self.truncated:
            said.append(f"{self.truncated} of {self.rows} {split} examples are longer than max_length={max_length} tokens and "
                        "were truncated to their first max_length tokens (raise max_length to keep them whole)")
        if self.dropped:
            said.append(f"{self.dropped} {split} examples were dropped: nothing to learn within max_length={max_length} "
                        f"(a prompt of up to {self.longest_prompt} tokens)")
        if self.empty:
            said.append(f"{self.empty} empty {split} texts were dropped")
        return said


def _eos(tokenizer) -> list[int]:
    if tokenizer.eos_token_id is None:
        raise ConfigError("the tokenizer has no end-of-sequence token, so a trained model could not learn to stop: "
                          "use a model whose tokenizer defines eos_token")
    return [tokenizer.eos_token_id]


def _messages(row: dict, form: Form, options: CausalLMOptions) -> tuple[list[dict], list[int]]:
    """The conversation, and the indices of the messages the loss is on."""
    if form.kind == CHAT:
        messages = list(row[options.messages_column])
        trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    else:
        prompt, completion = list(row[options.prompt_column]), list(row[options.completion_column])
        messages = prompt + completion
        trained = list(range(len(prompt), len(messages)))
    return messages, trained


def _chat_batch(rows: list[dict], tokenizer, form: Form, options: CausalLMOptions) -> list[dict]:
    conversations = [_messages(row, form, options) for row in rows]
    empty = [not trained or any(not str(messages[i]["content"] or "").strip() for i in trained)
             for messages, trained in conversations]
    if not options.completion_only_loss:  # every token: no spans to find
        texts = [render(tokenizer, messages) for messages, _ in conversations]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [{"input_ids": x, "labels": list(x), "empty": e} for x, e in zip(ids, empty)]
    rendered = [assistant_spans(tokenizer, messages, trained) for messages, trained in conversations]
    encoded = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for ids, offsets, (_, spans), e in zip(encoded["input_ids"], encoded["offset_mapping"], rendered, empty):
        labels = [t if keep else IGNORE for t, keep in zip(ids, labels_from_spans(offsets, spans))]
        out.append({"input_ids": ids, "labels": labels, "empty": e})
    return out


def encode_rows(rows: list[dict], tokenizer, form: Form, options: CausalLMOptions) -> list[dict]:
    """Rows -> ids, labels (untruncated) and whether each completion is empty; the tokenizer runs once per batch."""
    if form.uses_chat_template:
        return _chat_batch(rows, tokenizer, form, options)
    eos = _eos(tokenizer)
    if form.kind == TEXT:
        texts = [str(row[options.text_column] or "") for row in rows]
        ids = tokenizer([t if t.strip() else "" for t in texts])["input_ids"]
        return [{"input_ids": x + eos if t.strip() else [], "labels": x + eos if t.strip() else [], "empty": not t.strip()}
                for x, t in zip(ids, texts)]
    prompts = tokenizer([str(row[options.prompt_column] or "") for row in rows])["input_ids"]
    completions = [str(row[options.completion_column] or "") for row in rows]
    answers = tokenizer(completions, add_special_tokens=False)["input_ids"]
    out = []
    for prompt_ids, answer_ids, completion in zip(prompts, answers, completions):
        prompt_labels = [IGNORE] * len(prompt_ids) if options.completion_only_loss else list(prompt_ids)
        out.append({"input_ids": prompt_ids + answer_ids + eos, "labels": prompt_labels + answer_ids + eos,
                    "empty": not completion.strip()})
    return out


def truncate(encoded: dict, max_length: int) -> dict:
    ids, labels = encoded["input_ids"], encoded["labels"]
    learnable = sum(1 for label in labels[1:max_length] if label != IGNORE)  # position 0 is never a target
    first = next((i for i, label in enumerate(labels) if label != IGNORE), len(labels))
    return {"input_ids": ids[:max_length], "labels": labels[:max_length], "truncated": len(ids) > max_length,
            "learnable": learnable, "prompt_tokens": first}


def _columns_error(form: Form, options: CausalLMOptions, split: str, empty: list[int], rows: int) -> ConfigError:
    what = {CHAT: "assistant message (or none at all)"}.get(form.kind, "completion")
    column = form.columns[-1]
    return ConfigError(f"{len(empty)} of {rows} {split} rows have an empty {what} in column {column!r} (first: row {empty[0]}): "
                       "a model trained on them learns to answer with nothing; fill or drop those rows")


def tokenizing_processes() -> int | None:
    """This process's share of its CPUs (every training process on the machine tokenizes at once), at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return min(8, share) if share > 1 else None


def encode_split(ds, tokenizer, form: Form, options: CausalLMOptions, split: str):
    """(tokenized dataset with ``input_ids``, ``labels``; EncodingReport). ConfigError for empty completions and for a
    split where no example keeps a token to learn."""

    def encode(batch):
        out = {"input_ids": [], "labels": [], "empty": [], "truncated": [], "learnable": [], "prompt_tokens": []}
        rows = [{name: batch[name][i] for name in form.columns} for i in range(len(batch[form.columns[0]]))]
        for encoded in encode_rows(rows, tokenizer, form, options):
            cut = truncate(encoded, options.max_length)
            for key in out:
                out[key].append(encoded["empty"] if key == "empty" else cut[key])
        return out

    rows = len(ds)
    processes = tokenizing_processes() if rows >= PARALLEL_ROWS else None
    encoded = ds.map(encode, batched=True, remove_columns=ds.column_names, num_proc=processes, desc=f"tokenizing {split}")
    empty_flags = encoded["empty"]
    if form.kind == TEXT:
        empty = sum(empty_flags)
    else:
        empty_rows = [i for i, flag in enumerate(empty_flags) if flag]
        if empty_rows:
            raise _columns_error(form, options, split, empty_rows, rows)
        empty = 0
    learnable = encoded["learnable"]
    truncated = encoded["truncated"]
    prompts = encoded["prompt_tokens"]
    keep = [i for i, n in enumerate(learnable) if n > 0]
    dropped = [i for i, n in enumerate(learnable) if n == 0 and not empty_flags[i]]
    if not keep and empty == rows:
        raise ConfigError(f"every {split} text in column {form.columns[0]!r} is empty: point text_column at the column "
                          "that holds the text")
    if not keep:
        longest = max(prompts) if prompts else 0
        raise ConfigError(f"no {split} example keeps a token to learn within max_length={options.max_length}: every prompt fills it "
                          f"(the longest prompt is {longest} tokens); raise max_length above the prompts, e.g. "
                          f"max_length={_round_up(longest + 64)}")
    report = EncodingReport(rows=rows, truncated=sum(truncated), dropped=len(dropped), empty=empty,
                            longest_prompt=max((prompts[i] for i in dropped), default=0))
    encoded = encoded.select(keep) if len(keep) < rows else encoded
    return encoded.remove_columns(["empty", "truncated", "learnable", "prompt_tokens"]), report


def _round_up(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple
