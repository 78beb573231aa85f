"""The launch strategies as one table: one row per strategy, with every fact the planner, the memory planner, the
lever table, the launch and tune read of it (in the spirit of accelerate's ``DistributedType`` with its plugins).

Before this table a strategy was a bare string that each reader tested in its own way (``startswith("deepspeed")``,
``endswith("-offload")``, a tuple of the replicated ones here, of the ZeRO ones there); adding one meant finding them
all. Now the readers ask the row: its family, what it shards, whether it offloads, its ZeRO stage, whether
``--strategy NAME`` asks for it, whether adapters train under it, which memory levers it offers.

What a row says (``Strategy``):

- ``family``: replicated (a whole model per process: one GPU, DDP), fsdp (FSDP2) or deepspeed (ZeRO);
- ``shards``: nothing, the gradients and optimizer states (FSDP's SHARD_GRAD_OP, ZeRO-2: the weights are whole on every
  GPU between the forward and the backward), or everything (FSDP's FULL_SHARD, ZeRO-3: the weights too);
- ``offload``: CPU memory holds the optimizer states and the step (FSDP and ZeRO-3: the parameters too);
- ``zero_stage``: DeepSpeed's stage, None outside DeepSpeed;
- ``distributed_type``: accelerate's ``DistributedType`` the launch config names;
- ``several_processes``: False only for one GPU (the memory planner compares the others on several GPUs);
- ``tries``: what ``--strategy NAME`` lets the memory planner choose from, cheapest first (empty: it cannot be asked
  for by name, only chosen); ``chosen_by_auto``: whether ``--strategy auto`` on several GPUs considers it;
- ``adapters``: the methods besides full fine-tuning that train under it (LoRA and QLoRA on a whole base per GPU,
  LoRA under ZeRO);
- ``levers``: the memory levers it offers beyond checkpointing every layer, which every strategy has (``chunked_lm_loss``;
  ``checkpoint_layers``: selective or one-in-N policies; ``offload_activations``; ``optimizer_in_backward``), as
  plan/lever_table.py explains;
- ``cpu_variant``: the name of its plan on CPU processes (cpu, cpu-ddp, cpu-fsdp: ``CPU_STRATEGIES``; DeepSpeed keeps
  its name on its CPU accelerator), None where the planner has no CPU plan for it; a CPU row's ``launched_as`` is the
  strategy launch/launched_strategy.py reads its launch back as.

Adding a strategy is a row here plus its renderers: the accelerate config of its family in plan/planner.py
(``FAMILY_SETTINGS``), its bytes per GPU in plan/memory.py (``estimate``, by family and what it shards) and, for a
launch read back, ``fsdp_name``/``deepspeed_name`` below. A new family adds a renderer to each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# families
REPLICATED = "replicated"
FSDP = "fsdp"
DEEPSPEED = "deepspeed"
# what a strategy shards
NOTHING = "nothing"
GRADIENTS_AND_OPTIMIZER = "gradients+optimizer"
EVERYTHING = "everything"

AUTO = "auto"  # --strategy auto: the planner chooses (not a strategy of its own)
OFFLOAD_SUFFIX = "-offload"  # a strategy's name with its optimizer (and parameters) in CPU memory
ALL_LEVERS = ("chunked_lm_loss", "checkpoint_layers", "offload_activations", "optimizer_in_backward")


@dataclass(frozen=True)
class Strategy:
    """One launch strategy: what the module docstring lists."""

    name: str
    family: str  # REPLICATED | FSDP | DEEPSPEED
    shards: str  # NOTHING | GRADIENTS_AND_OPTIMIZER | EVERYTHING
    distributed_type: str  # accelerate's DistributedType
    offload: bool = False
    zero_stage: int | None = None
    several_processes: bool = True
    tries: tuple[str, ...] = ()
    chosen_by_auto: bool = False
    adapters: tuple[str, ...] = ()
    levers: tuple[str, ...] = ()
    cpu_variant: str | None = None
    launched_as: str | None = None  # CPU rows only

    @property
    def replicated(self) -> bool:
        """A whole model on every process: values sized for one replica hold for another (one GPU and DDP alike)."""
        return self.shards == NOTHING

    @property
    def askable(self) -> bool:
        """Whether ``--strategy NAME`` asks for it (planner.STRATEGY_CHOICES)."""
        return bool(self.tries)

    @property
    def on_cpu(self) -> bool:
        """A CPU plan's word (``CPU_STRATEGIES``), not a GPU strategy."""
        return self.launched_as is not None

    @property
    def base(self) -> str:
        """The name without its CPU offload."""
        return self.name.removesuffix(OFFLOAD_SUFFIX)


def _rows(*rows: Strategy) -> dict[str, Strategy]:
    return {row.name: row for row in rows}


# The GPU strategies, in the order the memory planner's tables show them (cheapest first, the offloading ones last).
# ``strategy(name)`` reads a row (a ValueError naming the valid ones); ``STRATEGIES.get(name)`` where a name from outside
# (a plan document, a launch read back) may be none of them.
STRATEGIES: dict[str, Strategy] = _rows(
    Strategy("single", REPLICATED, NOTHING, "NO", several_processes=False, tries=("single",), adapters=("lora", "qlora"),
             levers=ALL_LEVERS, cpu_variant="cpu"),
    Strategy("ddp", REPLICATED, NOTHING, "MULTI_GPU", tries=("ddp",), chosen_by_auto=True, adapters=("lora", "qlora"),
             levers=("chunked_lm_loss", "checkpoint_layers", "offload_activations"), cpu_variant="cpu-ddp"),
    Strategy("fsdp-shard-grad-op", FSDP, GRADIENTS_AND_OPTIMIZER, "FSDP", chosen_by_auto=True, levers=("chunked_lm_loss",)),
    Strategy("fsdp", FSDP, EVERYTHING, "FSDP", tries=("fsdp-shard-grad-op", "fsdp", "fsdp-offload"), chosen_by_auto=True,
             levers=("chunked_lm_loss",), cpu_variant="cpu-fsdp"),
    Strategy("deepspeed-zero2", DEEPSPEED, GRADIENTS_AND_OPTIMIZER, "DEEPSPEED", zero_stage=2,
             tries=("deepspeed-zero2", "deepspeed-zero2-offload"), adapters=("lora",), levers=("chunked_lm_loss",),
             cpu_variant="deepspeed-zero2"),
    # ZeRO-3 partitions the output head's weight outside its forward: no chunked head (and no lever of a whole model)
    Strategy("deepspeed-zero3", DEEPSPEED, EVERYTHING, "DEEPSPEED", zero_stage=3,
             tries=("deepspeed-zero3", "deepspeed-zero3-offload"), adapters=("lora",), cpu_variant="deepspeed-zero3"),
    Strategy("fsdp-offload", FSDP, EVERYTHING, "FSDP", offload=True, chosen_by_auto=True, levers=("chunked_lm_loss",)),
    Strategy("deepspeed-zero2-offload", DEEPSPEED, GRADIENTS_AND_OPTIMIZER, "DEEPSPEED", offload=True, zero_stage=2,
             tries=("deepspeed-zero2-offload",), adapters=("lora",), levers=("chunked_lm_loss",),
             cpu_variant="deepspeed-zero2-offload"),
    Strategy("deepspeed-zero3-offload", DEEPSPEED, EVERYTHING, "DEEPSPEED", offload=True, zero_stage=3,
             tries=("deepspeed-zero3-offload",), adapters=("lora",), cpu_variant="deepspeed-zero3-offload"),
)

# The plans of a machine without a GPU: gloo processes through accelerate's MULTI_GPU launcher (ARCHITECTURE.md, CPU
# traps), FSDP2 over gloo as a rehearsal of the GPU run; DeepSpeed's CPU plans keep their GPU names.
CPU_STRATEGIES: dict[str, Strategy] = _rows(
    Strategy("cpu", REPLICATED, NOTHING, "NO", several_processes=False, launched_as="single"),
    Strategy("cpu-ddp", REPLICATED, NOTHING, "MULTI_GPU", launched_as="ddp"),
    Strategy("cpu-fsdp", FSDP, EVERYTHING, "FSDP", launched_as="fsdp"),
)


def strategy(name: str) -> Strategy:
    """The row of a plan's strategy (a GPU strategy or a CPU plan's word); ValueError naming the valid ones."""
    row = STRATEGIES.get(name) or CPU_STRATEGIES.get(name)
    if row is None:
        raise ValueError(f"unknown strategy {name!r}: one of {', '.join([*STRATEGIES, *CPU_STRATEGIES])}")
    return row


def strategy_names(where: Callable[[Strategy], bool]) -> tuple[str, ...]:
    """The GPU strategies whose row ``where`` holds for, in the table's order."""
    return tuple(name for name, row in STRATEGIES.items() if where(row))


ASKABLE = strategy_names(lambda s: s.askable)  # --strategy NAME, besides auto
MULTI_PROCESS = strategy_names(lambda s: s.several_processes)  # what the memory planner compares on several GPUs
AUTO_CANDIDATES = strategy_names(lambda s: s.chosen_by_auto)  # --strategy auto on several GPUs, cheapest first


def family_of(name: str | None) -> str | None:
    """The family of a strategy in a launch's words (launch/launched_strategy.py; a CPU plan's word is put in them
    first, scope.planned_strategy), also of a name a launch can hold without a row here (``deepspeed_name`` of ZeRO
    stage 1, read back from a launch's environment); None for anything else."""
    row = STRATEGIES.get(name or "")
    if row is not None:
        return row.family
    return next((family for family in (FSDP, DEEPSPEED) if (name or "").startswith(family)), None)


def replica_strategy(several: bool) -> str:
    """A whole model per process: DDP for several processes, one GPU's strategy for one."""
    return next(name for name, row in STRATEGIES.items() if row.replicated and row.several_processes == several)


def fsdp_name(reshard_after_forward: bool, offload: bool) -> str:
    """The name of an FSDP launch: resharding after the forward shards everything, keeping the parameters gathered
    between forward and backward shards the gradients and optimizer states (a launch may ask for an offload the
    planner has no row for: it is named the same way)."""
    shards = EVERYTHING if reshard_after_forward else GRADIENTS_AND_OPTIMIZER
    base = next(name for name, row in STRATEGIES.items() if row.family == FSDP and row.shards == shards and not row.offload)
    return base + (OFFLOAD_SUFFIX if offload else "")


def deepspeed_name(stage: int, offload: bool) -> str:
    """The name of a DeepSpeed launch of ZeRO ``stage`` (a stage without a row here is named the same way)."""
    return f"{DEEPSPEED}-zero{stage}" + (OFFLOAD_SUFFIX if offload else "")
