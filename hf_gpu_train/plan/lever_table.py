"""The memory levers for this model on this machine: torchtune's table (each lever added to the rows above it: memory
per GPU, the largest micro-batch that fits, the predicted step-time cost), and the cheapest set of levers that reaches
a useful micro-batch, searched over every combination.

The levers:

- the chunked LM head and loss (causal LMs; ``chunked_lm_loss``): no full logits, nothing recomputed: free;
- selective checkpointing (``checkpoint_layers=selective``): each layer keeps its matmuls' and attention's outputs and
  recomputes the elementwise ops between them, no matmul twice: ``SELECTIVE_COST`` assumed (a few percent);
- lean selective checkpointing (``checkpoint_layers=selective-lean``): each layer keeps only attention's outputs and those
  of the matmuls that narrow what they read (the MLP's down projection, grouped keys and values, LoRA's A), about what
  checkpointing every layer keeps plus a quarter, and recomputes the widening matmuls: that share of the forward's
  matmul FLOPs (``activations.narrow_share``), never attention;
- checkpointing one layer in N, or every layer (``checkpoint_layers=every-N`` / ``all``): the forward's matmuls of
  those layers again in the backward: 2 of full fine-tuning's 6 FLOPs per parameter and token (+33% for every
  layer), 2 of LoRA's 4 (+50%);
- activation offloading (``offload_activations``): the saved activations (and, for full fine-tuning under autocast
  without checkpointing, the 16-bit weight copies the matmuls save) cross PCIe out in the forward, on a side stream
  (hidden behind the forward's compute while shorter than it), and back in the backward on the compute stream (never
  hidden: the copies are made when a tensor is needed);
- the optimizer step in the backward (``optimizer_in_backward``; full fine-tuning, one GPU, one micro-batch per step):
  no time, but gradient clipping goes (each parameter steps before the global norm exists): the only lever that
  changes the updates, so it is recommended only when no exact set reaches the micro-batch.

Which levers a strategy offers (its row's ``levers`` in plan/strategies.py): the chunked head everywhere but under fp16
(its gradients are made before the loss scale reaches them) and ZeRO-3 (which partitions the head's weight outside its
forward); selective and one-in-N checkpointing and offloading with a whole model per GPU (one GPU, DDP), the optimizer
in the backward on one GPU: FSDP and DeepSpeed checkpoint every layer through their own configs, and their gathered
parameters would be offloaded too.

Step time is predicted from FLOPs (6 per parameter and token for full fine-tuning, 4 for adapters, whose base gets no
weight gradients) at ``ASSUMED_MFU`` of the GPU's dense peak, and PCIe at ``PCIE_EFFICIENCY`` of its link. Estimates
to rank the levers; ``hf-gpu-train tune`` measures.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from .activations import narrow_share, offloaded_bytes
from .memory import GIB, estimate, largest_micro_batch
from .model_spec import ModelSpec
from .strategies import STRATEGIES
from .training_shape import TrainingShape

ASSUMED_MFU = 0.4  # of the dense peak: what a well-fed fine-tune reaches on a datacenter GPU
PCIE_EFFICIENCY = 0.8  # of the link's raw rate, for large pinned copies
PCIE_GB_PER_LANE = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # GB/s per lane and direction, after encoding
ASSUMED_PCIE = (4, 16)  # when the link is not known (a --gpu-memory-gib plan): Gen4 x16
SELECTIVE_COST = 0.05  # assumed: the elementwise ops of a layer recomputed (norms, SiLU, products), no matmul


def chunk_offered(spec: ModelSpec, shape: TrainingShape, strategy: str) -> bool:
    """Whether the chunked LM head and loss is a lever here (module docstring)."""
    return (bool(spec.causal_lm and spec.vocab_size) and not spec.lm_head_extras and shape.precision != "fp16"
            and "chunked_lm_loss" in STRATEGIES[strategy].levers)


@dataclass(frozen=True)
class LeverSet:
    shape: TrainingShape  # the levers, as the planner counts them
    total_bytes: float  # per GPU at the table's micro-batch
    largest_micro_batch: int
    cost: float  # predicted fraction of the step added
    cost_text: str
    offloaded_bytes: float  # host memory offloading needs per process

    @property
    def exact(self) -> bool:
        return not self.shape.optimizer_in_backward

    @property
    def names(self) -> list[str]:
        s, names = self.shape, []
        if s.chunked_loss:
            names.append("chunked LM head and loss")
        if s.gradient_checkpointing:
            policy = s.checkpoint_layers
            names.append("selective checkpointing" if policy == "selective" else "lean selective checkpointing"
                         if policy == "selective-lean" else "checkpointing every layer" if policy == "all"
                         else f"checkpointing one layer in {policy.removeprefix('every-')}")
        if s.offload_activations:
            names.append("activation offloading")
        if s.optimizer_in_backward:
            names.append("optimizer step in the backward (gradient clipping off)")
        return names

    def values(self) -> dict:
        """The set as FinetuneConfig values: each lever in it, and None for each lever it does not need (the run's own:
        a plan asks only for what it counts on; ``chunked_lm_loss=auto``, the default, still chunks where exact)."""
        s = self.shape
        return {"chunked_lm_loss": True if s.chunked_loss else None,
                "checkpoint_layers": s.checkpoint_layers if s.gradient_checkpointing else None,
                "offload_activations": True if s.offload_activations else None,
                "optimizer_in_backward": True if s.optimizer_in_backward else None}

    def config(self) -> list[str]:
        s, values = self.shape, []
        if s.chunked_loss:
            values.append("chunked_lm_loss=true")
        if s.gradient_checkpointing:
            values += ["gradient_checkpointing=true", f"checkpoint_layers={s.checkpoint_layers}"]
        if s.offload_activations:
            values.append("offload_activations=true")
        if s.optimizer_in_backward:
            values.append("optimizer_in_backward=true")
        return values


@dataclass(frozen=True)
class LeverTable:
    rows: tuple[tuple[str, LeverSet], ...]  # (what the row adds, every lever up to it): the cumulative table
    recommended: LeverSet | None
    reason: str
    micro_batch: int
    notes: tuple[str, ...] = ()


def pcie_bytes_per_second(generation: int | None, width: int | None) -> float | None:
    if not generation or not width or generation not in PCIE_GB_PER_LANE:
        return None
    return PCIE_GB_PER_LANE[generation] * width * 1e9 * PCIE_EFFICIENCY


class _Costs:
    """The predicted step-time cost of a set of levers (module docstring)."""

    def __init__(self, spec: ModelSpec, shape: TrainingShape, tokens: int, peak_flops: float | None, pcie: float | None):
        self.spec, self.method = spec, shape.method
        self.compute_s = (6 if shape.method == "full" else 4) * spec.params * tokens / (peak_flops * ASSUMED_MFU) if peak_flops else None
        self.recompute = 2 / (6 if shape.method == "full" else 4)
        self.pcie_assumed = pcie is None
        self.pcie = pcie or pcie_bytes_per_second(*ASSUMED_PCIE)

    def of(self, shape: TrainingShape, moved: float) -> tuple[float, str]:
        parts, cost = [], 0.0
        if shape.gradient_checkpointing:
            L = self.spec.num_layers or 1
            if shape.checkpoint_layers == "selective":
                cost += SELECTIVE_COST
                parts.append(f"selective ~{SELECTIVE_COST:.0%} (assumed)")
            elif shape.checkpoint_layers == "selective-lean":  # the widening matmuls again, not attention
                share = self.recompute * (1 - narrow_share(self.spec)) + SELECTIVE_COST
                cost += share
                parts.append(f"recompute +{share:.0%} FLOPs (the widening matmuls)")
            else:
                share = self.recompute * shape.checkpointed_layers(L) / L
                cost += share
                parts.append(f"recompute +{share:.0%} FLOPs")
        if shape.offload_activations:
            if shape.method == "full" and shape.compute_bytes == 2:
                plain = (self.spec.num_layers or 1) - shape.checkpointed_layers(self.spec.num_layers or 1)
                moved += 2 * self.spec.params * plain / (self.spec.num_layers or 1)  # autocast's 16-bit weight copies
            copy_s = moved / self.pcie
            link = " (PCIe Gen4 x16 assumed)" if self.pcie_assumed else ""
            if self.compute_s is None:
                cost += 1.0  # unknown: ranked last among the sets that fit
                parts.append(f"offload 2 x {moved / GIB:.2f} GiB over PCIe, {2 * copy_s * 1e3:.0f} ms{link}; GPU peak unknown")
            else:
                forward_s = self.compute_s * self.recompute  # the forward's share of the step
                added = (max(0.0, copy_s - forward_s) + copy_s) / self.compute_s
                cost += added
                parts.append(f"offload +{added:.0%} ({copy_s * 1e3:.0f} ms each way{link}, step {self.compute_s * 1e3:.0f} ms)")
        if shape.optimizer_in_backward:
            parts.append("optimizer in backward: no time, clipping off")
        return cost, "; ".join(parts) or "none"


def _evaluate(spec, shape, strategy, memory, costs) -> LeverSet:
    moved = offloaded_bytes(spec, shape) if shape.offload_activations else 0.0
    cost, text = costs.of(shape, moved)
    return LeverSet(shape=shape, total_bytes=estimate(spec, shape, strategy).total,
                    largest_micro_batch=largest_micro_batch(spec, replace(shape, micro_batch=1), strategy, memory),
                    cost=cost, cost_text=text, offloaded_bytes=moved)


def lever_table(spec: ModelSpec, shape: TrainingShape, strategy: str, gpu_memory_bytes: int, useful_micro_batch: int,
                per_gpu_batch: int | None = None, peak_flops: float | None = None,
                pcie_bytes_per_s: float | None = None, host_bytes_per_process: float | None = None) -> LeverTable:
    """The cumulative rows and the recommended set (module docstring). ``per_gpu_batch``: the samples one GPU
    contributes to a step (None: the micro-batch); the optimizer in the backward is offered only when one micro-batch
    is the whole step (no accumulation). ``host_bytes_per_process``: the host memory offloading may fill (None:
    unknown, not checked); a set that would offload more is not recommended."""
    micro = useful_micro_batch
    base = replace(shape, micro_batch=micro, gradient_checkpointing=False, checkpoint_layers="all", chunked_loss=False,
                   offload_activations=False, optimizer_in_backward=False)
    costs = _Costs(spec, shape, micro * shape.seq_len, peak_flops, pcie_bytes_per_s)
    notes = []
    layered = spec.is_transformer_shaped and not spec.activation_bytes_per_sample_fp32
    offered = STRATEGIES[strategy].levers  # plan/strategies.py
    partial = layered and "checkpoint_layers" in offered  # selective, lean selective, one layer in N
    chunk = (False, True) if chunk_offered(spec, shape, strategy) else (False,)
    policies = [None, "all"] + (["selective", "selective-lean"] if partial and shape.method != "qlora" else []) + (
        ["every-2"] if partial and (spec.num_layers or 0) >= 4 else [])
    offload = (False, True) if "offload_activations" in offered else (False,)
    if not STRATEGIES[strategy].replicated:
        notes.append(f"{strategy}: checkpointing every layer (its own config) and the chunked head where exact; selective "
                     "checkpointing, offloading and the optimizer in the backward need a whole model per GPU")
    backward_step = (False, True) if shape.method == "full" and "optimizer_in_backward" in offered else (False,)
    combos = []
    for chunked, policy, offloaded, in_backward in itertools.product(chunk, policies, offload, backward_step):
        levers = replace(base, chunked_loss=chunked, gradient_checkpointing=policy is not None,
                         checkpoint_layers=policy or "all", offload_activations=offloaded, optimizer_in_backward=in_backward)
        combos.append(_evaluate(spec, levers, strategy, gpu_memory_bytes, costs))
    cumulative = [("none (every activation kept)", {})]
    if True in chunk:
        cumulative.append(("+ chunked LM head and loss", {"chunked_loss": True}))
    if "selective" in policies:
        cumulative.append(("+ selective checkpointing", {"gradient_checkpointing": True, "checkpoint_layers": "selective"}))
        cumulative.append(("+ lean selective checkpointing", {"gradient_checkpointing": True, "checkpoint_layers": "selective-lean"}))
    cumulative.append(("+ checkpointing every layer", {"gradient_checkpointing": True, "checkpoint_layers": "all"}))
    if True in offload:
        cumulative.append(("+ activation offloading", {"offload_activations": True}))
    if True in backward_step:
        cumulative.append(("+ optimizer step in the backward", {"optimizer_in_backward": True}))
    whole_step = per_gpu_batch or micro
    if True in backward_step and not any(s.shape.optimizer_in_backward and s.largest_micro_batch >= whole_step for s in combos):
        notes.append(f"optimizer step in the backward: not a choice here, it needs the step's {whole_step} samples per GPU in "
                     "one micro-batch (no accumulation), and no set with it fits that many")
    evaluated = {s.shape: s for s in combos}  # every cumulative row is one of the combinations
    rows, current = [], base
    for label, change in cumulative:
        current = replace(current, **change)
        rows.append((label, evaluated[current]))
    host_ok = [s for s in combos if host_bytes_per_process is None or s.offloaded_bytes <= host_bytes_per_process]
    if len(host_ok) < len(combos):
        notes.append(f"offloading: sets that would hold more than {host_bytes_per_process / GIB:.1f} GiB of the host's memory "
                     "per process are not recommended")
    recommended, reason = _recommend(host_ok, useful_micro_batch, per_gpu_batch or micro)
    return LeverTable(rows=tuple(rows), recommended=recommended, reason=reason, micro_batch=micro, notes=tuple(notes))


def _rank(s: LeverSet, wanted: int) -> tuple:
    """Exact sets first, then the cheapest, then the one reaching the larger micro-batch up to ``wanted`` (the samples a
    GPU gives a step: fewer accumulation passes), then the fewest levers, then the least memory."""
    return (not s.exact, round(s.cost, 6), -min(s.largest_micro_batch, wanted), len(s.names), s.total_bytes)


def _recommend(combos: list[LeverSet], useful: int, wanted: int) -> tuple[LeverSet | None, str]:
    # the optimizer in the backward needs the whole step in one micro-batch: a set that fits less would accumulate
    combos = [s for s in combos if not s.shape.optimizer_in_backward or s.largest_micro_batch >= wanted]
    reaching = [s for s in combos if s.largest_micro_batch >= useful]
    if reaching:
        best = min(reaching, key=lambda s: _rank(s, wanted))
        what = ", ".join(best.names) or "no lever"
        return best, (f"{what}: micro-batch {best.largest_micro_batch} fits (the useful micro-batch is {useful}), predicted "
                      f"cost {best.cost_text}; the cheapest of the {len(reaching)} sets that reach it")
    fitting = [s for s in combos if s.largest_micro_batch >= 1]
    if not fitting:
        return None, "nothing fits, not even micro-batch 1 with every lever: more GPUs (sharding), LoRA or QLoRA, a shorter sequence"
    most = max(s.largest_micro_batch for s in fitting)
    best = min((s for s in fitting if s.largest_micro_batch == most), key=lambda s: _rank(s, wanted))
    return best, (f"{', '.join(best.names) or 'no lever'}: the largest micro-batch any set reaches ({most}, below the useful "
                  f"{useful}), predicted cost {best.cost_text}")


def format_rows(table: LeverTable) -> list[list[str]]:
    header = ["Levers (each adds to the rows above)", f"GiB per GPU at micro-batch {table.micro_batch}", "Largest micro-batch",
              "Predicted step cost"]
    return [header, *([label, f"{s.total_bytes / GIB:.2f}", str(s.largest_micro_batch), s.cost_text] for label, s in table.rows)]


def host_memory_note(table: LeverTable) -> str | None:
    chosen = table.recommended
    if chosen is None or not chosen.offloaded_bytes:
        return None
    return (f"activation offloading holds {chosen.offloaded_bytes / GIB:.2f} GiB of pinned host memory per process at "
            f"micro-batch {table.micro_batch}: the host needs that times the processes per node, beside the data loaders")
