"""The machine a plan was made for, against the machine a run is on.

`hf-gpu-train config --machine SNAPSHOT` plans for a machine you are not on, on purpose (a login node planning
for its GPU nodes). Applied on the machine it describes, the plan holds. Applied anywhere else, its
machine-derived values are wrong there: bf16 on a CPU without bf16 units, 8 loader workers on 2 cores, a
micro-batch sized for 141 GiB, threads and a CPU binding for 16 cores, NCCL settings for another topology. So the
plan records the hardware it was made for (GPU models, count and memory; CPU cores), each run compares it with
what it detects, and a run on other hardware applies none of those values and says what differs.

No torch here: the run calls this before torch is imported (OpenMP and NCCL read their variables once).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from ..hardware.profile import HardwareProfile

# plan values that depend on the machine (the memory-derived ones on its GPU memory)
MACHINE_VALUES = ("precision", "dataloader_num_workers", "per_device_train_batch_size", "global_batch_size",
                  "gradient_checkpointing", "torch_compile", "packing")
# environment variables the planner derives from the machine (threads from its cores, NCCL from its topology,
# devices from its GPUs); the others (ACCELERATE_USE_CPU, NCCL_DEBUG, ...) follow the launch config, not the box
MACHINE_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "NCCL_P2P_LEVEL", "NCCL_P2P_DISABLE",
                     "NCCL_IB_DISABLE")
MEMORY_TOLERANCE = 0.03  # drivers and ECC modes report a few percent apart for the same model


def hardware_record(profile: HardwareProfile) -> dict:
    """What NAME.plan.json records of the machine it was planned for (the whole machine, not only the GPUs used)."""
    return {"gpus": [{"name": g.name, "memory_bytes": g.memory_total_bytes} for g in profile.gpus],
            "cpu_cores": profile.host.logical_cores}


def _gpus_text(gpus: list[tuple[str, int]]) -> str:
    if not gpus:
        return "no GPU"
    counts = Counter(gpus)
    return " + ".join(f"{n}x {name} ({memory / 2**30:.0f} GiB)" for (name, memory), n in counts.items())


def _same_gpus(ours: list[tuple[str, int]], theirs: list[tuple[str, int]]) -> bool:
    if len(ours) != len(theirs):
        return False
    for (name_a, mem_a), (name_b, mem_b) in zip(sorted(ours), sorted(theirs), strict=True):
        if name_a != name_b or abs(mem_a - mem_b) > MEMORY_TOLERANCE * max(mem_a, mem_b, 1):
            return False
    return True


def differences(recorded: Mapping, here: HardwareProfile) -> list[str]:
    """What differs between the machine a plan records and this one ([]: the same hardware)."""
    found = []
    theirs = [(str(g.get("name")), int(g.get("memory_bytes") or 0)) for g in recorded.get("gpus") or ()]
    ours = [(g.name, g.memory_total_bytes) for g in here.gpus]
    if not _same_gpus(ours, theirs):
        found.append(f"GPUs {_gpus_text(theirs)} -> {_gpus_text(ours)}")
    cores, our_cores = recorded.get("cpu_cores"), here.host.logical_cores
    if cores and our_cores and int(cores) != our_cores:
        found.append(f"CPU cores {cores} -> {our_cores}")
    return found


def detect_this_machine() -> HardwareProfile:
    """This machine as `hf-gpu-train detect` sees it (NVML and /proc; no torch)."""
    from ..hardware.detect import detect

    return detect()


def _planned_variables(plan) -> dict[str, str]:
    """The machine variables as the planner wrote them (NAME.env edited to another value is the user's: it stays)."""
    return {e["name"]: str(e["value"]) for e in (plan.document or {}).get("environment", ()) if e.get("name") in MACHINE_VARIABLES}


def _memory_here(memory, here: HardwareProfile):
    """The plan's memory plan checked against this machine's GPU (its smallest free memory); None without a GPU."""
    from dataclasses import replace

    from .memory import usable_bytes

    if memory is None or not here.gpus:
        return None
    free = min(g.memory_free_bytes for g in here.gpus)
    return replace(memory, device_memory_bytes=free, usable_bytes=int(usable_bytes(free)), per="GPU")


def scope_to_this_machine(plan, here: HardwareProfile) -> tuple[object, list[str]]:
    """(plan, lines): the plan as a run on ``here`` may apply it. On the hardware it records, unchanged. Elsewhere
    its machine-derived values, variables, CPU binding and GPU ids are dropped (the recipe's own values and this
    machine's defaults apply) and one line names what differs; the memory check then speaks of this machine's GPU.
    A plan that records no hardware (written before it did) is applied as before, and the run says so."""
    from dataclasses import replace

    recorded = (plan.document or {}).get("hardware")
    if plan.document is not None and not isinstance(recorded, Mapping):
        return plan, [f"{plan.path.name} records no machine (written by an older hf-gpu-train): its machine values are "
                      f"applied unchecked; regenerate it with `{plan.command}` to have them checked"]
    if recorded is None:
        return plan, []
    found = differences(recorded, here)
    if not found:
        return plan, []
    dropped = [f"{k}={plan.value(k)}" for k in MACHINE_VALUES if plan.value(k) is not None]
    planned = _planned_variables(plan)
    variables = [(k, v, r) for k, v, r in plan.environment if planned.get(k) == v]
    dropped += [f"{k}={v}" for k, v, _ in variables]
    if plan.cpu_binding is not None and plan.cpu_binding.cpus_by_process:
        dropped.append("CPU binding")
    if plan.gpu_ids is not None:
        dropped.append(f"GPU ids {plan.gpu_ids}")
    scoped = replace(plan, values={k: v for k, v in plan.values.items() if k not in MACHINE_VALUES},
                     environment=tuple(e for e in plan.environment if e not in variables), cpu_binding=None, gpu_ids=None,
                     mig_instance=None, memory=_memory_here(plan.memory, here))
    return scoped, [f"plan made for another machine ({plan.machine}: {'; '.join(found)}): its machine values not applied "
                    f"({', '.join(dropped) or 'none decided'}); the recipe's values and this machine's defaults apply. "
                    f"Plan this machine with `hf-gpu-train config --output ...` here"]
