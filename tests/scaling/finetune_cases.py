"""Inputs for running ``scripts/finetune.py`` several ways: a tiny text model directory and a tiny timm
model's weights that load completely (no randomly initialised head: every run starts from the same
weights), the data, and the step-1 loss computed by hand.

Text: 32 training rows, two global batches of 16 per epoch, in the entry point's default length-grouped
order (which must not depend on the number of processes); step 1's batch is the first 16 indices of
transformers' ``get_length_grouped_indices`` over the global batch, seeded with the run's seed.
Vision: 16 training images, one global batch per epoch, so step 1 is a mean over all of them in any order."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import torch

GLOBAL_BATCH = 16
TEXT_ROWS = 2 * GLOBAL_BATCH
SEED = 42  # FinetuneConfig's default
EPOCHS = 3
IMAGE_SIZE = 160  # test_vit's native size
COMMON = [f"num_train_epochs={EPOCHS}", "learning_rate=1e-3", "warmup_ratio=0", "logging_steps=1", "eval_strategy=no",
          "save_strategy=no", "extra={adam_epsilon: 1.0e-6}", "max_eval_samples=8"]
DETERMINISTIC_AUGMENTATION = "augmentation={scale: [1.0, 1.0], ratio: [1.0, 1.0], hflip: 0.0, color_jitter: 0.0}"


def text_case(root: Path) -> list[str]:
    """A BERT of MiniLM's vocabulary with 2 layers of 32, no dropout, a 2-class head; 32 + 8 rows of csv."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from hf_gpu_train.finetune.builtin import make_text_examples, minilm_path

    model_dir = root / "tiny-bert"
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, classifier_dropout=0.0,
                        id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1})
    BertForSequenceClassification(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = make_text_examples(TEXT_ROWS + 8, seed=7)
    for name, part in (("train.csv", rows[:TEXT_ROWS]), ("validation.csv", rows[TEXT_ROWS:])):
        with open(root / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["text", "label"])
            writer.writeheader()
            writer.writerows(part)
    return [f"model={model_dir}", f"train_file={root / 'train.csv'}", f"validation_file={root / 'validation.csv'}", "max_length=32"]


def vision_case(root: Path, model: str = "test_vit", image_size: int = IMAGE_SIZE, validation: int = 6) -> list[str]:
    """timm's test_vit (LayerNorm, no dropout), or another timm ``model``, with saved 3-class weights; 16 + 6 (or
    ``validation``) of scikit-learn's digits as PNGs."""
    import numpy as np
    import timm
    from PIL import Image
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    weights = root / f"{model}.pth"
    torch.save(timm.create_model(model, num_classes=3).state_dict(), weights)
    digits = load_digits()
    chosen = [i for i, y in enumerate(digits.target) if y < 3][:GLOBAL_BATCH + validation]
    for n, i in enumerate(chosen):
        split = "train" if n < GLOBAL_BATCH else "validation"
        folder = root / "digits" / split / str(digits.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (digits.images[i] * (255 / 16)).astype(np.uint8)
        Image.fromarray(pixels).convert("RGB").save(folder / f"{i}.png")
    return ["task=image-classification", f"model=timm/{model}", f"pretrained_weights={weights}",
            f"dataset=imagefolder:{root / 'digits'}", f"image_size={image_size}", DETERMINISTIC_AUGMENTATION]


def batchnorm_case(root: Path) -> list[str]:
    """timm's test_efficientnet (BatchNorm, no dropout) at 64 pixels, with weight decay and a cosine schedule, clipping
    off (tests/scaling/conftest.py says why), on 2 processes of 2 micro-batches of 4 images (accumulation 2); no
    evaluation before training (DeepSpeed and FSDP runs skip it); an
    evaluation after every step, of 8 validation images in batches of 4, so that every rank evaluates rows of its own
    (with 6 in one batch, rank 1's copy of rank 0's is dropped)."""
    kept = [a for a in COMMON if not a.startswith(("extra=", "eval_strategy="))]
    return [*vision_case(root, "test_efficientnet", 64, validation=8), *kept, "eval_strategy=steps", "eval_steps=1",
            "per_device_eval_batch_size=4", "extra={adam_epsilon: 1.0e-6, max_grad_norm: 0.0}", "weight_decay=0.05",
            "lr_scheduler_type=cosine", "telemetry=false", "evaluate_before=false", f"global_batch_size={GLOBAL_BATCH}",
            f"per_device_train_batch_size={GLOBAL_BATCH // 4}"]


def text_loss_by_hand(root: Path) -> float:
    """Mean cross-entropy of the untrained model over step 1's 16 rows, in eval mode."""
    from transformers import AutoTokenizer, BertForSequenceClassification
    from transformers.trainer_pt_utils import get_length_grouped_indices

    model = BertForSequenceClassification.from_pretrained(root / "tiny-bert").eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "tiny-bert")
    with open(root / "train.csv") as f:
        rows = list(csv.DictReader(f))
    lengths = [len(ids) for ids in tokenizer([r["text"] for r in rows], truncation=True, max_length=32)["input_ids"]]
    first = get_length_grouped_indices(lengths, GLOBAL_BATCH, generator=torch.Generator().manual_seed(SEED))[:GLOBAL_BATCH]
    rows = [rows[i] for i in first]
    batch = tokenizer([r["text"] for r in rows], truncation=True, max_length=32, padding=True, return_tensors="pt")
    labels = torch.tensor([{"negative": 0, "positive": 1}[r["label"]] for r in rows])
    with torch.no_grad():
        logits = model(**batch).logits
    return float(torch.nn.functional.cross_entropy(logits, labels))


def vision_loss_by_hand(root: Path) -> float:
    """Mean cross-entropy of the saved weights over the 16 training images, through timm's own transform."""
    import timm
    import timm.data
    from PIL import Image

    model = timm.create_model("test_vit", num_classes=3)
    model.load_state_dict(torch.load(root / "test_vit.pth"))
    model.eval()
    config = timm.data.resolve_data_config({"input_size": (3, IMAGE_SIZE, IMAGE_SIZE)}, model=model)
    transform = timm.data.create_transform(**config, is_training=True, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=0.0,
                                           color_jitter=0.0)
    files = sorted((root / "digits" / "train").glob("*/*.png"))
    pixels = torch.stack([transform(Image.open(f).convert("RGB")) for f in files])
    labels = torch.tensor([int(f.parent.name) for f in files])
    with torch.no_grad():
        logits = model(pixels)
    return float(torch.nn.functional.cross_entropy(logits, labels))


def as_if_killed_after(out: Path, checkpoint: str, target: Path) -> Path:
    """``target``: what a run into ``out`` killed right after writing ``checkpoint`` leaves behind (its config, label
    map, that checkpoint, and its record unfinished); the same command on ``target`` resumes from it."""
    from hf_gpu_train.finetune.run_record import RECORD

    target.mkdir()
    for name in ("finetune_config.yaml", "label_map.json"):
        shutil.copy(out / name, target / name)
    shutil.copytree(out / checkpoint, target / checkpoint)
    record = json.loads((out / RECORD).read_text())
    (target / RECORD).write_text(json.dumps({**record, "finished": False, "global_step": None}))
    return target
