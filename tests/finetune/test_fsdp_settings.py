from types import SimpleNamespace

from hf_gpu_train.finetune.fsdp import fsdp_checkpoints_activations, repeated_blocks
from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.trainer_factory import training_arguments

CPU = SimpleNamespace(on_cuda=False, gpus=(), precision="fp32", dataloader_workers=0, world_size=1)


def test_under_fsdp_the_launch_configs_checkpointing_does_it_not_the_trainers(monkeypatch, tmp_path):
    """A plan with checkpointing writes fsdp_activation_checkpointing: true AND a gradient_checkpointing value; the
    Trainer raises a ValueError when both reach it."""
    cfg = load_config(None, ["gradient_checkpointing=true", f"output_dir={tmp_path}"])
    assert training_arguments(cfg, CPU, cfg.task).activation_checkpointing is True
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    assert fsdp_checkpoints_activations()
    assert training_arguments(cfg, CPU, cfg.task).activation_checkpointing is False
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "false")
    assert training_arguments(cfg, CPU, cfg.task).activation_checkpointing is True


def test_the_fsdp_units_are_the_repeated_blocks():
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                                     intermediate_size=32))
    assert "BertEmbeddings" in model._no_split_modules and repeated_blocks(model) == ["BertLayer"]
