"""``hf-gpu-train check-config``'s findings about NAME.plan.json: what a run on the checked machine will not apply.

The run itself says the same in its first lines; check-config says it before a job waits in a queue.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..hardware.profile import HardwareProfile
from .machine_match import differences

WARNING = "warning"


def plan_findings(plan_path: Path, profile: HardwareProfile) -> list[tuple[str, str]]:
    """(level, message) for the plan beside a config; [] when there is none or nothing to say."""
    import json

    try:
        doc = json.loads(plan_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []  # a missing or broken plan: the run names the file and the fix (run_plan_file)
    if not isinstance(doc, Mapping):
        return []
    fix = f"regenerate it with `{doc.get('command') or 'hf-gpu-train config --output ...'}`"
    found = []
    memory = doc.get("memory")
    if isinstance(memory, Mapping) and not (memory.get("planned_for") or {}).get("fingerprint"):
        found.append((WARNING, f"{plan_path.name} records no fingerprint of the model its memory plan was made for (written "
                               f"by an older hf-gpu-train): runs apply its environment, never its micro-batch, global batch "
                               f"or checkpointing; {fix}"))
    hardware = doc.get("hardware")
    if not isinstance(hardware, Mapping):
        found.append((WARNING, f"{plan_path.name} records no machine (written by an older hf-gpu-train): runs apply its "
                               f"machine values unchecked; {fix}"))
    elif differs := differences(hardware, profile):
        found.append((WARNING, f"{plan_path.name} was made for another machine ({doc.get('machine')}: {'; '.join(differs)}): "
                               f"a run on {profile.display_name} applies none of its machine values (precision, workers, "
                               f"threads, CPU binding, GPU ids, micro-batch); plan this machine with `hf-gpu-train config`"))
    return found
