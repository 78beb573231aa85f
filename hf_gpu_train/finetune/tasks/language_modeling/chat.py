"""Chat data: conversations rendered with the tokenizer's chat template, and where the assistant's words are.

Completion-only loss needs the characters of each assistant turn. ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` gives them only for templates with ``{% generation %}`` markers, which most
shipped templates lack (SmolLM2's, Llama 3's and Qwen 2.5's among them). So the conversation is rendered prefix
by prefix: for an assistant message ``i``, ``render(messages[:i], add_generation_prompt=True)`` ends where its
answer starts and ``render(messages[:i + 1])`` ends where it stops. The assistant span is what lies between,
without the whitespace the template puts between turns: the answer and the template's end-of-turn token
(``<|im_end|>``, ``<|eot_id|>``), which the model must learn to produce in order to stop.

This holds for templates that render each prefix of a conversation as a prefix of the whole one. A template that
rewrites earlier turns (one that drops an earlier turn's reasoning, say) does not; the row is named and the run
stops with the ways out, rather than training on the wrong tokens.
"""

from __future__ import annotations

from ...config import ConfigError


def require_chat_template(tokenizer, model_name: str, why: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{why}, but the tokenizer of model={model_name!r} has no chat template: give one with "
                          "chat_template=FILE.jinja, use an instruction-tuned model that ships one, or give the data as "
                          "prompt + completion or plain text columns")


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TemplateError as error:
        raise ConfigError(f"the chat template rejects a conversation ({error}): fix the conversation's roles, or give "
                          "another template with chat_template=FILE.jinja") from None


def assistant_spans(tokenizer, messages: list[dict], trained: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, character spans of the messages at indices ``trained``)."""
    text = render(tokenizer, messages)
    spans = []
    for i in trained:
        start_text = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = render(tokenizer, messages[:i + 1])
        if not (through.startswith(start_text) and text.startswith(through)):
            raise ConfigError(f"the chat template does not render a conversation's beginning as the beginning of the whole "
                              f"(message {i} of {len(messages)}), so its assistant turns cannot be told apart: "
                              "completion_only_loss=false to train on every token, or chat_template=FILE.jinja with a "
                              "template that renders turns in order")
        end = len(through.rstrip())
        if end > len(start_text):
            spans.append((len(start_text), end))
    return text, spans


def labels_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Per token: does it start inside one of ``spans``? (A token is the assistant's if its first character is.)"""
    trained = []
    k = 0
    for start, _end in offsets:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        trained.append(k < len(spans) and spans[k][0] <= start < spans[k][1])
    return trained
