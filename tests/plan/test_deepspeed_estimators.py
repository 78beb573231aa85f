"""The memory planner's ZeRO figures against DeepSpeed's own estimators (DeepSpeed 0.19.8), per GPU, model states only.

What DeepSpeed's estimators count (``estimate_zero2_model_states_mem_needs`` in deepspeed/runtime/zero/stage_1_and_2.py,
``estimate_zero3_model_states_mem_needs`` in .../stage3.py; their ``_all_live`` forms print the same figures for a model
object), for mixed-precision Adam, P parameters over N GPUs:

- ZeRO-2: 2P (16-bit weights, whole) + 18P/N (16-bit gradients 2, fp32 gradients 4, fp32 master weights 4, the two
  Adam moments 8); with the optimizer offloaded, 2P.
- ZeRO-3: 18P/N (16-bit weights 2, fp32 gradients 4, master 4, moments 8: the set its CPU rows count, 16 with the
  optimizer offloaded, 18 with the parameters too) + 4 bytes a parameter of the largest layer: the largest module's own
  parameters gathered in 16-bit with their 16-bit gradient; with weights and optimizer offloaded, only that.
- ``additional_buffer_factor`` (1.5) multiplies their CPU figures, never the GPU ones: no GPU figure differs by it.

The planner (plan/memory.py ``estimate``) counts the same states, and beside them what a plan needs that DeepSpeed's
estimators leave out: activations, the CUDA context (512 MiB), ZeRO-2's reduce buckets (0.47 GiB at 8B) and the 8%
fragmentation reserve of ``usable_bytes``; none of those is compared here. Model states below: weights + gradients +
optimizer + fp32 master + the step's fp32 gradient partition (``zero_step_gradients``, before the activations it
outlives are taken off) + ZeRO-3's gathered parameters. Llama-3-8B (8,030,261,248 parameters) on 8 GPUs:

- equal, to the byte (DeepSpeed truncates to an int: tolerance 1 byte): ZeRO-2 in bf16 or fp16, 2P + 18P/N, 31.78 GiB
  both; ZeRO-3's gathered unit, 4 bytes x the largest module (the 128,256 x 4,096 head, 1.96 GiB; SmolLM2's tied
  embedding 108 MiB; MiniLM's word embeddings 44.7 MiB); ZeRO-3-offload's host memory under zero.Init (the plan's
  config sets it): the planner's 18 bytes a parameter a node x 1.5 == DeepSpeed's CPU figure (Llama-3-8B, one node:
  134.6 GiB x 1.5 = 201.9 GiB).
- different by design, the difference asserted exactly:
  - ZeRO-3 in 16-bit: planner 16P/N + 4·min(P/N, sub_group_size 1e9) (the step converts one sub-group's gradients to fp32
    at a time) vs DeepSpeed 18P/N, which leaves out the 16-bit gradient partition ZeRO-3 keeps (measured at the step:
    20 bytes a parameter). Planner − DeepSpeed = 4·min(P/N, 1e9) − 2P/N: 20.64 GiB vs 18.78 GiB at 8 GPUs; on one GPU,
    where the sub-group bounds the fp32 copy, the planner is the lower, 125.3 GiB vs 136.6 GiB.
  - fp32 training (DeepSpeed's estimators assume 16-bit weights): ZeRO-2 planner − DeepSpeed = 2P (4-byte weights) +
    2P/N (4-byte gradient partition); ZeRO-3 = 2P/N + 4·min(P/N, 1e9) in the partition, and the gathered unit twice
    DeepSpeed's (4-byte parameter and gradient).
  - ZeRO-2-offload: planner − DeepSpeed = 2P/N: the planner keeps a 16-bit gradient partition on the GPU, DeepSpeed's
    estimator none (its ZeRO-Offload copies each reduced gradient into the CPU's fp32 partition). Conservative by
    1.87 GiB at 8 GPUs, 15 GiB on one.
  - ZeRO-3-offload (weights and optimizer): planner − DeepSpeed = min(2P/N, 4·hidden²): two reduce buckets of hidden²
    16-bit elements (transformers' "auto" reduce_bucket_size), 64 MiB at hidden 4,096.
  - ZeRO-2-offload's host memory: DeepSpeed / 1.5 = P·max(4·N_total, 16), where 16 is master + moments + fp32 gradients
    of the whole model on every node (its ZeRO-2 estimator never divides by nodes) and 4·N_total an fp32 copy of the model
    in every process while it loads, before ZeRO shards it (the planner plans training, not loading). The planner: 18P
    over the node's processes, DeepSpeed's 16 + 2 for the 16-bit CPU buffer ZeRO-Offload copies the updated partition
    through (stage_1_and_2.py ``param_buffer_of_bit16_for_cpu_offload_groups``).

Planner bugs this comparison found, fixed in plan/memory.py (the three ``test_bug_*`` tests failed before the fix):
1. the optimizer step's fp32 gradient partition was not counted. Llama-3-8B, ZeRO-2, 2 x 80 GiB, 2,048 tokens:
   planned at micro-batch 1 with checkpointing (72.8 GiB of 73.6 usable) while the step needs DeepSpeed's 82.3 GiB of
   model states + buckets + context = 83.2 GiB: an OOM at the first step. Now it does not fit there.
2. ZeRO-3's gathered unit was two decoder layers' 16-bit parameters (0.81 GiB for Llama-3-8B); ZeRO-3 gathers module by
   module, and the largest (the 1 GiB head) comes with its 1 GiB gradient: 1.96 GiB, DeepSpeed's figure. Measured on a
   small Llama under ZeRO-3 (one CPU process): at most the embedding's parameters gathered, and its whole gradient beside.
3. fp32 training: no fp32 master counted, but ZeRO-2 clones it and ZeRO-3 does too (stage3.py shares the partition only
   where a torch.device equals a device name string, never). Measured at the inner optimizer step, one process: ZeRO-3
   24 bytes a parameter, the planner's figure now; ZeRO-2 20, and the planner's 24 adds the 4-byte gradient partition
   the step's flattened copy is made from (DeepSpeed's estimator likewise counts the 16-bit one beside the fp32 copy).

DeepSpeed's ``_all_live`` functions want a model with storage: on the meta device every data_ptr() is 0, and their
parameter count (deduplicated by data_ptr) is the last parameter's size. A model built on meta and moved with
``to_empty`` (tied weights tied again) costs no initialisation.
"""

import re
from dataclasses import replace

import pytest

stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_gpu_train.builtin_models import minilm_path  # noqa: E402
from hf_gpu_train.plan.lever_plan import host_bytes_per_process  # noqa: E402
from hf_gpu_train.plan.memory import (  # noqa: E402
    GIB,
    ZERO3_SUB_GROUP_SIZE,
    TrainingShape,
    estimate,
    largest_parameter,
    plan_memory,
    zero_step_gradients,
)
from hf_gpu_train.plan.model_spec import from_config, resolve_model  # noqa: E402

BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor default, on its CPU figures only
BYTE = 1  # DeepSpeed's figures are int()-truncated
# (GPUs per node, nodes): 1, 2, 8 and 16 GPUs
WORLDS = ((1, 1), (2, 1), (8, 1), (8, 2))
SMOLLM2 = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
               max_position_embeddings=8192, rope_theta=100000.0)
LLAMA3_8B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 tie_word_embeddings=False, max_position_embeddings=8192, rope_theta=500000.0)
MODELS = ("minilm", "smollm2", "llama-3-8b")


def _on_meta(build):
    with torch.device("meta"):
        return build()


def _with_storage(model):
    """The meta model with (uninitialised) CPU storage and its tied weights tied again: what ``_all_live`` needs."""
    model.to_empty(device="cpu")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


@pytest.fixture(scope="module")
def models():
    """name -> (planner spec, meta model, model with storage or None: Llama-3-8B's would take 32 GB)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    minilm_config = AutoConfig.from_pretrained(minilm_path())
    smol_config = AutoConfig.for_model(**SMOLLM2)
    out = {}
    for name, spec, build in (
        ("minilm", resolve_model("builtin:minilm"), lambda: AutoModel.from_config(minilm_config)),
        ("smollm2", from_config(dict(SMOLLM2), name="smollm2-135m"), lambda: AutoModelForCausalLM.from_config(smol_config)),
        ("llama-3-8b", from_config(dict(LLAMA3_8B), name="llama-3-8b"), None),
    ):
        meta = _on_meta(build) if build else _on_meta(lambda: AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA3_8B)))
        real = _with_storage(_on_meta(build)) if build else None
        out[name] = (spec, meta, real)
    return out


def deepspeed_counts(models, name):
    """(total parameters, largest layer's parameters) as DeepSpeed's ``_all_live`` counts them (``model_to_params``): on the
    model with storage; Llama-3-8B's total is the planner's (its meta census) and its largest layer DeepSpeed's on meta."""
    spec, meta, real = models[name]
    if real is not None:
        return stage3.model_to_params(real)
    return spec.params, stage3.model_to_params(meta)[1]


def shape(gpus_per_node, nodes, precision="bf16"):
    return TrainingShape(micro_batch=1, seq_len=128, precision=precision, num_gpus=gpus_per_node * nodes)


def states(spec, shape_, strategy) -> float:
    """The planner's model states per GPU at the optimizer step (module docstring)."""
    b = estimate(spec, shape_, strategy)
    return (b.weights + b.gradients + b.optimizer + b.master_weights + zero_step_gradients(spec, shape_, strategy)
            + b.gathered_params)


def zero2(total, gpus_per_node, nodes, offload):
    cpu, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(total, gpus_per_node, nodes, cpu_offload=offload,
                                                                   additional_buffer_factor=BUFFER_FACTOR)
    return cpu, gpu


def zero3(total, largest, gpus_per_node, nodes, offload):
    """(cpu, gpu, largest layer memory) for the plan's two ZeRO-3 configs: nothing offloaded, or weights and optimizer
    (deepspeed-zero3-offload), both with zero.Init (zero3_init_flag)."""
    return stage3.estimate_zero3_model_states_mem_needs(total, largest, gpus_per_node, nodes, cpu_offload=offload,
                                                        cpu_offload_params=offload, zero_init=True,
                                                        additional_buffer_factor=BUFFER_FACTOR)


# --- the parameter counts both sides start from ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["minilm", "smollm2"])
def test_deepspeed_counts_the_planners_parameters_and_largest_module(models, name):
    spec, _, real = models[name]
    total, largest = stage3.model_to_params(real)
    assert total == stage_1_and_2.model_to_params(real) == spec.params  # SmolLM2's tied head counted once: 134,515,008
    assert largest == largest_parameter(spec) == spec.vocab_size * spec.hidden_size  # the (word) embedding


def test_the_largest_layer_of_an_8b_llama_is_its_head_and_meta_models_fool_the_all_live_count(models):
    spec, meta, _ = models["llama-3-8b"]
    assert spec.params == 8_030_261_248
    total_on_meta, largest = stage3.model_to_params(meta)
    assert largest == largest_parameter(spec) == 128_256 * 4096 == 525_336_576
    assert largest > 2 * spec.largest_layer_params  # a LlamaDecoderLayer is 218,112,000
    # every meta tensor's data_ptr() is 0: the deduplicated count is the last parameter's, the head
    assert total_on_meta == stage_1_and_2.model_to_params(meta) == 525_336_576
    assert stage3.model_to_params(models["smollm2"][1])[0] == 576  # SmolLM2's last parameter: the final norm


# --- equal where they count the same thing ---------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w[0] * w[1]}gpus")
@pytest.mark.parametrize("name", MODELS)
def test_zero2_in_16_bit_equals_deepspeed(models, name, world, precision):
    spec = models[name][0]
    total, _ = deepspeed_counts(models, name)
    _, gpu = zero2(total, *world, offload=False)
    P, N = spec.params, world[0] * world[1]
    assert states(spec, shape(*world, precision), "deepspeed-zero2") == pytest.approx(gpu, abs=BYTE)
    assert gpu == 2 * P + int(18 * P / N)


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w[0] * w[1]}gpus")
@pytest.mark.parametrize("name", MODELS)
def test_zero3_gathers_what_deepspeed_counts_for_the_largest_layer(models, name, world):
    spec = models[name][0]
    total, largest = deepspeed_counts(models, name)
    for strategy, offload in (("deepspeed-zero3", False), ("deepspeed-zero3-offload", True)):
        _, _, largest_layer_memory = zero3(total, largest, *world, offload=offload)
        assert estimate(spec, shape(*world), strategy).gathered_params == largest_layer_memory == 4 * largest


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w[0] * w[1]}gpus")
@pytest.mark.parametrize("name", MODELS)
def test_zero3_offload_host_memory_is_deepspeeds_without_its_buffer_factor(models, name, world):
    spec = models[name][0]
    total, largest = deepspeed_counts(models, name)
    cpu, _, _ = zero3(total, largest, *world, offload=True)
    per_node = host_bytes_per_process(spec, shape(*world), "deepspeed-zero3-offload", world[0] * world[1]) * world[0]
    assert per_node == pytest.approx(cpu / BUFFER_FACTOR, abs=BYTE)
    assert per_node == pytest.approx(18 * spec.params / world[1])


# --- different by design, the difference exact -----------------------------------------------------------------------

@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w[0] * w[1]}gpus")
@pytest.mark.parametrize("name", MODELS)
def test_zero3_partition_adds_the_16_bit_gradients_deepspeed_leaves_out(models, name, world):
    """planner − DeepSpeed = 4·min(P/N, sub_group_size) − 2P/N, in bf16 and (with 2P/N + 4·min and a doubled gathered
    unit) in fp32."""
    spec = models[name][0]
    total, largest = deepspeed_counts(models, name)
    P, N = spec.params, world[0] * world[1]
    _, gpu, gathered = zero3(total, largest, *world, offload=False)
    fp32_step = 4 * min(P / N, ZERO3_SUB_GROUP_SIZE)
    assert states(spec, shape(*world), "deepspeed-zero3") - gpu == pytest.approx(fp32_step - 2 * P / N, abs=BYTE)
    assert states(spec, shape(*world, "fp32"), "deepspeed-zero3") - gpu == pytest.approx(2 * P / N + fp32_step + gathered, abs=BYTE)


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w[0] * w[1]}gpus")
@pytest.mark.parametrize("name", MODELS)
def test_zero2_in_fp32_adds_4_byte_weights_and_gradients(models, name, world):
    spec = models[name][0]
    total, _ = deepspeed_counts(models, name)
    P, N = spec.params, world[0] * world[1]
    _, gpu = zero2(total, *world, offload=False)
    assert states(spec, shape(*world, "fp32"), "deepspeed-zero2") - gpu == pytest.approx(2 * P + 2 * P / N, abs=BYTE)


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w[0] * w[1]}gpus")
@pytest.mark.parametrize("name", MODELS)
def test_offloaded_zero_keeps_on_the_gpu_what_deepspeed_does_plus_gradient_buffers(models, name, world):
    """ZeRO-2-offload: + the planner's 16-bit gradient partition (2P/N); ZeRO-3-offload: + two reduce buckets of hidden²
    16-bit elements, or the whole 16-bit partition where smaller. Neither has a fp32 step on the GPU."""
    spec = models[name][0]
    total, largest = deepspeed_counts(models, name)
    P, N, h = spec.params, world[0] * world[1], spec.hidden_size
    _, gpu2 = zero2(total, *world, offload=True)
    assert states(spec, shape(*world), "deepspeed-zero2-offload") - gpu2 == pytest.approx(2 * P / N, abs=BYTE)
    _, gpu3, _ = zero3(total, largest, *world, offload=True)
    assert states(spec, shape(*world), "deepspeed-zero3-offload") - gpu3 == pytest.approx(min(2 * P / N, 4 * h * h), abs=BYTE)
    for strategy in ("deepspeed-zero2-offload", "deepspeed-zero3-offload"):
        assert zero_step_gradients(spec, shape(*world), strategy) == 0 == estimate(spec, shape(*world), strategy).step_gradients


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w[0] * w[1]}gpus")
@pytest.mark.parametrize("name", MODELS)
def test_zero2_offload_host_memory_against_deepspeeds_per_node_figure(models, name, world):
    """DeepSpeed / 1.5 = P·max(4·N_total, 16): its 16 bytes (master, moments, fp32 gradients) are the planner's 18 without
    the 16-bit CPU buffer, for the whole model on each node; 4·N_total is every process's fp32 model while loading."""
    spec = models[name][0]
    total, _ = deepspeed_counts(models, name)
    gpus_per_node, nodes = world
    N = gpus_per_node * nodes
    cpu, _ = zero2(total, *world, offload=True)
    per_node = host_bytes_per_process(spec, shape(*world), "deepspeed-zero2-offload", N) * gpus_per_node
    steady = (per_node - 2 * spec.params / nodes) * nodes  # without the 16-bit buffer, the whole model's
    assert cpu / BUFFER_FACTOR == pytest.approx(max(4 * N * spec.params, steady), abs=BYTE)
    assert steady == pytest.approx(16 * spec.params)


# --- the _all_live tables, printed for real models, read back ---------------------------------------------------------

ROW = re.compile(r"^\s*([\d.]+)GB \|\s*([\d.]+)GB \|")


def _printed(capsys, function, model, gpus_per_node, nodes) -> list[tuple[float, float]]:
    capsys.readouterr()
    function(model, num_gpus_per_node=gpus_per_node, num_nodes=nodes)
    return [(float(m[1]), float(m[2])) for m in map(ROW.match, capsys.readouterr().out.splitlines()) if m]


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w[0] * w[1]}gpus")
@pytest.mark.parametrize("name", ["minilm", "smollm2"])
def test_the_all_live_tables_match_the_planner_to_their_printed_precision(models, name, world, capsys):
    """The printed GiB, 2 decimals: ZeRO-2's rows (optimizer offloaded, none) and ZeRO-3's (weights and optimizer
    offloaded with zero.Init: row 0; nothing offloaded with zero.Init: row 4), against the planner with the differences
    above taken off."""
    spec, _, real = models[name]
    P, N, h = spec.params, world[0] * world[1], spec.hidden_size
    z2 = _printed(capsys, stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live, real, *world)
    z3 = _printed(capsys, stage3.estimate_zero3_model_states_mem_needs_all_live, real, *world)
    assert (len(z2), len(z3)) == (2, 6)
    s = shape(*world)
    expected = {
        (z2[0][1], "zero2-offload GPU"): states(spec, s, "deepspeed-zero2-offload") - 2 * P / N,
        (z2[1][1], "zero2 GPU"): states(spec, s, "deepspeed-zero2"),
        (z3[0][1], "zero3-offload GPU"): states(spec, s, "deepspeed-zero3-offload") - min(2 * P / N, 4 * h * h),
        (z3[0][0], "zero3-offload CPU"): host_bytes_per_process(spec, s, "deepspeed-zero3-offload", N) * world[0] * BUFFER_FACTOR,
        (z3[4][1], "zero3 GPU"): states(spec, s, "deepspeed-zero3") - (4 * min(P / N, ZERO3_SUB_GROUP_SIZE) - 2 * P / N),
    }
    for (printed, what), planner in expected.items():
        assert printed == pytest.approx(planner / GIB, abs=0.0051), what


# --- the planner bugs the comparison found (each failed before the fix in plan/memory.py) ------------------------------

def test_bug_a_zero2_plan_leaves_room_for_the_optimizer_steps_fp32_gradients(models):
    """Llama-3-8B, ZeRO-2 on 2 x 80 GiB: before the fix, micro-batch 1 with checkpointing "fit" (72.8 GiB planned)
    while DeepSpeed's step holds 82.3 GiB of model states, + 0.47 GiB of buckets + the 0.5 GiB context."""
    spec = models["llama-3-8b"][0]
    s = replace(shape(2, 1), seq_len=2048, gradient_checkpointing=True)
    b = estimate(spec, s, "deepspeed-zero2")
    _, gpu = zero2(spec.params, 2, 1, offload=False)
    assert gpu / GIB == pytest.approx(82.27, abs=0.01)
    assert b.activations < zero_step_gradients(spec, s, "deepspeed-zero2")  # the step, not the backward, is the peak
    assert b.total == pytest.approx(gpu + b.comm_buffers + b.context + b.gathered_params, abs=BYTE)
    assert b.total / GIB == pytest.approx(83.23, abs=0.01)
    assert plan_memory(spec, 80 * GIB, 2, TrainingShape(seq_len=2048, num_gpus=2), 64, strategies=("deepspeed-zero2",)) is None
    # the step's fp32 gradients are counted only where they exceed the activations freed before it
    wide = replace(s, micro_batch=8, gradient_checkpointing=False)
    assert estimate(spec, wide, "deepspeed-zero2").step_gradients == 0
    assert "fp32 gradients at the step" in dict(b.rows()) and "fp32 gradients at the step" not in dict(
        estimate(spec, wide, "deepspeed-zero2").rows())


def test_bug_b_zero3_gathers_the_largest_module_with_its_gradient(models):
    """Before: two decoder layers' 16-bit parameters, 0.81 GiB for Llama-3-8B; DeepSpeed (and a measurement): the 1 GiB
    head and its 1 GiB gradient."""
    spec = models["llama-3-8b"][0]
    b = estimate(spec, shape(8, 1), "deepspeed-zero3")
    assert 2 * spec.largest_layer_params * 2 / GIB == pytest.approx(0.81, abs=0.01)
    assert b.gathered_params == 4 * 525_336_576
    assert b.gathered_params / GIB == pytest.approx(1.96, abs=0.01)


@pytest.mark.parametrize("strategy", ["deepspeed-zero2", "deepspeed-zero3"])
def test_bug_c_fp32_training_under_zero_keeps_an_fp32_master_copy(models, strategy):
    """DeepSpeed clones the master partition whatever the precision. At the step, one GPU: 4 weights + 4 gradient
    partition + 8 moments + 4 master + 4 fp32 gradients = 24 bytes a parameter (measured: ZeRO-3 24; ZeRO-2 20 once its
    gradient partition is released, after the flattened fp32 copy is made from it)."""
    spec = models["smollm2"][0]
    b = estimate(spec, shape(1, 1, "fp32"), strategy)
    assert b.master_weights == 4 * spec.params
    at_step = b.weights + b.gradients + b.optimizer + b.master_weights + zero_step_gradients(spec, shape(1, 1, "fp32"), strategy)
    assert at_step == 24 * spec.params


def test_figures_for_the_docs(models):
    """The Llama-3-8B figures the module docstring and docs/ quote (GiB per GPU, model states)."""
    spec = models["llama-3-8b"][0]
    total, largest = deepspeed_counts(models, "llama-3-8b")
    got = {
        "zero2 8 GPUs": (states(spec, shape(8, 1), "deepspeed-zero2"), zero2(total, 8, 1, False)[1]),
        "zero3 8 GPUs": (states(spec, shape(8, 1), "deepspeed-zero3"), zero3(total, largest, 8, 1, False)[1]),
        "zero3 1 GPU": (states(spec, shape(1, 1), "deepspeed-zero3"), zero3(total, largest, 1, 1, False)[1]),
        "zero2-offload 8 GPUs": (states(spec, shape(8, 1), "deepspeed-zero2-offload"), zero2(total, 8, 1, True)[1]),
        "zero3-offload 1 GPU": (states(spec, shape(1, 1), "deepspeed-zero3-offload"), zero3(total, largest, 1, 1, True)[1]),
    }
    figures = {k: (round(a / GIB, 2), round(b / GIB, 2)) for k, (a, b) in got.items()}
    assert figures == {"zero2 8 GPUs": (31.78, 31.78), "zero3 8 GPUs": (20.64, 18.78), "zero3 1 GPU": (125.34, 136.57),
                       "zero2-offload 8 GPUs": (16.83, 14.96), "zero3-offload 1 GPU": (2.02, 1.96)}
