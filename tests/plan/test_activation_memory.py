"""The Llama-family activation formula against what autograd really keeps, byte for byte.

A small Llama (hidden 256, MLP 704, 8 heads, 2 key/value heads) runs one forward with
``saved_tensors_hooks`` counting every tensor kept for the backward once (by storage) and leaving out the
parameters. Two depths (2 and 4 layers) differ by exactly two layers, so their difference is two layers'
activations with nothing else in it; that must equal ``gated_layer_bytes_per_token`` plus the weight copies
autocast keeps (counted by hand below).
"""

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_gpu_train.plan.activations import activation_terms, gated_layer_bytes_per_token  # noqa: E402
from hf_gpu_train.plan.model_spec import ModelSpec, from_config  # noqa: E402
from hf_gpu_train.plan.training_shape import TrainingShape  # noqa: E402

H, INTER, HEADS, KV_HEADS, VOCAB, SEQ, BATCH, RANK = 256, 704, 8, 2, 1000, 128, 2, 8
TOKENS = SEQ * BATCH
# linear weights of one layer: q 256x256, k and v 256x64, o 256x256, gate/up/down 256x704
LAYER_LINEAR_WEIGHTS = 256 * 256 * 2 + 256 * 64 * 2 + 256 * 704 * 3  # = 704,512
# LoRA rank 8 on those seven: r(d_in + d_out) = 8 * ((256+256) + (256+64)*2 + (256+256) + (256+704)*3) = 36,352
LAYER_ADAPTER_PARAMS = 8 * (512 + 320 * 2 + 512 + 960 * 3)


def config(layers: int):
    return transformers.LlamaConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=layers, num_attention_heads=HEADS,
                                    num_key_value_heads=KV_HEADS, vocab_size=VOCAB, tie_word_embeddings=False,
                                    attn_implementation="sdpa")


def batch(padded: bool):
    """(ids, attention mask): the second row padded after 100 tokens when ``padded``."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if padded:
        mask[1, 100:] = 0
    return ids, mask


def saved_bytes(model, padded: bool, autocast: bool) -> int:
    """Bytes autograd keeps for the backward of one forward (each storage once, parameters left out). The parameters
    are told apart when the forward has ended: bitsandbytes may lay out its 4-bit weights anew in the first forward,
    freeing the old storages, and a saved tensor given a freed weight's address was once left out as a parameter
    (the count changed from run to run). The saved tensors are held until then, so no two share an address."""
    ids, mask = batch(padded)
    saved: list = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            output = model(input_ids=ids, attention_mask=mask, labels=ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    saved.clear()
    del output
    return sum(size for address, size in sizes.items() if address not in params)


def build(method: str, layers: int, precision: str):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config(layers))
    if method == "full":
        return model
    peft = pytest.importorskip("peft")
    if precision == "bf16":
        model = model.to(torch.bfloat16)  # the LoRA base in the compute dtype, as the finetune loads it
    return peft.get_peft_model(model, peft.LoraConfig(r=RANK, target_modules="all-linear", task_type="CAUSAL_LM"))


def per_layer_per_token(method: str, precision: str, padded: bool) -> float:
    autocast = precision == "bf16"
    two, four = (saved_bytes(build(method, n, precision), padded, autocast) for n in (2, 4))
    return (four - two) / 2 / TOKENS


SPEC = ModelSpec(name="tiny-llama", params=0, num_layers=4, hidden_size=H, num_heads=HEADS, vocab_size=VOCAB, causal_lm=True,
                 num_kv_heads=KV_HEADS, head_dim=H // HEADS, intermediate_size=INTER, gated_mlp=True)


def test_the_formula_by_hand_for_one_configuration():
    # full fine-tuning, bf16 autocast, padded batch, per token and layer:
    # norms 2(8h+4) = 4104; five autocast input copies 2*5h = 2560; down input 2I = 1408;
    # SDPA q, expanded k and v, output 2*(4*256) = 2048, log-sum-exp 4*8 = 32, mask 2*128 = 256; MLP 3*2I = 4224
    shape = TrainingShape(micro_batch=BATCH, seq_len=SEQ, precision="bf16", method="full", padded=True)
    assert gated_layer_bytes_per_token(SPEC, shape) == 4104 + 2560 + 1408 + 2048 + 32 + 256 + 4224  # 14,632


@pytest.mark.parametrize("padded", [True, False])
def test_full_finetuning_bf16_autocast(padded):
    shape = TrainingShape(micro_batch=BATCH, seq_len=SEQ, precision="bf16", method="full", padded=padded)
    # autocast also keeps a bf16 copy of each fp32 weight for the backward: 2 bytes x the layer's linear weights,
    # a weight term (the planner's 16 bytes per parameter covers it), not an activation
    weight_copies = 2 * LAYER_LINEAR_WEIGHTS / TOKENS
    assert per_layer_per_token("full", "bf16", padded) == gated_layer_bytes_per_token(SPEC, shape) + weight_copies


def test_full_finetuning_fp32():
    shape = TrainingShape(micro_batch=BATCH, seq_len=SEQ, precision="fp32", method="full", padded=True)
    assert per_layer_per_token("full", "fp32", True) == gated_layer_bytes_per_token(SPEC, shape)


@pytest.mark.parametrize("precision,padded", [("bf16", True), ("bf16", False), ("fp32", True)])
def test_lora(precision, padded):
    shape = TrainingShape(micro_batch=BATCH, seq_len=SEQ, precision=precision, method="lora", lora_rank=RANK, padded=padded)
    spec = replace(SPEC, adapted_linears=7 * 4, adapted_in_features=(256 * 5 + 256 + 704) * 4,
                   adapted_out_features=(256 + 64 * 2 + 256 + 704 * 2 + 256) * 4)
    # under autocast the fp32 adapters get a bf16 copy each (the planner's "16-bit working copies")
    copies = 2 * LAYER_ADAPTER_PARAMS / TOKENS if precision == "bf16" else 0
    assert per_layer_per_token("lora", precision, padded) == gated_layer_bytes_per_token(spec, shape) + copies


def test_whole_model_within_half_a_percent_of_what_autograd_keeps():
    """Beyond the layers: the output head and the loss (saved: the fp32 log-softmax, 4 bytes per vocabulary
    entry; the planner's 12 is the backward's peak), plus a few small tensors (ids, rotary tables)."""
    shape = TrainingShape(micro_batch=BATCH, seq_len=SEQ, precision="bf16", method="full", padded=True)
    spec = replace(SPEC, num_layers=4)
    terms = activation_terms(spec, shape)
    predicted = terms["layers"] + terms["output head"] + 4 * VOCAB * TOKENS + 2 * LAYER_LINEAR_WEIGHTS * 4 + 2 * H * VOCAB
    measured = saved_bytes(build("full", 4, "bf16"), padded=True, autocast=True)
    assert abs(measured - predicted) / measured < 0.005
    assert terms["loss"] == 12 * VOCAB * TOKENS


def test_the_chunked_head_and_loss_keep_what_the_planner_says():
    """Issue 19, lever 1: with the chunked LM head and loss the backward keeps the hidden states' gradient (fp32 here:
    the final norm's output, full fine-tuning), the labelled rows' mask and the head weight's gradient (computed in
    the forward: it is the gradient the planner counts per parameter, early), not the logits' log-softmax and not the
    head's input or its bf16 weight copy."""
    from hf_gpu_train.finetune.tasks.language_modeling.lm_head_loss import install

    shape = TrainingShape(micro_batch=BATCH, seq_len=SEQ, precision="bf16", method="full", padded=True, chunked_loss=True,
                          loss_chunk=64)
    spec = replace(SPEC, num_layers=4)
    terms = activation_terms(spec, shape)
    labelled = BATCH * (SEQ - 1)  # labels = ids: the last position of each row predicts nothing
    kept_by_the_loss = 4 * H * labelled + TOKENS  # the hidden states' gradient, and the boolean mask
    head_gradient = 4 * H * VOCAB
    predicted = terms["layers"] + terms["output head"] + kept_by_the_loss + head_gradient + 2 * LAYER_LINEAR_WEIGHTS * 4
    model = build("full", 4, "bf16")
    install(model, chunk=64)
    measured = saved_bytes(model, padded=True, autocast=True)
    assert abs(measured - predicted) / measured < 0.005, (measured, predicted)
    assert terms["output head"] == (8 * H + 4) * TOKENS  # the final norm only: its input and normalised input, fp32
    assert terms["loss"] == 12 * VOCAB * 64 + (4 * H + 1) * TOKENS  # one chunk's peak, and what is kept (all rows)
    unchunked = activation_terms(spec, replace(shape, chunked_loss=False))
    assert sum(terms.values()) < sum(unchunked.values())


def test_meta_census_matches_the_config_arithmetic():
    spec = from_config(config(4), name="tiny")
    assert spec.gated_mlp and spec.causal_lm
    assert spec.adapted_linears == 7 * 4
    assert spec.adapted_in_features + spec.adapted_out_features == LAYER_ADAPTER_PARAMS // RANK * 4
    assert spec.quantized_params == LAYER_LINEAR_WEIGHTS * 4  # every linear weight but the output head
    assert spec.largest_linear_params == 256 * 704


def test_qlora_keeps_the_mlp_in_fp32(tmp_path):
    """QLoRA as the finetune runs it: NF4 base (bitsandbytes runs 4-bit on the CPU too), then
    prepare_model_for_kbit_training (norms and embeddings to fp32), then LoRA. Linear4bit returns its input's
    dtype, fp32, so the MLP's gate, SiLU and up outputs are kept in fp32: 3 x 4I instead of 3 x 2I."""
    pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=torch.bfloat16)

    def qlora(layers):
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config(layers)).to(torch.bfloat16).save_pretrained(tmp_path / str(layers))
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / str(layers), quantization_config=quant,
                                                                  dtype=torch.bfloat16, attn_implementation="sdpa")
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        return peft.get_peft_model(model, peft.LoraConfig(r=RANK, target_modules="all-linear", task_type="CAUSAL_LM"))

    two, four = (saved_bytes(qlora(n), padded=True, autocast=True) for n in (2, 4))
    shape = TrainingShape(micro_batch=BATCH, seq_len=SEQ, precision="bf16", method="qlora", lora_rank=RANK, padded=True)
    lora = replace(shape, method="lora")
    assert gated_layer_bytes_per_token(SPEC, shape) - gated_layer_bytes_per_token(SPEC, lora) == 3 * (4 - 2) * INTER
    assert (four - two) / 2 / TOKENS == gated_layer_bytes_per_token(SPEC, shape) + 2 * LAYER_ADAPTER_PARAMS / TOKENS


class LiveStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Every storage an op creates, weakly held: what is still alive when the forward ends is what the forward
    leaves for the backward (and its outputs). Unlike ``saved_tensors_hooks`` it sees what a checkpoint keeps,
    which it holds outside autograd's saved tensors (the layer inputs, selective checkpointing's cached outputs)."""

    def __init__(self):
        super().__init__()
        self.created = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.created.append((storage.data_ptr(), StorageWeakRef(storage), storage.nbytes()))
        return out

    def alive_bytes(self, leave_out: set) -> int:
        return sum({ptr: size for ptr, ref, size in self.created if not ref.expired() and ptr not in leave_out}.values())


def checkpoint(model, policy: str) -> None:
    from hf_gpu_train.levers import selective_checkpoint

    if policy.startswith("selective"):
        selective_checkpoint.enable(model, policy)
    else:
        every = 1 if policy == "all" else int(policy.split("-")[1])
        model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every)


def alive_after_forward(model, padded: bool, autocast: bool) -> int:
    ids, mask = batch(padded)
    model.train()
    live = LiveStorages()
    with live, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
    alive = live.alive_bytes(leave_out={p.untyped_storage().data_ptr() for p in model.parameters()})  # views of weights
    del out
    return alive


@pytest.mark.parametrize("method,precision,padded,policy", [
    ("full", "bf16", True, "all"), ("full", "bf16", True, "every-2"), ("full", "bf16", False, "selective"),
    ("full", "fp32", True, "selective"), ("lora", "bf16", False, "selective"), ("lora", "fp32", True, "every-2"),
    ("full", "bf16", False, "selective-lean"), ("lora", "fp32", False, "selective-lean"), ("full", "fp32", True, "selective-lean"),
    ("lora", "bf16", True, "selective-lean")])
def test_checkpointing_policies_keep_what_the_planner_says(method, precision, padded, policy):
    """Issue 19, lever 2: per-layer checkpointing keeps each layer's input; every-N keeps that for every N-th layer
    and everything for the others; selective keeps the input plus the matmuls' and attention's outputs. Two layers'
    difference, measured as the storages alive after the forward, equals the planner's (the recompute peak of one
    layer, counted in its "layers" term, cancels out)."""
    shape = TrainingShape(micro_batch=BATCH, seq_len=SEQ, precision=precision, method=method, lora_rank=RANK, padded=padded,
                          gradient_checkpointing=True, checkpoint_layers=policy)
    spec = replace(SPEC, adapted_linears=7, adapted_in_features=256 * 5 + 256 + 704,
                   adapted_out_features=256 + 64 * 2 + 256 + 704 * 2 + 256) if method == "lora" else SPEC

    def predicted(layers):
        scaled = replace(spec, num_layers=layers, **({} if method == "full" else {
            "adapted_linears": spec.adapted_linears * layers, "adapted_in_features": spec.adapted_in_features * layers,
            "adapted_out_features": spec.adapted_out_features * layers}))
        return sum(activation_terms(scaled, shape).values())

    def measured(layers):
        model = build(method, layers, precision)
        checkpoint(model, policy)
        return alive_after_forward(model, padded, autocast=precision == "bf16")

    # layers outside the checkpoints also keep autocast's bf16 copies of their weights (full) or adapters (LoRA)
    copies = 0
    if precision == "bf16":
        per_layer = 2 * (LAYER_LINEAR_WEIGHTS if method == "full" else LAYER_ADAPTER_PARAMS)
        copies = per_layer * ((4 - shape.checkpointed_layers(4)) - (2 - shape.checkpointed_layers(2)))
    assert measured(4) - measured(2) == predicted(4) - predicted(2) + copies


def test_selective_checkpointing_keeps_about_half_of_a_layer():
    full = TrainingShape(micro_batch=BATCH, seq_len=SEQ, precision="bf16", method="full", padded=False)
    selective = replace(full, gradient_checkpointing=True, checkpoint_layers="selective")
    every_layer = replace(selective, checkpoint_layers="all")
    kept = {name: activation_terms(replace(SPEC, num_layers=32), s)["layer inputs" if s.gradient_checkpointing else "layers"]
            for name, s in (("none", full), ("selective", selective), ("all", every_layer))}
    assert kept["all"] < kept["selective"] < 0.75 * kept["none"]


def test_offloading_under_selective_checkpointing_takes_the_kept_outputs_too():
    """Selective checkpointing keeps its matmuls' outputs outside autograd's graph; unless the checkpoint routes them
    through the saved-tensor hooks, offloading would leave them on the GPU while the planner counts them as moved.
    Two layers' difference of what the hooks copy (fp32, full fine-tuning) is two layers' selective outputs."""
    from hf_gpu_train.levers.activation_offload import OffloadActivations
    from hf_gpu_train.plan.activations import selective_kept_bytes_per_token

    def copied(layers, policy):
        model = build("full", layers, "fp32")
        checkpoint(model, policy)
        model.train()
        torch.manual_seed(0)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        hooks = OffloadActivations(model.parameters(), min_bytes=0, offload_cpu_tensors=True)
        with hooks:
            model(input_ids=ids, labels=ids).loss.backward()
        return hooks.offloaded_bytes

    shape = TrainingShape(micro_batch=BATCH, seq_len=SEQ, precision="fp32", method="full", padded=False)
    extra = (copied(4, "selective") - copied(2, "selective")) - (copied(4, "all") - copied(2, "all"))
    assert extra == 2 * selective_kept_bytes_per_token(SPEC, shape) * TOKENS


def test_lean_selective_checkpointing_under_eager_attention_keeps_what_the_planner_says():
    """Review of issue 19: eager attention's score matrix is a widening batched matmul (inner dimension the head's 32,
    output the 128 keys): lean selective checkpointing recomputes it and keeps only attention's output."""
    def measured(layers):
        torch.manual_seed(0)
        cfg = config(layers)
        cfg._attn_implementation = "eager"
        model = transformers.LlamaForCausalLM(cfg)
        checkpoint(model, "selective-lean")
        return alive_after_forward(model, padded=False, autocast=False)

    shape = TrainingShape(micro_batch=BATCH, seq_len=SEQ, precision="fp32", method="full", padded=False, attention="eager",
                          gradient_checkpointing=True, checkpoint_layers="selective-lean")
    predicted = [sum(activation_terms(replace(SPEC, num_layers=n), shape).values()) for n in (2, 4)]
    assert measured(4) - measured(2) == predicted[1] - predicted[0]
