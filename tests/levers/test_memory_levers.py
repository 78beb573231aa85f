"""Issue 19, levers 2-4, each exact: the Trainer trains the same weights with selective or every-N checkpointing,
with the saved activations offloaded (the copy path, run on the CPU) and with the optimizer step inside the backward,
as it does without them (fp32, within float tolerance: recomputation and per-parameter steps only reorder sums)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_gpu_train.errors import UsageError  # noqa: E402
from hf_gpu_train.levers import activation_offload, optimizer_in_backward, selective_checkpoint  # noqa: E402

VOCAB, SEQ, STEPS, BATCH = 96, 24, 4, 2


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, attention_dropout=0.1, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


class Rows(torch.utils.data.Dataset):
    def __init__(self, count: int):
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[: SEQ // 3] = -100  # a prompt
        return {"input_ids": self.ids[i], "labels": labels}


def trainer_for(tmp_path, name: str, **arguments):
    settings = dict(max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-2, weight_decay=0.01, warmup_steps=1,
                    max_grad_norm=0.0, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
                    optim="adamw_torch_fused", seed=0, dataloader_num_workers=0)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), **{**settings, **arguments})
    return transformers.Trainer(model=tiny_llama(), args=args, train_dataset=Rows(STEPS * BATCH))


def trained(trainer):
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return trained(trainer_for(tmp_path_factory.mktemp("levers"), "reference"))


def assert_same_training(got, reference, exact: bool = False):
    (weights, losses), (ref_weights, ref_losses) = got, reference
    assert len(losses) == STEPS
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(losses, ref_losses, **tolerance)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, **tolerance, msg=lambda m, name=name: f"{name}: {m}")
    moved = max(float((value - tiny_llama().state_dict()[name]).abs().max()) for name, value in weights.items())
    assert moved > 1e-3  # the weights trained: an equality of untrained models would prove nothing


@pytest.mark.parametrize("policy", ["all", "every-2", "selective", "selective-lean"])
def test_checkpointing_policies_train_the_same_weights(tmp_path, reference, policy):
    if policy.startswith("selective"):
        trainer = trainer_for(tmp_path, policy)
        selective_checkpoint.enable(trainer.model, policy)
    else:
        every = {"all": 1, "every-2": 2}[policy]
        trainer = trainer_for(tmp_path, policy, activation_checkpointing=True,
                              activation_checkpointing_kwargs={"use_reentrant": False, "every_n_layers": every})
    got = trained(trainer)  # the Trainer enables "all" and "every-N" in train()
    assert [layer.gradient_checkpointing for layer in trainer.model.model.layers] == (
        [True, False, True] if policy == "every-2" else [True] * 3)
    assert_same_training(got, reference)


def test_offloaded_activations_train_the_same_weights_bit_for_bit(tmp_path, reference):
    trainer = trainer_for(tmp_path, "offload")
    line = activation_offload.attach(trainer.model, on_cuda=False, min_bytes=0, offload_cpu_tensors=True)
    assert "pinned host memory" in line
    assert_same_training(trained(trainer), reference, exact=True)
    assert trainer.model._hf_gpu_train_offloaded_bytes > 0


def test_offloading_takes_what_autograd_saves_and_leaves_the_weights():
    """Every saved tensor of the forward is copied once, however many nodes save it: the copies account for all of
    them but the parameters (and the views of them that matmuls save)."""
    model = tiny_llama().train()
    batch = Rows(2)[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, held = {}, []

    def count(t):  # each view of a storage once; held, so that no address is reused during the forward
        if t.untyped_storage().data_ptr() not in params:
            held.append(t)
            saved[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        model(input_ids=batch["input_ids"][None], labels=batch["labels"][None])
    hooks = activation_offload.OffloadActivations(model.parameters(), min_bytes=0, offload_cpu_tensors=True)
    with hooks:
        loss = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
    loss.backward()
    assert hooks.offloaded_bytes == sum(saved.values())


def test_offloading_on_the_cpu_says_there_is_nothing_to_do():
    model = tiny_llama()
    assert "nothing to do on the CPU" in activation_offload.attach(model, on_cuda=False)
    assert not hasattr(model, "_hf_gpu_train_offloads_activations")


def test_the_optimizer_in_backward_trains_the_same_weights(tmp_path, reference):
    trainer = trainer_for(tmp_path, "in-backward")
    line = optimizer_in_backward.attach(trainer, world_size=1, precision="fp32")
    assert "AdamW" in line
    got = trained(trainer)
    inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(inner, optimizer_in_backward.OptimizerInBackward)
    parameters = sum(1 for p in trainer.model.parameters() if p.requires_grad)
    assert inner.parameter_steps == STEPS * parameters
    assert_same_training(got, reference)


def test_the_optimizer_in_backward_holds_one_parameter_gradient_at_a_time():
    model = tiny_llama().train()
    optimizer = optimizer_in_backward.OptimizerInBackward(model.parameters(), torch.optim.AdamW, lr=1e-3)
    live = []

    def record(_):
        live.append(sum(p.grad.numel() for p in model.parameters() if p.grad is not None))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(record)  # after the optimizer's own hook: what is left
    batch = Rows(2)[0]
    model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    largest = max(p.numel() for p in model.parameters())
    assert max(live) <= largest  # the hook just freed its own; at most one other is mid-accumulation
    assert all(p.grad is None for p in model.parameters())
    assert optimizer.parameter_steps == len(list(model.parameters()))
    optimizer.remove_hooks()  # the hooks (held by torch's C++ side) keep the optimizer and the model alive


def test_a_run_resumed_with_the_optimizer_in_backward_ends_with_the_uninterrupted_weights(tmp_path, reference):
    class StopAt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    first = trainer_for(tmp_path, "resume", save_strategy="steps", save_steps=2)
    optimizer_in_backward.attach(first, world_size=1, precision="fp32")
    first.add_callback(StopAt())
    first.train()
    second = trainer_for(tmp_path, "resume")
    optimizer_in_backward.attach(second, world_size=1, precision="fp32")
    second.train(resume_from_checkpoint=str(tmp_path / "resume" / "checkpoint-2"))
    weights = {n: p.detach() for n, p in second.model.named_parameters()}
    for name, value in reference[0].items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world,arguments,precision,named", [
    (2, {}, "fp32", "on 2 processes"),
    (1, {"gradient_accumulation_steps": 2}, "fp32", "gradient accumulation 2"),
    (1, {}, "fp16", "with fp16"),
    (1, {"max_grad_norm": 1.0}, "fp32", "max_grad_norm=1.0"),
])
def test_the_optimizer_in_backward_refuses_what_it_would_not_do_exactly(tmp_path, world, arguments, precision, named):
    trainer = trainer_for(tmp_path, "refused", **arguments)
    with pytest.raises(UsageError, match=named):
        optimizer_in_backward.attach(trainer, world_size=world, precision=precision)


def test_a_state_saved_by_another_optimizer_is_refused():
    optimizer = optimizer_in_backward.OptimizerInBackward(tiny_llama().parameters(), torch.optim.AdamW, lr=1e-3)
    with pytest.raises(ValueError, match="different optimizer or model"):
        optimizer.load_state_dict(torch.optim.AdamW(tiny_llama().parameters()).state_dict())
    optimizer.remove_hooks()


def test_nothing_is_left_alive_after_training(tmp_path):
    """The parameters' hooks live in torch's C++ side, where Python's collector cannot see the cycle they close
    (parameter -> hook -> optimizer -> parameter): left on, they would keep the model and its optimizer state alive
    after the Trainer is gone."""
    import gc
    import weakref

    trainer = trainer_for(tmp_path, "alive")
    optimizer_in_backward.attach(trainer, world_size=1, precision="fp32")
    trainer.train()
    gone = weakref.ref(optimizer_in_backward._unwrapped(trainer.optimizer))
    del trainer
    gc.collect()
    assert gone() is None


def test_the_chunked_heads_gradient_buffers_stay_on_the_device():
    """The chunked head computes its gradients in the forward and saves them for the backward: they are gradients,
    counted by the planner where they are, so offloading leaves them (and the planner's offloaded bytes hold)."""
    from hf_gpu_train.finetune.tasks.language_modeling.lm_head_loss import install

    model = tiny_llama().train()
    install(model, chunk=8)
    batch = Rows(2)[0]
    hooks = activation_offload.OffloadActivations(model.parameters(), min_bytes=0, offload_cpu_tensors=True)
    copied = []
    original = hooks._copy
    hooks._copy = lambda t: (copied.append(tuple(t.shape)), original(t))[1]
    with hooks:
        loss = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
    loss.backward()
    head = tuple(model.lm_head.weight.shape)
    assert copied and head not in copied
    assert model.lm_head.weight.grad is not None


def test_offloading_is_refused_beside_fsdp_and_deepspeed(tmp_path):
    from hf_gpu_train.finetune.loading import load_config
    from hf_gpu_train.levers.from_config import apply_levers

    trainer = trainer_for(tmp_path, "sharded")
    trainer.is_fsdp_enabled = True
    cfg = load_config(None, ["offload_activations=true"])
    runtime = type("Runtime", (), {"world_size": 2, "precision": "bf16", "on_cuda": True})()
    with pytest.raises(UsageError, match="offload_activations=true under FSDP or DeepSpeed"):
        apply_levers(trainer, cfg.lever_keys(), runtime)


def test_an_optimizer_built_by_someone_else_is_refused_before_the_first_step(tmp_path):
    """A subclass (or TRL) that builds its own optimizer would leave the lever's line printed and nothing done."""
    class OwnOptimizer(transformers.Trainer):
        def create_optimizer(self, model=None):
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
            return self.optimizer

    args = trainer_for(tmp_path, "own").args
    trainer = OwnOptimizer(model=tiny_llama(), args=args, train_dataset=Rows(STEPS * BATCH))
    optimizer_in_backward.attach(trainer, world_size=1, precision="fp32")
    with pytest.raises(UsageError, match="the Trainer's optimizer is SGD"):
        trainer.train()


def test_the_hooks_leave_with_the_training(tmp_path):
    trainer = trainer_for(tmp_path, "hooks")
    optimizer_in_backward.attach(trainer, world_size=1, precision="fp32")
    trainer.train()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    batch = Rows(2)[0]
    trainer.model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())  # a later backward steps nothing
    assert trainer.model.lm_head.weight.grad is not None


def test_offloading_leaves_the_weights_after_the_model_moves():
    """Attached before the Trainer moves the model to its device (which gives every parameter a new storage): the
    weights the matmuls save are still recognised as parameters, not copied out every step."""
    model = tiny_llama().train()
    activation_offload.attach(model, on_cuda=False, min_bytes=0, offload_cpu_tensors=True)
    for p in model.parameters():  # what .to(device) does to each parameter's storage
        p.data = p.data.clone()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    copied = []
    original = activation_offload.OffloadActivations._copy

    def spy(self, t):
        copied.append(t.untyped_storage().data_ptr())
        return original(self, t)

    activation_offload.OffloadActivations._copy = spy
    try:
        batch = Rows(2)[0]
        model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss.backward()
    finally:
        activation_offload.OffloadActivations._copy = original
    assert copied and not weights.intersection(copied)


def test_offloading_comes_off_again_and_puts_back_the_forward_it_wrapped():
    """tune's trials share one model: a trial with offloading must leave the next one the forward it found (the
    class's own, or the chunked head's)."""
    from hf_gpu_train.finetune.tasks.language_modeling.lm_head_loss import install

    model = tiny_llama().train()
    activation_offload.attach(model, on_cuda=False, min_bytes=0, offload_cpu_tensors=True)
    assert "forward" in model.__dict__
    assert activation_offload.detach(model) and "forward" not in model.__dict__ and not activation_offload.detach(model)
    install(model, chunk=4)
    chunked = model.__dict__["forward"]
    activation_offload.attach(model, on_cuda=False, min_bytes=0, offload_cpu_tensors=True)
    assert model.__dict__["forward"] is not chunked
    assert activation_offload.detach(model) and model.__dict__["forward"] is chunked


def test_lean_selective_reads_each_matmuls_operands_where_that_op_keeps_them():
    """The narrowing rule looks at the inner and output dimensions: (a, b) for mm and bmm, (bias, a, b) for addmm and
    (input, a, b) for baddbmm (a biased projection is an addmm)."""
    from hf_gpu_train.levers.selective_checkpoint import narrows

    aten = torch.ops.aten
    down, up = (torch.empty(5, 16), torch.empty(16, 4)), (torch.empty(5, 4), torch.empty(4, 16))
    assert narrows(aten.mm.default, down) and not narrows(aten.mm.default, up)
    assert narrows(aten.addmm.default, (torch.empty(4), *down)) and not narrows(aten.addmm.default, (torch.empty(16), *up))
    batched_down = (torch.empty(2, 5, 16), torch.empty(2, 16, 4))
    assert narrows(aten.bmm.default, batched_down)
    assert narrows(aten.baddbmm.default, (torch.empty(2, 5, 4), *batched_down))


def test_selective_checkpointing_refuses_attention_kernels_its_policies_would_recompute():
    """flash-attn's and flex attention's kernels are not among the ops the policies keep: they would recompute
    attention, the one thing they exist not to recompute (and the planner counts as kept). A usage error naming the fix,
    as is a model without checkpointing support (exit 2, not a traceback)."""
    from hf_gpu_train.errors import UsageError
    from hf_gpu_train.levers import selective_checkpoint
    from tests.finetune.tasks.language_modeling.tiny import tiny_llama

    model = tiny_llama(64)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UsageError, match="attn_implementation='flash_attention_2'.*use attn_implementation=sdpa"):
        selective_checkpoint.enable(model, "selective")
    unsupported = torch.nn.Linear(2, 2)
    with pytest.raises(UsageError, match="does not support activation checkpointing"):
        selective_checkpoint.enable(unsupported, "selective-lean")
    selective_checkpoint.enable(tiny_llama(64, attn_implementation="eager"), "selective")


@pytest.mark.parametrize("levers", [("chunked",), ("chunked", "in-backward"), ("selective", "in-backward"),
                                    ("chunked", "selective-lean"), ("chunked", "selective", "offload", "in-backward")],
                         ids="+".join)
def test_the_levers_together_train_the_same_weights(tmp_path, reference, levers):
    """Each lever is exact alone; together they meet (the chunked head's gradients made in the forward stepped by the
    optimizer in the backward; the selective policies around a head that is not a module call; offloading beside both).
    Through a plain Trainer with its defaults (remove_unused_columns on: the chunked forward keeps its signature)."""
    from hf_gpu_train.finetune.tasks.language_modeling.lm_head_loss import install

    trainer = trainer_for(tmp_path, "+".join(levers))
    if "chunked" in levers:
        assert install(trainer.model, chunk=7).supported
    for policy in ("selective", "selective-lean"):
        if policy in levers:
            selective_checkpoint.enable(trainer.model, policy)
    if "offload" in levers:
        activation_offload.attach(trainer.model, on_cuda=False, min_bytes=0, offload_cpu_tensors=True)
    if "in-backward" in levers:
        optimizer_in_backward.attach(trainer, world_size=1, precision="fp32")
    assert_same_training(trained(trainer), reference)
    if "offload" in levers:
        assert trainer.model._hf_gpu_train_offloaded_bytes > 0


class RowsSomeUnlabelled(Rows):
    """Every third row has no label at all (a prompt longer than max_length, truncated): micro-batches of such rows only
    give the chunked loss no row to compute, and a step of them num_items_in_batch 0."""

    def __getitem__(self, i):
        row = super().__getitem__(i)
        if i % 3 == 0 or i in (4, 5):
            row["labels"] = torch.full_like(row["labels"], -100)
        return row


def test_the_chunked_head_with_accumulation_and_micro_batches_without_labels(tmp_path):
    """Accumulation carries the item count of the whole step (num_items_in_batch): the chunked head's micro-batches
    with no labelled row, and a micro-batch of only such rows, contribute what the model's own head does. SGD: Adam
    turns the float noise after a step of zero gradients into 1e-5 differences, which would hide nothing here."""
    from hf_gpu_train.finetune.tasks.language_modeling.lm_head_loss import install

    def run(chunked: bool):
        trainer = trainer_for(tmp_path, f"accumulate-{chunked}", optim="sgd", per_device_train_batch_size=1,
                              gradient_accumulation_steps=2, weight_decay=0.0)
        trainer.train_dataset = RowsSomeUnlabelled(STEPS * 2)
        if chunked:
            assert install(trainer.model, chunk=5).supported
        return trained(trainer)

    reference, got = run(False), run(True)
    assert_same_training(got, reference)


@pytest.mark.gpu
def test_on_cuda_offloading_trains_the_same_weights(tmp_path):
    """The CUDA copy path (pinned buffers, the side stream, record_stream, the copies back on the compute stream) against
    the same fp32 run on the GPU without it."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    plain = trained(trainer_for(tmp_path, "cuda-plain", use_cpu=False))
    trainer = trainer_for(tmp_path, "cuda-offload", use_cpu=False)
    assert "pinned host memory" in activation_offload.attach(trainer.model, on_cuda=True, min_bytes=0)
    got = trained(trainer)
    assert trainer.model._hf_gpu_train_offloaded_bytes > 0
    (weights, losses), (ref_weights, ref_losses) = got, plain
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
