"""The chunked LM head and loss (issue 19, lever 1) is exact: the same loss and gradients as the model's own forward
(transformers' ForCausalLMLoss), for plain and packed batches, with and without num_items_in_batch, full and LoRA."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_gpu_train.finetune.tasks.language_modeling import lm_head_loss
from hf_gpu_train.finetune.tasks.language_modeling.lm_head_loss import install, linear_cross_entropy, support
from tests.finetune.tasks.language_modeling.tiny import tiny_llama

TOL = dict(rtol=1e-5, atol=1e-6)


def test_the_function_matches_cross_entropy_of_the_full_logits():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    bias = torch.randn(50, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    scale = torch.tensor(1 / 29.0)
    got = linear_cross_entropy(hidden, weight, bias, targets, scale, chunk=8) * 3.0  # a later factor (accumulation)
    got.backward()
    grads = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    want = torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight, bias).float(), targets,
                                             reduction="sum") / 29.0 * 3.0
    want.backward()
    torch.testing.assert_close(got, want, **TOL)
    for g, t in zip(grads, (hidden, weight, bias)):
        torch.testing.assert_close(g, t.grad, **TOL)


def _batch(packed: bool):
    torch.manual_seed(1)
    ids = torch.randint(3, 120, (2, 24))
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt
    labels[1, 18:] = -100  # padding
    batch = {"input_ids": ids, "labels": labels, "use_cache": False}
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    else:
        batch["attention_mask"] = (labels != -100).long() | (torch.arange(24) < 7).long()
    return batch


def _loss_and_grads(model, batch, **extra):
    model.zero_grad()
    out = model(**batch, **extra)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("items", [None, 40], ids=["mean", "num_items_in_batch"])
def test_full_fine_tuning_same_loss_and_gradients_as_the_models_own_forward(packed, items):
    reference = tiny_llama(128).train()
    chunked = copy.deepcopy(reference)
    assert install(chunked, chunk=5).supported
    extra = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    want, want_grads = _loss_and_grads(reference, _batch(packed), **extra)
    got, got_grads = _loss_and_grads(chunked, _batch(packed), **extra)
    torch.testing.assert_close(got, want, **TOL)
    assert got_grads.keys() == want_grads.keys() and "lm_head.weight" in got_grads
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL, msg=name)


def test_lora_same_loss_and_adapter_gradients_and_generation_untouched():
    from peft import LoraConfig, get_peft_model

    def lora(model):
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))

    base = tiny_llama(128)
    reference, chunked = lora(copy.deepcopy(base)), lora(copy.deepcopy(base))
    chunked.load_state_dict(reference.state_dict())
    assert install(chunked, chunk=7).supported
    want, want_grads = _loss_and_grads(reference, _batch(True))
    got, got_grads = _loss_and_grads(chunked, _batch(True))
    torch.testing.assert_close(got, want, **TOL)
    assert all("lora_" in n for n in got_grads) and got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL, msg=name)
    prompt = torch.tensor([[5, 6, 7]])
    with torch.no_grad():  # no labels: the model's own forward, logits and all
        torch.testing.assert_close(chunked(input_ids=prompt).logits, reference(input_ids=prompt).logits)


def test_a_head_that_does_more_than_a_matmul_is_left_alone():
    model = tiny_llama(64)
    model.config.final_logit_softcapping = 30.0
    verdict = support(model)
    assert not verdict.supported and "final_logit_softcapping" in verdict.reason
    assert not install(model).supported and not hasattr(model, "_hf_gpu_train_chunked_loss")


def test_no_full_logits_are_made(monkeypatch):
    """The head's matmul never sees more than ``chunk`` rows, and only rows with a label."""
    seen = []
    linear = torch.nn.functional.linear

    def spy(x, w, b=None):
        seen.append(x.shape[0])
        return linear(x, w, b)

    model = tiny_llama(128)
    install(model, chunk=6)
    monkeypatch.setattr(lm_head_loss.torch.nn.functional, "linear", spy)
    batch = _batch(False)
    model(**batch).loss.backward()
    labelled = int((torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:] != -100).sum())
    chunks = (labelled + 5) // 6
    head_rows = seen[-chunks:]  # the last calls are the head's chunks
    assert max(head_rows) <= 6 and sum(head_rows) == labelled


def test_tied_embeddings_get_both_gradients():
    """SmolLM2 ties its head to the input embeddings: the shared weight's gradient sums both uses."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=2)
    reference = LlamaForCausalLM(config).train()
    chunked = copy.deepcopy(reference)
    chunked.tie_weights()
    assert chunked.lm_head.weight is chunked.model.embed_tokens.weight
    assert install(chunked, chunk=5).supported
    want, want_grads = _loss_and_grads(reference, _batch(True))
    got, got_grads = _loss_and_grads(chunked, _batch(True))
    torch.testing.assert_close(got, want, **TOL)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL, msg=name)


def test_an_evaluation_makes_no_gradients_and_fp16_keeps_the_models_own():
    model = tiny_llama(128).train()
    install(model, chunk=5)
    with torch.no_grad():
        loss = model(**_batch(False)).loss
    assert loss.grad_fn is None and torch.isfinite(loss)
    assert not support(tiny_llama(64), precision="fp16").supported  # the loss scale would reach the gradients too late


def _fake_kernels(monkeypatch, calls: list):
    """Liger's and Cut Cross-Entropy's functions as plain PyTorch on the full logits (their kernels are Triton and CUDA):
    what the install path hands them is checked, not their arithmetic."""
    import sys
    import types

    def full_ce(hidden, weight, targets, bias=None, reduction="sum"):
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight, bias).float(), targets,
                                                 reduction=reduction)

    def liger(input, weight, target, bias=None, reduction="mean", **kwargs):
        calls.append(("liger", input.shape[0], reduction, kwargs))
        return full_ce(input, weight, target, bias, reduction)

    def cce(e, c, targets, reduction="mean", filter_eps="high", **kwargs):
        calls.append(("cce", e.shape[0], reduction, {"filter_eps": filter_eps, **kwargs}))
        return full_ce(e, c, targets, None, reduction)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    cut = types.ModuleType("cut_cross_entropy")
    cut.linear_cross_entropy = cce
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", cut)


@pytest.mark.parametrize("kernel", ["liger", "cce"])
def test_a_fused_kernel_gets_the_labelled_rows_summed_and_the_same_scale(monkeypatch, kernel):
    calls = []
    _fake_kernels(monkeypatch, calls)
    reference = tiny_llama(128).train()
    fused = copy.deepcopy(reference)
    verdict = install(fused, kernel=kernel)
    assert verdict.supported and lm_head_loss.KERNELS[kernel][1] in verdict.reason
    extra = {"num_items_in_batch": torch.tensor(40)}
    want, want_grads = _loss_and_grads(reference, _batch(True), **extra)
    got, got_grads = _loss_and_grads(fused, _batch(True), **extra)
    torch.testing.assert_close(got, want, **TOL)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL, msg=name)
    (name, rows, reduction, kwargs), = calls
    labelled = int((torch.nn.functional.pad(_batch(True)["labels"], (0, 1), value=-100)[..., 1:] != -100).sum())
    assert (name, rows, reduction) == (kernel, labelled, "sum")  # ignored rows never reach the kernel
    if kernel == "cce":
        assert kwargs["filter_eps"] is None  # its default skips small gradient entries: not exact


def test_a_fused_kernel_is_refused_where_it_cannot_run(monkeypatch):
    assert "CUDA only" in lm_head_loss.kernel_problem("liger", on_cuda=False)
    monkeypatch.setitem(__import__("sys").modules, "cut_cross_entropy", None)  # not installed
    assert "pip install cut-cross-entropy" in lm_head_loss.kernel_problem("cce", on_cuda=True)


def test_a_head_extra_no_config_names_is_found_by_running_the_model():
    """A logit multiplier that no config key in HEAD_EXTRAS names (a hook stands for a model's own ``logits * m``): the
    probe compares the model's logits with its head's matmul of the decoder's output and keeps the model's own head."""
    model = tiny_llama(128)
    model.lm_head.register_forward_hook(lambda module, inputs, output: output * 0.25)
    assert support(model).supported  # nothing in the config says so
    verdict = install(model)
    assert not verdict.supported and "differ by" in verdict.reason
    assert not hasattr(model, "_hf_gpu_train_chunked_loss")


def test_a_loss_of_the_models_own_is_found_by_running_the_model():
    from transformers.loss.loss_utils import ForCausalLMLoss

    model = tiny_llama(128)
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: ForCausalLMLoss(logits, labels, vocab_size, **kwargs) * 1.5
    verdict = install(model)
    assert not verdict.supported and "cross-entropy" in verdict.reason


def test_falcon_h1s_lm_head_multiplier_keeps_its_own_head():
    """Falcon-H1 multiplies its logits by ``lm_head_multiplier``: the chunked loss would differ (4.848 against 4.845 on
    a tiny one, more with real multipliers). Named in HEAD_EXTRAS, and found by the probe anyway."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    torch.manual_seed(0)
    config = FalconH1Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
                            mamba_n_groups=1, mamba_chunk_size=16, lm_head_multiplier=0.25)
    model = FalconH1ForCausalLM(config).eval()
    assert "lm_head_multiplier" in support(model).reason
    assert not install(model).supported
    assert "differ by" in lm_head_loss.head_probe(model).reason  # the probe alone finds it too
    from hf_gpu_train.plan.model_spec import lm_head_extras

    assert lm_head_extras(config) == ("lm_head_multiplier",)  # the planner counts the full logits for it


def test_a_plain_model_is_checked_by_running_it():
    verdict = install(tiny_llama(128))
    assert verdict.supported and "checked on this model" in verdict.reason


def test_the_forward_keeps_its_signature_for_the_trainers_column_filter(tmp_path):
    """The Trainer drops the dataset columns the model's forward does not name (remove_unused_columns=True, its
    default): the installed forward must name the model's own arguments, or input_ids and labels are dropped."""
    import inspect

    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = tiny_llama(128).train()
    install(model, chunk=5)
    assert {"input_ids", "labels", "attention_mask"} <= set(inspect.signature(model.forward).parameters)
    rows = Dataset.from_dict({"input_ids": [[5, 6, 7, 8]] * 4, "labels": [[5, 6, 7, 8]] * 4, "note": ["x"] * 4})
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    result = Trainer(model=model, args=args, train_dataset=rows).train()
    assert result.training_loss > 0


def test_attentions_asked_for_get_the_models_own_forward():
    model = tiny_llama(128, attn_implementation="eager").train()
    install(model, chunk=5)
    out = model(**_batch(False), output_attentions=True)
    assert out.attentions is not None and out.logits is not None


def test_under_bf16_autocast_the_heads_weight_gradient_is_a_16_bit_product(monkeypatch):
    """In fp32 the weight gradient accumulates in place (no vocabulary x hidden temporary); under autocast the model's
    own head makes it with a 16-bit GEMM, and so does the chunked head (an in-place fp32 addmm_ escapes autocast: a full
    fp32 GEMM, an order of magnitude slower on tensor cores). Same gradients within bf16's precision."""
    seen = []
    original = lm_head_loss.accumulate_weight_grad

    def spy(grad_weight, grad, h, dtype=None):
        seen.append(dtype)
        return original(grad_weight, grad, h, dtype)

    monkeypatch.setattr(lm_head_loss, "accumulate_weight_grad", spy)
    monkeypatch.setattr(lm_head_loss, "VOCAB_SLICE_BYTES", 32 * 40)  # 20 vocabulary rows of 32 a product: several slices
    reference = tiny_llama(128).train()
    chunked = copy.deepcopy(reference)
    install(chunked, chunk=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = _loss_and_grads(reference, _batch(False))
        got, got_grads = _loss_and_grads(chunked, _batch(False))
    assert seen and set(seen) == {torch.bfloat16}
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    w, g = want_grads["lm_head.weight"], got_grads["lm_head.weight"]
    assert float((w - g).norm() / w.norm()) < 2e-2  # bf16 products: about 1e-3 apart
    seen.clear()
    _loss_and_grads(chunked, _batch(False))  # no autocast: the fp32 in-place path
    assert seen == [None] * len(seen) and seen


def test_a_zero3_launch_keeps_the_models_own_head_before_the_trainer_exists(monkeypatch, tmp_path):
    """accelerate exports a ZeRO-3 launch config to the processes; transformers learns of it only with the
    TrainingArguments, after the model loads. The chunked head reads the head's weight outside its forward, where
    ZeRO-3 keeps it partitioned: refused from the launch's environment (a YAML's zero_stage, or the config file's)."""
    import json

    for key in ("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert "ZeRO-3" in support(tiny_llama(64)).reason
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert support(tiny_llama(64)).supported
    from hf_gpu_train.plan.deepspeed_config import deepspeed_file_for

    file = tmp_path / "ds.json"
    file.write_text(json.dumps(deepspeed_file_for(3, offload_params=True)))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(file))  # the file's stage wins over the YAML key
    assert not support(tiny_llama(64)).supported
    assert not install(tiny_llama(64)).supported


def test_the_run_probes_where_the_model_trains_and_takes_a_refused_head_off_again():
    """scripts/finetune.py installs the head when the model loads (on the CPU, where a model that runs on the GPU only
    could not be probed) and confirms it once the Trainer has placed the model: a head the probe refuses is taken off
    again, and the model's own forward (logits and loss) is back; chunked_lm_loss=true makes the refusal a usage error."""
    from types import SimpleNamespace

    from hf_gpu_train.finetune.config import ConfigError
    from hf_gpu_train.finetune.tasks.language_modeling.prepare import confirm_chunked_head

    reference = tiny_llama(128).train()
    scaled = copy.deepcopy(reference)
    for model in (reference, scaled):
        model.lm_head.register_forward_hook(lambda module, inputs, output: output * 0.25)
    assert install(scaled, chunk=5, probe=False).supported and lm_head_loss.installed(scaled)
    line = confirm_chunked_head(scaled, SimpleNamespace(chunked_lm_loss="auto"), "fp32")
    assert line.startswith("LM head and loss: the model's own after all") and not lm_head_loss.installed(scaled)
    assert "forward" not in vars(scaled)  # the class's own forward again
    want, _ = _loss_and_grads(reference, _batch(False))
    got, _ = _loss_and_grads(scaled, _batch(False))
    torch.testing.assert_close(got, want)
    asked = tiny_llama(128)
    asked.lm_head.register_forward_hook(lambda module, inputs, output: output * 0.25)
    install(asked, probe=False)
    with pytest.raises(ConfigError, match="chunked_lm_loss=true, but its logits are not its head's matmul"):
        confirm_chunked_head(asked, SimpleNamespace(chunked_lm_loss=True), "fp32")
    plain = tiny_llama(128)
    install(plain, probe=False)
    assert "checked on this model, on cpu" in confirm_chunked_head(plain, SimpleNamespace(chunked_lm_loss="auto"), "bf16")
    assert confirm_chunked_head(tiny_llama(128), SimpleNamespace(chunked_lm_loss="auto"), "fp32") is None  # none installed


def test_a_16_bit_head_without_autocast_gets_a_16_bit_weight_gradient_product(monkeypatch):
    """Pure bf16 training (or DeepSpeed's bf16 module cast) has no autocast: the weight's own dtype decides."""
    seen = []
    original = lm_head_loss.accumulate_weight_grad
    monkeypatch.setattr(lm_head_loss, "accumulate_weight_grad", lambda gw, g, h, dtype=None: seen.append(dtype) or original(gw, g, h, dtype))
    hidden = torch.randn(9, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.bfloat16, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, None, torch.randint(0, 40, (9,)), torch.tensor(1 / 9), chunk=4)
    loss.backward()
    assert seen and set(seen) == {torch.bfloat16} and weight.grad.dtype == torch.bfloat16
