"""The memory levers one on top of the other, torchtune's table for this model on this machine: memory per GPU, the
largest micro-batch that fits, and what each lever costs in step time, with the cheapest set that reaches a useful
micro-batch recommended.

The levers, in the order of their predicted cost (each row adds one to the rows above; every one is exact):

1. the chunked LM head and loss (causal LMs; ``chunked_lm_loss``): no full logits; nothing recomputed;
2. the optimizer step in the backward (full fine-tuning on one GPU; ``optimizer_in_backward``): gradients freed as
   they are used; the same work in another order;
3. selective checkpointing (``checkpoint_layers=selective``): each layer keeps its matmuls' and attention's outputs
   and recomputes the elementwise ops between them: no matmul runs twice;
4. checkpointing every layer (``checkpoint_layers=all``, replacing selective): the forward's matmuls run again in the
   backward: 2 of full fine-tuning's 6 FLOPs per parameter and token (+33%), 2 of LoRA's 4 (+50%);
5. activation offloading (``offload_activations``): the saved activations cross PCIe twice per step, on a side stream;
   free when the copies take less time than the step's compute, the excess otherwise.

Step time is predicted from FLOPs (6 per trained parameter and token, 4 for adapter methods whose base gets no weight
gradients) at ``ASSUMED_MFU`` of the GPU's peak, and PCIe at ``PCIE_EFFICIENCY`` of its link. These are estimates to
rank the levers; ``hf-gpu-train tune`` measures them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .activations import offloaded_bytes
from .memory import GIB, estimate, largest_micro_batch
from .model_spec import ModelSpec
from .training_shape import TrainingShape

ASSUMED_MFU = 0.4  # of the dense peak: what a well-fed fine-tune reaches on a datacenter GPU
PCIE_EFFICIENCY = 0.8  # of the link's raw rate, for large pinned copies
PCIE_GB_PER_LANE = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # GB/s per lane and direction, after encoding


@dataclass(frozen=True)
class LeverRow:
    lever: str  # what this row adds
    config: str  # the finetune config line that turns it on
    shape: TrainingShape  # every lever up to this row
    total_bytes: float  # per GPU at the table's micro-batch
    largest_micro_batch: int
    cost: str  # predicted step-time cost of this row's lever, in words
    cost_fraction: float | None  # the same as a fraction of the step (None: unknown)
    offloaded_bytes: float = 0.0  # host memory the offloading needs per process


@dataclass(frozen=True)
class LeverTable:
    rows: tuple[LeverRow, ...]
    micro_batch: int  # the micro-batch the memory column is at
    useful_micro_batch: int
    recommended: int | None  # index of the last row of the recommended set; None: nothing fits
    reason: str


def pcie_bytes_per_second(generation: int | None, width: int | None) -> float | None:
    if not generation or not width or generation not in PCIE_GB_PER_LANE:
        return None
    return PCIE_GB_PER_LANE[generation] * width * 1e9 * PCIE_EFFICIENCY


def _flops_per_token(spec: ModelSpec, method: str) -> float:
    return (6 if method == "full" else 4) * spec.params


def lever_table(spec: ModelSpec, shape: TrainingShape, strategy: str, gpu_memory_bytes: int, useful_micro_batch: int,
                peak_flops: float | None = None, pcie_bytes_per_s: float | None = None) -> LeverTable:
    """Rows from ``shape`` with no lever (no checkpointing) to every lever that applies (module docstring)."""
    base = replace(shape, micro_batch=useful_micro_batch, gradient_checkpointing=False, checkpoint_layers="all",
                   chunked_loss=False, offload_activations=False, optimizer_in_backward=False)
    tokens = useful_micro_batch * shape.seq_len
    compute_s = _flops_per_token(spec, shape.method) * tokens / (peak_flops * ASSUMED_MFU) if peak_flops else None
    recompute = 2 / (6 if shape.method == "full" else 4)
    steps: list[tuple[str, str, dict, str, float | None]] = [("none (every activation kept)", "", {}, "", 0.0)]
    if spec.causal_lm and spec.vocab_size:
        steps.append(("+ chunked LM head and loss", "chunked_lm_loss=true", {"chunked_loss": True}, "none: nothing recomputed", 0.0))
    if shape.method == "full" and strategy == "single":
        steps.append(("+ optimizer step in the backward", "optimizer_in_backward=true", {"optimizer_in_backward": True},
                      "none: the same work in another order", 0.0))
    if spec.is_transformer_shaped and not spec.activation_bytes_per_sample_fp32 and shape.method != "qlora":
        steps.append(("+ selective checkpointing", "gradient_checkpointing=true checkpoint_layers=selective",
                      {"gradient_checkpointing": True, "checkpoint_layers": "selective"},
                      "small: elementwise ops recomputed, no matmul", None))
    steps.append(("+ checkpointing every layer", "gradient_checkpointing=true checkpoint_layers=all",
                  {"gradient_checkpointing": True, "checkpoint_layers": "all"},
                  f"+{recompute:.0%} FLOPs: the forward's matmuls again", recompute))
    steps.append(("+ activation offloading", "offload_activations=true", {"offload_activations": True}, "", None))
    rows, current = [], base
    for lever, config, change, cost, fraction in steps:
        current = replace(current, **change)
        moved = offloaded_bytes(spec, current) if current.offload_activations else 0.0
        if change.get("offload_activations"):
            cost, fraction = _offload_cost(moved, compute_s, pcie_bytes_per_s)
        rows.append(LeverRow(lever=lever, config=config, shape=current, total_bytes=estimate(spec, current, strategy).total,
                             largest_micro_batch=largest_micro_batch(spec, replace(current, micro_batch=1), strategy, gpu_memory_bytes),
                             cost=cost or "-", cost_fraction=fraction, offloaded_bytes=moved))
    recommended, reason = _recommend(rows, useful_micro_batch)
    return LeverTable(rows=tuple(rows), micro_batch=useful_micro_batch, useful_micro_batch=useful_micro_batch,
                      recommended=recommended, reason=reason)


def _offload_cost(moved: float, compute_s: float | None, pcie: float | None) -> tuple[str, float | None]:
    """Two copies (out in the forward, back in the backward) on a side stream: hidden behind the compute unless
    longer than it."""
    if not pcie:
        return f"2 x {moved / GIB:.2f} GiB over PCIe per micro-batch (link unknown)", None
    transfer_s = 2 * moved / pcie
    if compute_s is None:
        return f"2 x {moved / GIB:.2f} GiB over PCIe: {transfer_s * 1e3:.0f} ms per micro-batch (GPU peak unknown)", None
    excess = max(0.0, transfer_s - compute_s) / compute_s
    if excess == 0:
        return f"hidden: {transfer_s * 1e3:.0f} ms of copies under {compute_s * 1e3:.0f} ms of compute", 0.0
    return f"+{excess:.0%}: {transfer_s * 1e3:.0f} ms of copies over {compute_s * 1e3:.0f} ms of compute", excess


def _recommend(rows: list[LeverRow], useful: int) -> tuple[int | None, str]:
    """The fewest levers (rows are in the order of their cost) that reach the useful micro-batch; else the set that
    reaches the largest micro-batch (the fewest levers among equals)."""
    for i, row in enumerate(rows):
        if row.largest_micro_batch >= useful:
            return i, (f"{_levers_up_to(rows, i)}: micro-batch {row.largest_micro_batch} fits, the useful micro-batch is {useful}")
    best = max(range(len(rows)), key=lambda i: (rows[i].largest_micro_batch, -i))
    if rows[best].largest_micro_batch >= 1:
        return best, (f"{_levers_up_to(rows, best)}: the largest micro-batch any set reaches ({rows[best].largest_micro_batch}, "
                      f"below the useful {useful})")
    return None, "nothing fits, not even micro-batch 1 with every lever: more GPUs (sharding), LoRA or QLoRA, a shorter sequence"


def _levers_up_to(rows: list[LeverRow], index: int) -> str:
    if index == 0:
        return "no lever needed"
    names = [row.lever.removeprefix("+ ") for row in rows[1:index + 1]]
    if "checkpointing every layer" in names and "selective checkpointing" in names:
        names.remove("selective checkpointing")  # replaced by it
    return ", ".join(names)


def recommended_config(table: LeverTable) -> list[str]:
    """The finetune config values of the recommended set."""
    if table.recommended is None:
        return []
    shape = table.rows[table.recommended].shape
    values = []
    if shape.chunked_loss:
        values.append("chunked_lm_loss=true")
    if shape.optimizer_in_backward:
        values.append("optimizer_in_backward=true")
    if shape.gradient_checkpointing:
        values += ["gradient_checkpointing=true", f"checkpoint_layers={shape.checkpoint_layers}"]
    if shape.offload_activations:
        values.append("offload_activations=true")
    return values


def format_rows(table: LeverTable) -> list[list[str]]:
    header = ["Levers (each adds to the rows above)", f"GiB per GPU at micro-batch {table.micro_batch}", "Largest micro-batch",
              "Predicted step cost"]
    body = []
    for i, row in enumerate(table.rows):
        mark = " <- recommended" if i == table.recommended else ""
        body.append([row.lever + mark, f"{row.total_bytes / GIB:.2f}", str(row.largest_micro_batch), row.cost])
    return [header, *body]


def host_memory_note(table: LeverTable) -> str | None:
    moved = max((row.offloaded_bytes for row in table.rows), default=0.0)
    if not moved:
        return None
    return (f"activation offloading holds {moved / GIB:.2f} GiB of pinned host memory per process at micro-batch "
            f"{table.micro_batch}: the host needs that times the processes per node, beside the data loaders")
