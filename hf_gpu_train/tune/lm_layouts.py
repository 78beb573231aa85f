"""Packing on and off for a causal LM within one launch: the other layout of the same training examples, built
from what ``finetune.tasks.language_modeling.prepare`` made (the raw rows, the tokenizer, the data's form) and the same functions
it uses, without loading the model again.

Packed rows and padded examples are different samples (a packed row holds several examples, up to ``max_length``
tokens), so the two layouts are compared by tokens per second, never by samples.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..finetune.tasks.language_modeling.encode import encode_split
from ..finetune.tasks.language_modeling.packing import agreed_packing_support, pack_dataset


@dataclass(frozen=True)
class Layout:
    train: object | None  # None: not possible here (``reason``)
    collator: object | None
    packed: bool
    reason: str = ""


def prepared_layout(train, collator) -> Layout:
    return Layout(train, collator, bool(getattr(collator, "packs_examples", False)))


def build_layout(packing: bool | str, options, model, tokenizer, data, on_cuda: bool) -> Layout:
    """The training set and collator for ``packing`` (a causal-LM option; ``options``: the task's ``CausalLMOptions``): packed rows where asked and the
    model's attention keeps packed examples apart ("auto" falls back to padding, as the run would), else padding."""
    from ..finetune.tasks.language_modeling.collate import PackedCollator, PaddingCollator

    multiple = 8 if on_cuda else None
    pad = tokenizer.pad_token_id
    wants_packing = packing in (True, "auto")
    if wants_packing:
        verdict = agreed_packing_support(model, pad)
        if not verdict.supported:
            if packing is True:
                return Layout(None, None, True, f"packing=true is not possible here: {verdict.reason}")
            wants_packing = False
    encoded, _ = encode_split(data.train, tokenizer, data.form, options, "train")
    if wants_packing:
        packed, _ = pack_dataset(encoded, options.max_length)
        return Layout(packed, PackedCollator(pad, multiple), True)
    lengths = encoded.add_column("length", [len(ids) for ids in encoded["input_ids"]])  # for the length-grouped sampler
    return Layout(lengths, PaddingCollator(pad, multiple), False)
