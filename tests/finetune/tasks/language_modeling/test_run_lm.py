"""scripts/finetune.py task=causal-lm end to end on a tiny Llama: LoRA (adapter, merged model, eval loss and
perplexity by hand, generation samples), resume from an adapter checkpoint, full fine-tuning with padding, the
packing fallback, and bad input (exit 2, the fix named, nothing written)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from hf_gpu_train.finetune.run import main
from tests.finetune.tasks.language_modeling.tiny import chat_case, save_tiny_model, write_jsonl
from tests.scaling.equivalence import assert_same_params, assert_trained

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> list[str]:
    return chat_case(tmp_path_factory.mktemp("lm-case"), 32, 12, "max_length=256", "per_device_train_batch_size=4",
                     "num_train_epochs=1", "learning_rate=1e-2", "warmup_ratio=0", "generation_samples=2",
                     "generation_max_new_tokens=6", "logging_steps=1")


def eval_loss_by_hand(arguments: list[str], adapter_dir: Path) -> float:
    """The validation rows rebuilt from the same arguments, the saved adapter on the base model, each evaluation batch's
    token loss weighted by its rows: what the Trainer's evaluation reports as eval_loss."""
    from peft import PeftModel

    from hf_gpu_train.finetune.loading import load_config
    from hf_gpu_train.finetune.run import prepared_for
    from hf_gpu_train.finetune.runtime import resolve_runtime

    cfg = load_config(None, [*arguments, f"output_dir={adapter_dir.parent / 'by-hand'}", "method=full", "generation_samples=0"])
    p = prepared_for(cfg, resolve_runtime(cfg))
    base, validation, collator = p.model, p.validation, p.collator
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    total, rows = 0.0, 0
    size = cfg.per_device_train_batch_size * 2  # the factory's evaluation batch
    with torch.no_grad():
        for start in range(0, len(validation), size):
            batch = collator([validation[i] for i in range(start, min(len(validation), start + size))])
            n = batch["input_ids"].shape[0]
            total += float(model(**batch).loss) * n
            rows += n
    return total / rows


def test_lora_saves_the_adapter_and_the_merged_model_with_perplexity_and_samples(tmp_path, case, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    assert main([*case, f"output_dir={out}", "merge_adapter=true"]) == 0
    said = capsys.readouterr().out
    assert "packing on: sdpa attention keeps packed examples apart (checked on this model)" in said
    assert "packed 32 train examples into" in said and "(lora)" in said
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()  # the adapter, not a copy of the base

    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_perplexity"] == math.exp(results["eval_loss"])
    assert results["eval_loss"] == pytest.approx(eval_loss_by_hand(case, out), rel=1e-5)

    base_dir = Path(case[0].split("=", 1)[1])
    ids = torch.tensor([[5, 17, 42, 99, 123, 7, 250]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
        before = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, out).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()(input_ids=ids).logits
    assert torch.allclose(merged, adapted, atol=1e-5)
    assert (merged - before).abs().max() > 1e-2  # the adapter learnt something: the comparison means something

    samples = json.loads((out / "generations.json").read_text())["samples"]
    assert [s["prompt"] for s in samples] == ["What is the sum of 100 and 2?", "What is the sum of 101 and 3?"]
    assert all(s["reference"].startswith("The sum is") and isinstance(s["before"], str) and isinstance(s["after"], str)
               for s in samples)
    report = (out / "report.md").read_text()
    assert "## Generation samples" in report and report.count("**After training:**") == 2


class StopAfterCheckpoint(TrainerCallback):
    """Kill the run (an exception out of trainer.train) once checkpoint-N is complete."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"stopped after checkpoint-{self.step}")
        return control


def test_a_run_resumed_from_an_adapter_checkpoint_ends_with_the_uninterrupted_adapter(tmp_path, case):
    from hf_gpu_train.finetune.loading import load_config
    from hf_gpu_train.finetune.run import finetune

    arguments = [*case, "num_train_epochs=2", "save_strategy=steps", "save_steps=3", "eval_strategy=no", "telemetry=false",
                 "generation_samples=0"]
    reference = tmp_path / "reference"
    assert main([*arguments, f"output_dir={reference}"]) == 0
    steps = json.loads((reference / "run_summary.json").read_text())["global_step"]
    assert steps > 3

    out = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        finetune(load_config(None, [*arguments, f"output_dir={out}"]), extra_callbacks=[StopAfterCheckpoint(3)])
    assert not (out / "adapter_model.safetensors").exists()
    at_checkpoint = load_file(out / "checkpoint-3" / "adapter_model.safetensors")
    assert main([*arguments, f"output_dir={out}"]) == 0
    assert json.loads((out / "run_summary.json").read_text())["global_step"] == steps
    resumed, expected = load_file(out / "adapter_model.safetensors"), load_file(reference / "adapter_model.safetensors")
    assert_same_params(resumed, expected)
    assert_trained(expected, at_checkpoint)  # the steps after the checkpoint moved the adapter well beyond the tolerance


def test_full_fine_tuning_without_packing_saves_the_model(tmp_path, case, capsys):
    out = tmp_path / "full"
    assert main([*case, f"output_dir={out}", "method=full", "packing=false", "learning_rate=1e-3", "telemetry=false"]) == 0
    said = capsys.readouterr().out
    assert "packing off (packing=false): examples padded to the longest in each batch" in said
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_perplexity"] == math.exp(results["eval_loss"])


@pytest.fixture
def leaky_attention():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal_only(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True,
                                      **{k: v for k, v in kwargs.items() if k != "is_causal"})

    AttentionInterface.register("causal_only_for_test", causal_only)
    return "attn_implementation=causal_only_for_test"


def test_attention_that_cannot_keep_examples_apart_falls_back_to_padding_or_stops_when_packing_is_required(
        tmp_path, case, capsys, leaky_attention):
    out = tmp_path / "fallback"
    assert main([*case, leaky_attention, f"output_dir={out}", "telemetry=false", "generation_samples=0"]) == 0
    said = capsys.readouterr().out
    assert "packing off (attn_implementation='causal_only_for_test' is not known to keep packed examples apart" in said, said
    required = tmp_path / "required"
    assert main([*case, leaky_attention, "packing=true", f"output_dir={required}"]) == 2
    assert "packing=true, but attn_implementation='causal_only_for_test'" in capsys.readouterr().err
    assert not required.exists()


def write_case(root: Path, rows: list[dict], name: str) -> str:
    return f"train_file={write_jsonl(root / f'{name}.jsonl', rows)}"


@pytest.mark.parametrize("data, extra, message", [
    ([{"question": "q", "answer": "a"}] * 4, [], "no usable text column in the train split"),
    ([{"prompt": "p", "completion": "c"}] * 3 + [{"prompt": "p", "completion": ""}], [], "have an empty completion"),
    (None, ["max_length=8"], "no train example keeps a token to learn within max_length=8"),
    (None, ["method=qlora"], "method=qlora needs an NVIDIA GPU with CUDA"),
    (None, ["lora_target_modules=nothing_like_this"], "lora_target_modules='nothing_like_this'"),
])
def test_bad_input_exits_2_naming_the_fix_and_writes_nothing(tmp_path, case, capsys, monkeypatch, data, extra, message):
    from hf_gpu_train.finetune.tasks.language_modeling import model as lm_model

    arguments = [*case, *extra, f"output_dir={tmp_path / 'out'}"]
    if data is not None:
        arguments = [a for a in arguments if not a.startswith(("train_file=", "validation_file="))] + [write_case(tmp_path, data, "bad")]
    if "method=qlora" in extra:  # checked before the model loads
        monkeypatch.setattr(lm_model, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(arguments) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_chat_data_for_a_tokenizer_without_a_chat_template_exits_2(tmp_path, case, capsys):
    model = save_tiny_model(tmp_path / "base-model", template=None)
    arguments = [a for a in case if not a.startswith("model=")] + [f"model={model}", f"output_dir={tmp_path / 'out'}"]
    assert main(arguments) == 2
    assert "has no chat template: give one with chat_template=FILE.jinja" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_memory_levers_train_the_weights_of_a_run_without_them(tmp_path, case, capsys):
    """Issue 19 through the entry point: selective checkpointing, the optimizer in the backward and activation
    offloading (nothing to offload on the CPU, said) end with the weights of the same run without them."""
    common = [*case, "method=full", "packing=false", "learning_rate=1e-3", "telemetry=false", "generation_samples=0",
              "extra={max_grad_norm: 0}"]
    assert main([*common, f"output_dir={tmp_path / 'plain'}"]) == 0
    capsys.readouterr()
    assert main([*common, f"output_dir={tmp_path / 'levers'}", "gradient_checkpointing=true", "checkpoint_layers=selective",
                 "optimizer_in_backward=true", "offload_activations=true"]) == 0
    said = capsys.readouterr().out
    assert "checkpointing: selective" in said
    assert "optimizer in backward: each parameter steps (AdamW)" in said
    assert "activation offloading: nothing to do on the CPU" in said
    assert "in-place OOM recovery off" in said
    plain, levers = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("plain", "levers"))
    assert_same_params(levers, plain, atol=1e-6)
    from tests.finetune.tasks.language_modeling.tiny import tiny_llama

    untrained = {k: v for k, v in tiny_llama(plain["model.embed_tokens.weight"].shape[0]).state_dict().items() if k in plain}
    assert_trained(plain, untrained)


def test_optimizer_in_backward_with_accumulation_exits_2_naming_the_fix(tmp_path, case, capsys):
    assert main([*case, f"output_dir={tmp_path / 'acc'}", "method=full", "optimizer_in_backward=true", "global_batch_size=8",
                 "telemetry=false"]) == 2
    assert "set global_batch_size to the micro-batch" in capsys.readouterr().err
