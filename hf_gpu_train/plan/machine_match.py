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
from .run_plan_file import APPLIED_KEYS, accelerate_precision, plan_before_tune

# every value a run applies depends on the machine (precision and workers directly, the memory-derived ones on its
# GPU memory)
MACHINE_VALUES = APPLIED_KEYS
# environment variables the planner derives from the machine (threads from its cores, NCCL from its topology,
# devices from its GPUs); the others (ACCELERATE_USE_CPU, NCCL_DEBUG, ...) follow the launch config, not the box
MACHINE_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "NCCL_P2P_LEVEL", "NCCL_P2P_DISABLE",
                     "NCCL_IB_DISABLE")
MEMORY_TOLERANCE = 0.03  # drivers and ECC modes report a few percent apart for the same model


def hardware_record(profile: HardwareProfile, used=None) -> dict:
    """What NAME.plan.json records of the machine it was planned for: every GPU, the GPUs the plan uses (``used``:
    GpuInfo, None: all), and the CPU cores."""
    def gpus(items):
        return [{"name": g.name, "memory_bytes": g.memory_total_bytes} for g in items]

    return {"gpus": gpus(profile.gpus), "used": gpus(profile.gpus if used is None else used),
            "cpu_cores": profile.host.logical_cores}


def _gpus_text(gpus: list[tuple[str, int]]) -> str:
    if not gpus:
        return "no GPU"
    counts = Counter(gpus)
    return " + ".join(f"{n}x {name} ({memory / 2**30:.0f} GiB)" for (name, memory), n in counts.items())


def _same_model(a: tuple[str, int], b: tuple[str, int]) -> bool:
    return a[0] == b[0] and abs(a[1] - b[1]) <= MEMORY_TOLERANCE * max(a[1], b[1], 1)


def _holds(ours: list[tuple[str, int]], needed: list[tuple[str, int]]) -> bool:
    """Whether this machine's GPUs include one of the same model for every GPU the plan uses."""
    free = list(ours)
    for gpu in needed:
        match = next((i for i, g in enumerate(free) if _same_model(g, gpu)), None)
        if match is None:
            return False
        free.pop(match)
    return True


def differences(recorded: Mapping, here: HardwareProfile) -> list[str]:
    """What differs between the machine a plan records and this one ([]: it holds here). This machine matches when
    it has a GPU of the same model for every GPU the plan uses: a scheduler or a container that shows a job only its
    own GPUs (Slurm's ConstrainDevices, docker --gpus) is still the machine the plan was made for."""
    def pairs(items):
        return [(str(g.get("name")), int(g.get("memory_bytes") or 0)) for g in items or ()]

    found = []
    whole, used = pairs(recorded.get("gpus")), pairs(recorded.get("used", recorded.get("gpus")))
    ours = [(g.name, g.memory_total_bytes) for g in here.gpus]
    if not _holds(ours, used) or (not whole and ours):
        found.append(f"GPUs {_gpus_text(used if used else whole)} -> {_gpus_text(ours)}")
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
    return replace(memory, device_memory_bytes=free, usable_bytes=int(usable_bytes(free)), per="GPU", global_batch_target=None)


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
    scoped = replace(plan, values={k: v for k, v in plan.values.items() if k not in MACHINE_VALUES},
                     environment=tuple(e for e in plan.environment if e not in variables), cpu_binding=None, gpu_ids=None,
                     mig_instance=None, memory=_memory_here(plan.memory, here))
    yaml = plan.config_file.name if plan.config_file else "the launch config"
    return scoped, [f"plan made for another machine ({plan.machine}: {'; '.join(found)}): its machine values not applied "
                    f"({', '.join(dropped) or 'none decided'}); the recipe's values and this machine's defaults apply "
                    f"({yaml}'s own num_processes and gpu_ids reach accelerate as they are). Plan this machine with "
                    "`hf-gpu-train config --output ...` here"]


def unset_planned_variables(planned, scoped, environ) -> list[str]:
    """Machine variables of a plan made elsewhere that reached this process anyway (a shell that sourced NAME.env
    before the launch, the torchrun and sbatch lines): unset where they still hold the plan's value, so this machine's
    defaults apply as the run says; also the launch config's mixed_precision, which is the plan's. Returns one line
    per variable."""
    kept = set(scoped.environment)
    lines = []
    for variable in planned.environment:
        name, value, _ = variable
        if variable not in kept and environ.get(name) == value:
            del environ[name]
            lines.append(f"{name}={value} from the plan for {planned.machine} unset (it reached this process before the run)")
    yaml_precision = plan_before_tune(planned).value("precision")  # what `config` wrote in NAME.yaml (tune never changes it)
    accelerate_words = accelerate_precision(yaml_precision)
    if scoped.value("precision") is None and yaml_precision is not None and environ.get("ACCELERATE_MIXED_PRECISION") == accelerate_words:
        del environ["ACCELERATE_MIXED_PRECISION"]
        lines.append(f"mixed_precision {accelerate_words} of the launch config for {planned.machine} not used: the precision "
                     "is decided for this machine")
    return lines
