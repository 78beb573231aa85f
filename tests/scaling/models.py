"""The tiny models and data every scaling run shares: deterministic, dropout-free, no BatchNorm: a BERT classifier
(a per-batch mean loss), a timm ViT, and a Llama causal LM (a loss normalised by the number of label tokens).

No dropout, because split batches would draw other random masks than the whole batch; no BatchNorm,
because its batch statistics depend on the micro-batch (2 x 4 samples normalise differently from 8):
such a model cannot train identically under micro-batching, accumulation or several processes.
"""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification

from hf_gpu_train.finetune.tasks.image_classification.model import TimmClassifier

KINDS = ("text", "vision", "causal")
NUM_SAMPLES = 96


def text_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0))


def causal_model() -> torch.nn.Module:
    """A tiny Llama: its loss is a sum over label tokens divided by the batch's token count (num_items_in_batch)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def vision_model() -> torch.nn.Module:
    import timm

    torch.manual_seed(0)
    return TimmClassifier(timm.create_model("test_vit", num_classes=3, img_size=32))  # LayerNorm, no dropout


class TextData(torch.utils.data.Dataset):
    """Token ids of varying length, zero-padded to 16, with their attention mask."""

    def __init__(self, n: int = NUM_SAMPLES, seq: int = 16, vocab: int = 100):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (n, seq), generator=g)
        self.lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        mask = (torch.arange(self.ids.shape[1]) < self.lengths[i]).long()
        return {"input_ids": self.ids[i] * mask, "attention_mask": mask, "labels": self.labels[i]}


class CausalData(TextData):
    """Right-padded token sequences of varying length; padding is not predicted (label -100), so every batch has
    its own number of label tokens and a per-micro-batch mean would weigh them wrongly."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        labels = item["input_ids"].masked_fill(item["attention_mask"] == 0, -100)
        return {"input_ids": item["input_ids"], "attention_mask": item["attention_mask"], "labels": labels}


class ImageData(torch.utils.data.Dataset):
    def __init__(self, n: int = NUM_SAMPLES):
        g = torch.Generator().manual_seed(0)
        self.pixels = torch.randn(n, 3, 32, 32, generator=g)
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.pixels)

    def __getitem__(self, i):
        return {"pixel_values": self.pixels[i], "labels": self.labels[i]}


def model_and_data(kind: str):
    if kind == "text":
        return text_model(), TextData()
    if kind == "causal":
        return causal_model(), CausalData()
    return vision_model(), ImageData()
