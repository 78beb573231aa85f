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
from .run_plan_file import accelerate_precision, plan_before_tune

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


def differences(recorded: Mapping, here: HardwareProfile | Mapping) -> list[str]:
    """What differs between the machine a plan records and this one (its profile or its ``hardware_record``; []: it
    holds here). This machine matches when it has a GPU of the same model for every GPU the plan uses: a scheduler or a
    container that shows a job only its own GPUs (Slurm's ConstrainDevices, docker --gpus) is still the machine the
    plan was made for."""
    def pairs(items):
        return [(str(g.get("name")), int(g.get("memory_bytes") or 0)) for g in items or ()]

    here = here if isinstance(here, Mapping) else hardware_record(here)
    found = []
    whole, used = pairs(recorded.get("gpus")), pairs(recorded.get("used", recorded.get("gpus")))
    ours = pairs(here.get("gpus"))
    if not _holds(ours, used) or (not whole and ours):
        found.append(f"GPUs {_gpus_text(used if used else whole)} -> {_gpus_text(ours)}")
    cores, our_cores = recorded.get("cpu_cores"), here.get("cpu_cores")
    if cores and our_cores and int(cores) != our_cores:
        found.append(f"CPU cores {cores} -> {our_cores}")
    return found


def detect_this_machine() -> HardwareProfile:
    """This machine as `hf-gpu-train detect` sees it (NVML and /proc; no torch)."""
    from ..hardware.detect import detect

    return detect()


def scope_to_this_machine(plan, here: HardwareProfile) -> tuple[object, list[str]]:
    """(plan, lines): the plan as a run on ``here`` may apply it, the machine compared alone (``scope.scope``): on the
    hardware it records, unchanged; elsewhere without its machine values, variables, CPU binding and GPU ids, and one
    line names what differs. A plan that records no hardware (written before it did) is applied as before, and says so."""
    from .scope import Fingerprint, scope

    scoped = scope(plan, Fingerprint(machine=hardware_record(here)), here)
    return scoped.plan, list(scoped.lines["machine"])


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
