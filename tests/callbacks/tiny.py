"""A tiny BERT and a padded token dataset for Trainer tests on the CPU."""

import os
import time

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=64, seq=16, vocab=100, fail_at=None):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (n, seq), generator=g)
        self.lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.fail_at = fail_at

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if self.fail_at is not None and i == self.fail_at:
            raise RuntimeError("broken sample (injected)")
        mask = (torch.arange(self.ids.shape[1]) < self.lengths[i]).long()
        return {"input_ids": self.ids[i] * mask, "attention_mask": mask, "labels": self.labels[i]}


class SlowOnRank1(TokenDataset):
    """Rank 1 (of a launch) reads each sample 30 ms slowly: the straggler of the 2-process telemetry probes."""

    def __getitem__(self, i):
        if os.environ.get("RANK") == "1":
            time.sleep(0.03)
        return super().__getitem__(i)


def tiny_bert():
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=64, max_position_embeddings=32, num_labels=2))


def tiny_args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=8, max_steps=8, logging_steps=2, report_to="none",
                use_cpu=True, save_strategy="no", disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)
