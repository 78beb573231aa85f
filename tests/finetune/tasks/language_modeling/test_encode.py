"""Data forms, exact label masks, truncation counting and bad rows, on a tiny tokenizer with SmolLM2's chat template."""

from __future__ import annotations

import pytest

from hf_gpu_train.finetune.config import ConfigError
from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.tasks.language_modeling.chat import require_chat_template
from hf_gpu_train.finetune.tasks.language_modeling.data import CHAT, PROMPT_COMPLETION, TEXT, detect_form
from hf_gpu_train.finetune.tasks.language_modeling.encode import IGNORE, encode_split
from tests.finetune.tasks.language_modeling.tiny import tiny_tokenizer

CONVERSATION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Name a prime number."},
                {"role": "assistant", "content": "Seven is prime."}]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def dataset(rows):
    from datasets import Dataset

    return Dataset.from_list(rows)


def encode(tokenizer, rows, *overrides, split="train"):
    cfg = load_config(None, ["task=causal-lm", "model=unused", "max_length=512", *overrides])
    ds = dataset(rows)
    return encode_split(ds, tokenizer, detect_form(ds, cfg.options, split), cfg.options, split)


def learnt_runs(tokenizer, ids, labels) -> list[str]:
    """The label tokens, decoded run by run (a run: consecutive positions with a label)."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def test_chat_labels_are_exactly_the_assistant_turns_and_their_end_tokens(tokenizer):
    encoded, report = encode(tokenizer, [{"messages": CONVERSATION}])
    row = encoded[0]
    expected_ids = tokenizer(tokenizer.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)["input_ids"]
    assert row["input_ids"] == expected_ids
    assert learnt_runs(tokenizer, row["input_ids"], row["labels"]) == ["Paris.<|im_end|>", "Seven is prime.<|im_end|>"]
    assert report.truncated == 0 and report.dropped == 0


def test_chat_without_a_system_message_gets_the_templates_default_and_no_loss_on_it(tokenizer):
    conversation = CONVERSATION[1:3]
    encoded, _ = encode(tokenizer, [{"messages": conversation}])
    text = tokenizer.decode(encoded[0]["input_ids"])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert learnt_runs(tokenizer, encoded[0]["input_ids"], encoded[0]["labels"]) == ["Paris.<|im_end|>"]


def test_completion_only_loss_false_learns_every_token(tokenizer):
    encoded, _ = encode(tokenizer, [{"messages": CONVERSATION}], "completion_only_loss=false")
    assert encoded[0]["labels"] == encoded[0]["input_ids"]


def test_prompt_completion_joins_ids_and_learns_the_completion_and_eos(tokenizer):
    rows = [{"prompt": "What is the capital of France?", "completion": " Paris."}]
    encoded, _ = encode(tokenizer, rows)
    prompt = tokenizer("What is the capital of France?")["input_ids"]
    completion = tokenizer(" Paris.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert encoded[0]["input_ids"] == prompt + completion
    assert encoded[0]["labels"] == [IGNORE] * len(prompt) + completion
    everything, _ = encode(tokenizer, rows, "completion_only_loss=false")
    assert everything[0]["labels"] == prompt + completion


def test_conversational_prompt_completion_learns_the_completion_messages(tokenizer):
    rows = [{"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}]
    encoded, _ = encode(tokenizer, rows)
    assert learnt_runs(tokenizer, encoded[0]["input_ids"], encoded[0]["labels"]) == ["Seven is prime.<|im_end|>"]


def test_plain_text_learns_every_token_and_empty_texts_are_dropped(tokenizer):
    rows = [{"text": "the quick brown fox"}, {"text": "  "}, {"text": "jumps over the lazy dog"}]
    encoded, report = encode(tokenizer, rows)
    assert encoded["input_ids"] == [tokenizer("the quick brown fox")["input_ids"] + [tokenizer.eos_token_id],
                                    tokenizer("jumps over the lazy dog")["input_ids"] + [tokenizer.eos_token_id]]
    assert encoded["labels"] == encoded["input_ids"]
    assert report.empty == 1 and report.notes("train", 512) == ["1 empty train texts were dropped"]


def test_long_examples_are_truncated_and_counted_and_prompt_only_ones_dropped(tokenizer):
    prompt = "What is the capital of France?"
    fits = len(tokenizer(prompt)["input_ids"] + tokenizer(" Paris.", add_special_tokens=False)["input_ids"]) + 1  # + eos
    limit = fits + 1
    rows = [{"prompt": prompt, "completion": " Paris."},  # fits
            {"prompt": prompt, "completion": " The capital of France is Paris, the quick brown fox said."},  # truncated
            {"prompt": prompt + " " + prompt, "completion": " Paris."}]  # the prompt alone is longer: nothing to learn
    encoded, report = encode(tokenizer, rows, f"max_length={limit}")
    assert len(encoded) == 2 and [len(ids) for ids in encoded["input_ids"]] == [fits, limit]
    assert (report.rows, report.truncated, report.dropped) == (3, 2, 1)
    notes = report.notes("train", limit)
    assert notes[0].startswith(f"2 of 3 train examples are longer than max_length={limit}")
    assert notes[1].startswith("1 train examples were dropped")


def test_every_prompt_beyond_max_length_is_an_error_naming_the_fix(tokenizer):
    rows = [{"prompt": "What is the capital of France? " * 4, "completion": " Paris."}] * 3
    with pytest.raises(ConfigError, match=r"no train example keeps a token to learn within max_length=8.*raise max_length"):
        encode(tokenizer, rows, "max_length=8")


@pytest.mark.parametrize("rows, what", [
    ([{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "  "}], "1 of 2 train rows have an empty completion in "
                                                                                 "column 'completion' (first: row 1)"),
    ([{"messages": CONVERSATION[1:3]}, {"messages": [CONVERSATION[1], {"role": "assistant", "content": ""}]}],
     "1 of 2 train rows have an empty assistant message"),
    ([{"messages": CONVERSATION[1:2]}], "1 of 1 train rows have an empty assistant message (or none at all)"),
])
def test_empty_completions_are_an_error_naming_the_rows(tokenizer, rows, what):
    with pytest.raises(ConfigError, match="fill or drop those rows") as error:
        encode(tokenizer, rows)
    assert what in str(error.value)


def test_forms_are_recognised_in_order_and_a_missing_column_names_the_three():
    cfg = load_config(None, ["task=causal-lm", "model=unused"])
    assert detect_form(dataset([{"messages": CONVERSATION, "text": "x"}]), cfg.options, "train").kind == CHAT
    assert detect_form(dataset([{"prompt": "a", "completion": "b", "text": "x"}]), cfg.options, "train").kind == PROMPT_COMPLETION
    assert detect_form(dataset([{"text": "x"}]), cfg.options, "train").kind == TEXT
    custom = load_config(None, ["task=causal-lm", "model=unused", "text_column=body"])
    assert detect_form(dataset([{"body": "x"}]), custom.options, "train").columns == ("body",)
    with pytest.raises(ConfigError, match=r"no usable text column in the train split \(its columns: \['question', 'answer'\]\).*"
                                          r"prompt_column=, completion_column="):
        detect_form(dataset([{"question": "a", "answer": "b"}]), cfg.options, "train")
    with pytest.raises(ConfigError, match="does not hold lists of"):
        detect_form(dataset([{"messages": "hello"}]), cfg.options, "train")


def test_chat_data_without_a_chat_template_names_the_fixes():
    with pytest.raises(ConfigError, match="has no chat template: give one with chat_template=FILE.jinja"):
        require_chat_template(tiny_tokenizer(template=None), "my-base-model", "the data is messages data (messages)")


def test_a_template_that_rewrites_earlier_turns_is_refused_and_the_named_fix_works(tokenizer):
    rewriting = tiny_tokenizer(template="{% for m in messages %}{{ m['role'] + ':' + m['content'] + '|' + (messages|length|string) }}"
                                        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    with pytest.raises(ConfigError, match="cannot be told apart: completion_only_loss=false"):
        encode(rewriting, [{"messages": CONVERSATION}])
    encoded, _ = encode(rewriting, [{"messages": CONVERSATION}], "completion_only_loss=false")
    assert encoded[0]["labels"] == encoded[0]["input_ids"] == rewriting(
        rewriting.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "directory"])
def test_every_source_gives_the_same_rows_and_a_seeded_carve(tmp_path, kind):
    import json

    import pandas as pd

    from hf_gpu_train.finetune.tasks.language_modeling.data import open_causal_lm_data

    rows = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(20)]
    folder = tmp_path / "data"
    folder.mkdir()
    if kind == "jsonl":
        source = ["dataset=none", f"train_file={folder / 'train.jsonl'}"]
        (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        source = ["dataset=none", f"train_file={folder / 'train.json'}"]
        (folder / "train.json").write_text(json.dumps(rows))
    elif kind in ("csv", "parquet"):
        source = ["dataset=none", f"train_file={folder / f'train.{kind}'}"]
        frame = pd.DataFrame(rows)
        frame.to_csv(folder / "train.csv", index=False) if kind == "csv" else frame.to_parquet(folder / "train.parquet")
    else:  # a local datasets directory, as load_dataset reads it
        source = [f"dataset={folder}"]
        pd.DataFrame(rows).to_json(folder / "train.jsonl", orient="records", lines=True)
    cfg = load_config(None, ["task=causal-lm", "model=unused", "validation_fraction=0.25", *source])
    data = open_causal_lm_data(cfg.data_keys(), cfg.options)
    assert data.form.kind == PROMPT_COMPLETION and len(data.train) == 15 and len(data.validation) == 5
    assert sorted([*data.train["prompt"], *data.validation["prompt"]]) == sorted(r["prompt"] for r in rows)
    assert data.notes == ["validation carved from the training data at random: 5 of 20 rows (validation_fraction=0.25)"]
    assert list(open_causal_lm_data(cfg.data_keys(), cfg.options).validation["prompt"]) == list(data.validation["prompt"])  # seeded
