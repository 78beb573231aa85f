"""The one place a Trainer is built: arguments from the config and the runtime, callbacks plugged in.

Later features (telemetry callbacks, in-place OOM recovery) plug in here through ``callbacks`` and
``trainer_class`` without touching task code.
"""

from __future__ import annotations

import math

from transformers import Trainer, TrainingArguments

from ..levers.from_config import training_arguments as lever_arguments
from .config import FinetuneConfig
from .fsdp import fsdp_checkpoints_activations, shard_on_cpu_too, wrap_repeated_blocks
from .metrics import compute_classification_metrics, logits_to_class_ids
from .runtime import Runtime
from .sampling import evaluate_in_dataset_order, group_by_length_over_the_global_batch
from .tasks.base import Task, task_for


def gradient_accumulation(cfg: FinetuneConfig, world_size: int) -> tuple[int, int]:
    """(accumulation steps, effective global batch) from global_batch_size."""
    per_step = cfg.per_device_train_batch_size * max(1, world_size)
    if not cfg.global_batch_size:
        return 1, per_step
    steps = max(1, math.ceil(cfg.global_batch_size / per_step))
    return steps, steps * per_step


def training_arguments(cfg: FinetuneConfig, runtime: Runtime, task: Task | str, packed: bool = False) -> TrainingArguments:
    task = task_for(task) if isinstance(task, str) else task
    accumulation, _ = gradient_accumulation(cfg, runtime.world_size)
    ampere = bool(runtime.gpus) and all(g.bf16_supported for g in runtime.gpus)
    kwargs = dict(
        output_dir=cfg.output_dir,
        num_train_epochs=cfg.num_train_epochs,
        max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        per_device_eval_batch_size=cfg.per_device_eval_batch_size or cfg.per_device_train_batch_size * 2,
        gradient_accumulation_steps=accumulation,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        warmup_steps=cfg.warmup_ratio,  # transformers 5: a float below 1 is a ratio of the training steps
        lr_scheduler_type=cfg.lr_scheduler_type,
        bf16=runtime.precision == "bf16",
        fp16=runtime.precision == "fp16",
        tf32=True if ampere else None,
        optim="adamw_torch_fused",  # torch has a fused AdamW for CUDA and for the CPU (~7x the foreach one on 2 cores)
        torch_compile=cfg.torch_compile,
        dataloader_num_workers=runtime.dataloader_workers,
        dataloader_pin_memory=runtime.on_cuda,
        dataloader_persistent_workers=runtime.on_cuda and runtime.dataloader_workers > 0,
        eval_strategy="no" if cfg.eval_strategy == "auto" else cfg.eval_strategy,  # auto: finetune/intervals.py
        eval_steps=cfg.eval_steps,
        eval_accumulation_steps=16,  # move gathered predictions to the CPU every 16 steps: bounded GPU memory
        save_strategy="no" if cfg.save_strategy == "auto" else cfg.save_strategy,
        save_steps=cfg.save_steps or 500,
        save_total_limit=cfg.save_total_limit,
        logging_steps=cfg.logging_steps,
        report_to=cfg.report_to,
        seed=cfg.seed,
        use_cpu=not runtime.on_cuda,
        remove_unused_columns=False,
        label_names=["labels"],
        ddp_find_unused_parameters=False,
        disable_tqdm=True,
    )
    # transformers 5's activation_checkpointing (gradient_checkpointing); under FSDP the launch config's own flag does it
    # (the Trainer refuses both at once); which layers, and gradient clipping under optimizer_in_backward
    kwargs.update(lever_arguments(cfg.lever_keys(), fsdp_checkpoints=fsdp_checkpoints_activations()))
    if task.groups_by_length(packed):  # packed rows are all about max_length long
        kwargs["train_sampling_strategy"] = "group_by_length"  # transformers 5 name of group_by_length
    kwargs.update(cfg.extra)
    return TrainingArguments(**kwargs)


def build_trainer(cfg, runtime, model, train, validation, collator, processing_class=None, callbacks=(), trainer_class=Trainer):
    task = task_for(cfg.task)
    args = training_arguments(cfg, runtime, task, packed=getattr(collator, "packs_examples", False))
    classifier = task.classifier  # a causal LM's evaluation is its loss (perplexity from it): no logits gathered
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=validation,
        data_collator=collator,
        processing_class=processing_class,
        compute_metrics=compute_classification_metrics if classifier else None,
        preprocess_logits_for_metrics=logits_to_class_ids if classifier else None,
        callbacks=list(callbacks),
    )
    # The classifiers' losses are means over the batch. transformers 5 takes a model whose forward accepts **kwargs
    # (sequence classification does) for one that normalises its loss by num_items_in_batch: it then skips the
    # division by the accumulation steps and multiplies the loss by the number of processes (N times the loss
    # and the gradients on N processes). Saying the truth once fixes both (tests/scaling).
    # A causal LM's loss is the other kind: a sum over label tokens divided by num_items_in_batch (the Trainer counts
    # them over the accumulation steps and the processes), so transformers' own answer (True) stands for it.
    if classifier:
        trainer.model_accepts_loss_kwargs = False
    group_by_length_over_the_global_batch(trainer)  # the same global batches for any number of processes
    if task.evaluates_in_dataset_order:
        evaluate_in_dataset_order(trainer)  # its validation set is sorted (text.longest_first): little padding
    shard_on_cpu_too(trainer)  # an FSDP launch config shards on CPU processes too (accelerate would run DDP)
    wrap_repeated_blocks(trainer)  # FSDP units are the transformer layers (accelerate's default double-shards BERT)
    return trainer
