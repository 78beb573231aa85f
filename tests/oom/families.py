"""Tiny models of the families people fine-tune, whose losses average over different things, and padded rows of very
different label lengths for them: the OOM recovery must weigh micro-batches by what each loss averages over.

- ``t5``, ``bart``: encoder-decoders (``Seq2SeqTrainer``), loss a mean over labelled target tokens;
- ``token``: BERT token classification, a mean over labelled tokens;
- ``mlm``: BERT masked LM, a mean over masked (labelled) tokens;
- ``ctc``: Wav2Vec2 CTC with ``ctc_loss_reduction="mean"``: each row's loss divided by its target length, then a mean
  over rows (a mean over rows, although its labels are token sequences);
- ``ctc-sum``: the same with ``"sum"`` (transformers' default): a sum over rows, not a mean at all;
- ``vit``: a ViT image classifier, a mean over rows;
- ``sequence``: BERT sequence classification, a mean over rows;
- ``moe``: a Mixtral causal LM with its router's load-balancing loss on (``output_router_logits=True``): a sum over
  labelled next tokens normalised by ``num_items_in_batch``, plus a batch-level term (the product of two means over the
  whole batch's tokens) that no weighting of micro-batches splits.

No dropout anywhere, so a split batch draws no other masks than the whole one.
"""

from __future__ import annotations

import torch

VOCAB = 40
FAMILIES = ("t5", "bart", "token", "mlm", "ctc", "ctc-sum", "vit", "sequence", "moe")
SEQ2SEQ = ("t5", "bart")


def model(family: str, router_aux_loss_coef: float = 0.02) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if family == "moe":
        return tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
            output_router_logits=True, router_aux_loss_coef=router_aux_loss_coef, pad_token_id=0, bos_token_id=2,
            eos_token_id=1, tie_word_embeddings=False))
    if family == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    if family == "bart":
        return tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=1,
            decoder_start_token_id=2, forced_eos_token_id=None))
    bert = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if family == "token":
        return tf.BertForTokenClassification(tf.BertConfig(**bert, num_labels=5, classifier_dropout=0.0))
    if family == "mlm":
        return tf.BertForMaskedLM(tf.BertConfig(**bert))
    if family == "sequence":
        return tf.BertForSequenceClassification(tf.BertConfig(**bert, num_labels=3, classifier_dropout=0.0))
    if family in ("ctc", "ctc-sum"):
        return tf.Wav2Vec2ForCTC(tf.Wav2Vec2Config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            conv_dim=(16, 16), conv_stride=(4, 4), conv_kernel=(8, 8), num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0,
            ctc_loss_reduction="mean" if family == "ctc" else "sum", pad_token_id=0, do_stable_layer_norm=True,
            feat_extract_norm="layer"))
    if family == "vit":
        return tf.ViTForImageClassification(tf.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))
    raise ValueError(family)


class Rows(torch.utils.data.Dataset):
    """``n`` padded rows for ``family`` whose labelled lengths run from long to short (12, 11, ..., 1 and again): every
    micro-batch of a split batch holds another number of labelled tokens than its share of the rows."""

    def __init__(self, family: str, n: int = 32, seq: int = 12):
        g = torch.Generator().manual_seed(1)
        self.rows = []
        for i in range(n):
            length = seq - (i % seq)  # 12, 11, ..., 1
            ids = torch.randint(3, VOCAB, (seq,), generator=g)
            mask = (torch.arange(seq) < max(length, 4)).long()
            if family in SEQ2SEQ:
                target = torch.randint(3, VOCAB, (seq,), generator=g)
                labels = torch.where(torch.arange(seq) < length, target, -100)
                self.rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
            elif family == "token":
                labels = torch.where(torch.arange(seq) < length, torch.randint(0, 5, (seq,), generator=g), -100)
                self.rows.append({"input_ids": ids, "attention_mask": torch.ones(seq, dtype=torch.long), "labels": labels})
            elif family == "moe":  # right-padded rows: the router statistics count unpadded tokens only
                mask = (torch.arange(seq) < max(length, 2)).long()
                self.rows.append({"input_ids": ids * mask, "attention_mask": mask,
                                  "labels": torch.where(mask.bool(), ids, -100)})
            elif family == "mlm":
                masked = torch.arange(seq) < length
                self.rows.append({"input_ids": torch.where(masked, 2, ids), "attention_mask": torch.ones(seq, dtype=torch.long),
                                  "labels": torch.where(masked, ids, -100)})
            elif family == "sequence":
                self.rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": torch.tensor(i % 3)})
            elif family in ("ctc", "ctc-sum"):
                audio = torch.randn(400, generator=g)
                labels = torch.where(torch.arange(8) < 1 + i % 8, torch.randint(3, VOCAB, (8,), generator=g), -100)
                self.rows.append({"input_values": audio, "labels": labels})
            elif family == "vit":
                self.rows.append({"pixel_values": torch.randn(3, 16, 16, generator=g), "labels": torch.tensor(i % 3)})
            else:
                raise ValueError(family)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def trainer(family: str, out, model_: torch.nn.Module, per_device: int = 8, accumulation: int = 1, steps: int = 3,
            optimizer: str = "sgd", **extra):
    """The trainer a user of this family builds: ``Seq2SeqTrainer`` for the encoder-decoders, the plain ``Trainer``
    otherwise. SGD by default, so a weight difference is a gradient difference (AdamW hides a constant scale)."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

    seq2seq = family in SEQ2SEQ
    loss_func = extra.pop("compute_loss_func", None)
    args = dict(output_dir=str(out), per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
                gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=0.1 if optimizer == "sgd" else 1e-2,
                optim=optimizer, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
                use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, adam_epsilon=1e-6, max_grad_norm=0.0)
    args.update(extra)
    cls, args_cls = (Seq2SeqTrainer, Seq2SeqTrainingArguments) if seq2seq else (Trainer, TrainingArguments)
    data = Rows(family)
    return cls(model=model_, args=args_cls(**args), train_dataset=data, eval_dataset=torch.utils.data.Subset(data, range(16)),
               compute_loss_func=loss_func)
