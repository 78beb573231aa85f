"""The causal-LM branch of ``run.prepare``: the classification task's order, for whoever made a mistake.

1. What needs no data and no model: peft/bitsandbytes installed, QLoRA on CUDA, the model directory or builtin there.
2. The data: files, splits, columns, form (seconds).
3. The tokenizer (converting ``builtin:smollm2`` on first use) and, for chat data, its chat template.
4. The model, then the method (LoRA adapters, 4-bit base).
5. The passes over every row: tokenizing, truncating and counting, then packing where the model's attention keeps
   packed examples apart (``packing.packing_support``), else dynamic padding, with the reason said. With several
   processes, once per machine (``prepare_once``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...config import ConfigError, FinetuneConfig
from ...prepare_once import Prepared, data_key, prepare_once, world_size
from . import model as lm_model
from .chat import require_chat_template
from .collate import PackedCollator, PaddingCollator
from .data import CausalLMData, open_causal_lm_data
from .encode import encode_split
from .generation import pick_prompts
from .methods import apply_method, check_method, quantization_config, trainable_summary
from .options import CausalLMOptions
from .packing import agreed_packing_support, lengths_of, pack_dataset


@dataclass
class PreparedCausalLM:
    model: object
    train: object  # tokenized (and packed) datasets.Dataset
    validation: object
    collator: object
    tokenizer: object
    data: CausalLMData


def _with_lengths(ds):
    """A ``length`` column for the Trainer's length-grouped sampler (it would otherwise read every row)."""
    return ds.add_column("length", lengths_of(ds))


def _encode_and_pack(options: CausalLMOptions, data: CausalLMData, tokenizer, packs: bool) -> Prepared:
    """The passes over every row: tokenizing, truncating and counting, then packing (or a length column)."""

    train, train_report = encode_split(data.train, tokenizer, data.form, options, "train")
    validation, validation_report = encode_split(data.validation, tokenizer, data.form, options, "validation")
    notes = [*train_report.notes("train", options.max_length), *validation_report.notes("validation", options.max_length)]
    packing = []
    if packs:
        train, packed = pack_dataset(train, options.max_length)
        validation, validation_packed = pack_dataset(validation, options.max_length)
        packing = [packed.note("train"), validation_packed.note("validation")]
    else:
        train, validation = _with_lengths(train), _with_lengths(validation)
    return Prepared(train, validation, {"notes": notes, "packing": packing})


def _chunk_the_head(model, options: CausalLMOptions, precision: str, on_cuda: bool) -> str:
    """``chunked_lm_loss``: the LM head and loss in chunks where exact (auto), asked for (true: refused with the reason
    where not exact), by a fused kernel on CUDA (liger, cce: refused where it cannot run), or the model's own (false)."""
    from . import lm_head_loss

    if options.chunked_lm_loss is False:
        return "LM head and loss: the model's own (chunked_lm_loss=false): full logits"
    kernel = options.chunked_lm_loss if options.chunked_lm_loss in lm_head_loss.KERNELS else None
    if kernel:
        problem = lm_head_loss.kernel_problem(kernel, on_cuda)
        if problem:
            raise ConfigError(f"chunked_lm_loss={kernel}, but {problem}")
    # probed once the Trainer has placed the model where it trains (confirm_chunked_head), not here: on the CPU a model
    # that runs on the GPU only (16-bit Mamba kernels, flash attention) would fail the probe, and a large one is not run
    verdict = lm_head_loss.install(model, precision=precision, kernel=kernel, probe=False)
    if not verdict.supported:
        refuse_asked_for(options, verdict.reason)
    return (f"LM head and loss: chunked ({verdict.reason}; no full logits)" if verdict.supported else
            f"LM head and loss: the model's own ({verdict.reason})")


def refuse_asked_for(options: CausalLMOptions, reason: str) -> None:
    """chunked_lm_loss=true (or a kernel) asked for what is not exact for this model: a usage error naming why."""
    if options.chunked_lm_loss not in (False, "auto"):
        raise ConfigError(f"chunked_lm_loss={str(options.chunked_lm_loss).lower()}, but {reason}: chunked_lm_loss=auto (or "
                          "false) to use the model's own head and loss")


def confirm_chunked_head(model, options: CausalLMOptions, precision: str) -> str | None:
    """The chunked head, where installed, checked on the model as it trains (its device, the run's precision; every rank
    agrees): the line to print, or None without a chunked head. A head the probe refuses is taken off again (auto) or
    refused (chunked_lm_loss=true)."""
    from . import lm_head_loss

    verdict = lm_head_loss.confirm(model, precision)
    if verdict is None:
        return None
    if not verdict.supported:
        refuse_asked_for(options, verdict.reason)
        return f"LM head and loss: the model's own after all ({verdict.reason})"
    return f"LM head and loss: {verdict.reason}"


def prepare_causal_lm(cfg: FinetuneConfig, runtime, say) -> PreparedCausalLM:

    check_method(cfg.method, runtime)
    lm_model.check_model(cfg.model)
    data = open_causal_lm_data(cfg.data_keys(), cfg.options)
    data.model_path = lm_model.model_path(cfg.model, say=lambda line: say([line]))
    tokenizer = lm_model.load_tokenizer(cfg.model, cfg.options, data.model_path)
    if data.form.uses_chat_template:
        require_chat_template(tokenizer, cfg.model, f"the data is {data.form.describe()}")
    model = lm_model.load_model(cfg.model, cfg.options, cfg.method, data.model_path, runtime,
                                quantization_config(cfg.method, runtime))
    verdict = agreed_packing_support(model, tokenizer.pad_token_id) if cfg.packing is not False else None
    if cfg.packing is True and not verdict.supported:
        raise ConfigError(f"packing=true, but {verdict.reason}: packing=auto (or false) to pad instead, or "
                          "attn_implementation=sdpa")
    model = apply_method(model, cfg.options, cfg.method, cfg.gradient_checkpointing)
    head_note = _chunk_the_head(model, cfg.options, runtime.precision, runtime.on_cuda)
    packs = verdict is not None and verdict.supported
    key = data_key(cfg.values(), {"train": data.train, "validation": data.validation}, data.model_path, tokenizer,
                   task_folder=Path(__file__).parent, packs=packs)
    prepared = prepare_once(key, lambda: _encode_and_pack(cfg.options, data, tokenizer, packs))
    notes = [f"{data.form.describe()} from {data.source}; {trainable_summary(model)} ({cfg.method})", *data.notes,
             *prepared.meta["notes"]]
    multiple = 8 if runtime.on_cuda else None  # tensor cores like multiples of 8
    if packs:
        notes += [f"packing on: {verdict.reason}", *prepared.meta["packing"]]
        collator = PackedCollator(tokenizer.pad_token_id, multiple)
    else:
        why = "packing=false" if verdict is None else verdict.reason
        notes.append(f"packing off ({why}): examples padded to the longest in each batch, grouped by length")
        collator = PaddingCollator(tokenizer.pad_token_id, multiple)
    notes.append(head_note)
    if world_size() > 1:
        notes.append(f"data {prepared.how}")
    train, validation = prepared.train, prepared.validation
    data.generation_prompts = pick_prompts(data, tokenizer, cfg.options) if cfg.generation_samples else []
    data.notes = notes
    say(notes)
    return PreparedCausalLM(model, train, validation, collator, tokenizer, data)
