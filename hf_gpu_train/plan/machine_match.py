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

from ..hardware.detect import detect
from ..hardware.profile import HardwareProfile
from .run_plan_file import accelerate_precision, plan_before_tune


def detect_this_machine() -> HardwareProfile:
    """This machine as `hf-gpu-train detect` sees it (NVML and /proc; no torch)."""

    return detect()


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
