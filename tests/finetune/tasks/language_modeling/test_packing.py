"""Packing: best-fit-decreasing rows, the proof that a packed example's logits equal the example's alone, the loss
of packed rows equal to the examples' token loss, the check that catches attention crossing examples, and OOM
recovery splitting packed rows exactly."""

from __future__ import annotations

import pytest
import torch

from hf_gpu_train.finetune.tasks.language_modeling.collate import PackedCollator, PaddingCollator
from hf_gpu_train.finetune.tasks.language_modeling.encode import IGNORE
from hf_gpu_train.finetune.tasks.language_modeling.packing import best_fit_decreasing, pack_dataset, packing_support
from tests.finetune.tasks.language_modeling.tiny import tiny_llama

PAD = 2


def examples(lengths, seed=0, vocab=300):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        labels = [IGNORE] * (n // 3) + ids[n // 3:]  # a prompt, then a completion
        rows.append({"input_ids": ids, "labels": labels})
    return Dataset.from_list(rows)


def test_best_fit_decreasing_puts_each_example_in_the_fullest_row_it_fits():
    assert best_fit_decreasing([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    lengths = [(i * 37) % 61 + 1 for i in range(500)]
    bins = best_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 64) * 1.05  # within 5% of the lower bound
    with pytest.raises(ValueError, match="more than the row capacity"):
        best_fit_decreasing([9], 8)


def test_packed_rows_hold_every_example_once_with_restarting_positions_and_a_masked_first_label():
    ds = examples([7, 5, 3, 9, 4])
    packed, report = pack_dataset(ds, 12)
    assert report.examples == 5 and report.tokens == 28 and report.rows == len(packed)
    flat = [t for row in packed["input_ids"] for t in row]
    assert sorted(flat) == sorted(t for ids in ds["input_ids"] for t in ids)
    for row in packed:
        assert len(row["input_ids"]) <= 12 and len(row["labels"]) == len(row["input_ids"]) == len(row["position_ids"])
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
        assert all(row["labels"][s] == IGNORE for s in starts)  # never the target of the previous example


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_examples_logits_equal_the_example_alone(attention):
    """Every example of every row, in a batch of several padded rows, against the same example run alone."""
    model = tiny_llama(300, attn_implementation=attention)
    ds = examples([7, 5, 3, 9, 4, 6, 2, 8], seed=1)
    packed, _ = pack_dataset(ds, 16)
    assert len(packed) >= 3 and any(len(r) < 16 for r in packed["input_ids"])  # rows of different lengths: padding
    batch = PackedCollator(PAD)(list(packed))
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        checked = 0
        for r, row in enumerate(packed):
            start = 0
            for length in _segments(row["position_ids"]):
                alone = model(input_ids=torch.tensor([row["input_ids"][start:start + length]])).logits[0]
                assert torch.allclose(logits[r, start:start + length], alone, atol=1e-5, rtol=1e-5), (r, start)
                start += length
                checked += 1
    assert checked == len(ds)


def _segments(positions):
    lengths, n = [], 0
    for p in positions:
        if p == 0 and n:
            lengths.append(n)
            n = 0
        n += 1
    return lengths + [n]


def test_the_loss_of_packed_rows_is_the_examples_token_loss():
    """sum over packed tokens == sum over the examples' own tokens: no label crosses an example boundary."""
    model = tiny_llama(300)
    ds = examples([7, 5, 3, 9, 4, 6], seed=2)
    packed, _ = pack_dataset(ds, 16)
    with torch.no_grad():
        batch = PackedCollator(PAD, pad_to_multiple_of=8)(list(packed))
        items = int((batch["labels"][:, 1:] != IGNORE).sum())
        packed_sum = float(model(**batch).loss) * items
        padded = PaddingCollator(PAD)(list(ds))
        padded_items = int((padded["labels"][:, 1:] != IGNORE).sum())
        padded_sum = float(model(**padded).loss) * padded_items
    assert items == padded_items == sum(sum(1 for x in labels[1:] if x != IGNORE) for labels in ds["labels"])
    assert packed_sum == pytest.approx(padded_sum, rel=1e-5)


def test_the_check_passes_attention_that_keeps_examples_apart_and_catches_one_that_does_not():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def sees_everything_before(module, query, key, value, attention_mask, **kwargs):  # causal, blind to example boundaries
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **{k: v for k, v in kwargs.items()
                                                                                          if k != "is_causal"})

    AttentionInterface.register("causal_only_for_test", sees_everything_before)
    good = packing_support(tiny_llama(300), PAD)
    assert good.supported and "checked on this model" in good.reason
    leaky = tiny_llama(300, attn_implementation="causal_only_for_test")
    unknown = packing_support(leaky, PAD)
    assert not unknown.supported and "is not known to keep packed examples apart" in unknown.reason
    from hf_gpu_train.finetune.tasks.language_modeling import packing

    original = packing.PACKING_ATTENTION
    packing.PACKING_ATTENTION = (*original, "causal_only_for_test")  # as if it were trusted: running it catches it
    try:
        caught = packing_support(leaky, PAD)
    finally:
        packing.PACKING_ATTENTION = original
    assert not caught.supported and "attention crosses example boundaries" in caught.reason


def test_oom_recovery_splits_packed_rows_into_exact_micro_batches(tmp_path):
    """4 packed rows per step, an OOM above 2 rows: the recovered run logs the losses and ends with the weights of the run
    without OOM. Plain SGD, so a gradient off by a factor shows in the weights (Adam would normalise it away)."""
    from transformers import Trainer, TrainingArguments

    from hf_gpu_train.oom import OOMFaultInjector, enable_oom_recovery

    packed, _ = pack_dataset(examples([(i * 7) % 13 + 3 for i in range(40)], seed=3), 24)

    def run(name, injector=None):
        model = tiny_llama(300).train()
        if injector:
            injector.install(model)
        args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=3, learning_rate=0.5,
                                 optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to="none", use_cpu=True,
                                 save_strategy="no", disable_tqdm=True, seed=0, data_seed=0, remove_unused_columns=False)
        trainer = Trainer(model=model, args=args, train_dataset=packed, data_collator=PackedCollator(PAD))
        recovery = enable_oom_recovery(trainer)
        trainer.train()
        return model, recovery, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    clean, _, clean_losses = run("clean")
    injector = OOMFaultInjector(max_batch=2)
    recovered, recovery, losses = run("recovered", injector)
    assert injector.raised == 1 and recovery.micro_batch == 2
    assert losses == pytest.approx(clean_losses, rel=1e-5) and len(losses) == 3
    for (name, a), b in zip(clean.state_dict().items(), recovered.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (name, (a - b).abs().max())
