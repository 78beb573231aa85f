"""LaunchPlan -> a SkyPilot task YAML (``sky launch``): the GPUs of a node, the nodes, setup and the run.

SkyPilot syncs ``workdir`` (this project, where ``hf-gpu-train config`` ran and ``sky launch`` runs) to every node,
runs ``setup`` once a node, then ``run`` on every node at once, with ``SKYPILOT_NODE_RANK``, ``SKYPILOT_NUM_NODES``,
``SKYPILOT_NODE_IPS`` (one address a line, the first is rank 0's) and ``SKYPILOT_NUM_GPUS_PER_NODE`` in its
environment. ``run`` is ``hf-gpu-train launch`` on the generated config, which applies the plan scoped to the node it
finds, then the fine-tune (``-m hf_gpu_train.finetune``, the installed package's) and the run's own arguments
(``--config NAME key=value``, given to ``config`` after ``--``: they are the run section's last words, to edit there);
a plan of several machines takes its machine rank, main node and process count from those variables. ``setup``
installs hf-gpu-train on each node: ``pip install -e .`` where the project is this package's clone, else the
released package of the version that wrote the task. ``envs``
are the plan's environment (``sky launch --env NAME=VALUE`` changes one; the launch names what differs from the
plan). The accelerator names are SkyPilot's catalog names (``sky show-gpus``), from the NVML names of the plan's
GPUs. No torch here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from .. import __version__
from ..errors import UsageError
from ..plan.planner import LaunchPlan
from .render import FINETUNE_ENTRY, run_args_text, script_words

__all__ = ["CLONE_SETUP", "DEFAULT_SETUP", "PIP_SETUP", "render_skypilot", "setup_for", "skypilot_accelerator"]

CLONE_SETUP = "pip install -e ."  # the workdir is this package's clone, synced to ~/sky_workdir on every node
PIP_SETUP = f"pip install 'hf-gpu-train=={__version__}'"  # any other workdir: the released package
DEFAULT_SETUP = CLONE_SETUP


def setup_for(project: Path) -> str:
    """``setup``: ``pip install -e .`` where ``project`` (the synced workdir) is a clone of this package (its
    pyproject.toml names hf-gpu-train), else ``pip install hf-gpu-train==VERSION``: a pip user's directory holds only
    the generated files, and ``pip install -e .`` there fails."""
    try:
        text = (project / "pyproject.toml").read_text()
    except OSError:
        return PIP_SETUP
    return CLONE_SETUP if re.search(r'^name\s*=\s*["\']hf[-_]gpu[-_]train["\']', text, re.MULTILINE) else PIP_SETUP

GiB = 2**30
# (NVML name pattern, SkyPilot name, SkyPilot name of the larger-memory model and the memory that tells them apart).
# Order matters where one name contains another: A100 before A10, L40S before L40 before L4, GH200 before H200.
_ACCELERATORS: tuple[tuple[str, str, tuple[str, float] | None], ...] = (
    (r"\bGH200\b", "GH200", None),
    (r"\bH200\b", "H200", None),
    (r"\bH100\b", "H100", None),
    (r"\bB200\b", "B200", None),
    (r"\bA100\b", "A100", ("A100-80GB", 60 * GiB)),  # SkyPilot's A100 is the 40 GB one
    (r"\bV100\b", "V100", ("V100-32GB", 24 * GiB)),  # and its V100 the 16 GB one
    (r"\bA10G\b", "A10G", None),
    (r"\bA10\b", "A10", None),
    (r"\bL40S\b", "L40S", None),
    (r"\bL40\b", "L40", None),
    (r"\bL4\b", "L4", None),
    (r"\bT4\b", "T4", None),
    (r"\bRTX A6000\b", "A6000", None),
    (r"\bRTX (\d{4})\b(?! Ada)", r"RTX\1", None),  # GeForce RTX 4090 -> RTX4090, RTX 3090 -> RTX3090
)


def skypilot_accelerator(name: str, memory_total_bytes: int) -> tuple[str, bool]:
    """(SkyPilot's name for this GPU, whether it is one of the names above; else the NVML name without vendor words and
    spaces, which SkyPilot takes as it is: a custom accelerator on Kubernetes, or an error naming its catalog)."""
    for pattern, sky_name, larger in _ACCELERATORS:
        found = re.search(pattern, name)
        if found:
            if larger is not None and memory_total_bytes >= larger[1]:
                return larger[0], True
            return found.expand(sky_name), True
    words = [w for w in re.split(r"[\s_]+", name) if w and w not in ("NVIDIA", "Tesla", "GeForce")]
    return "".join(words), False


def _accelerators(plan: LaunchPlan) -> tuple[str | None, str]:
    """(``NAME:COUNT`` or None for a CPU-only plan, the line that says where it came from)."""
    if not plan.gpus:
        return None, "a CPU-only plan: no accelerators"
    names = {skypilot_accelerator(g.name, g.memory_total_bytes) for g in plan.gpus}
    if len(names) > 1:
        raise UsageError(f"--target skypilot asks for one GPU model a node, and the plan uses {len(names)}: "
                         f"{', '.join(sorted({g.name for g in plan.gpus}))}: choose GPUs of one model with --gpu-ids")
    (sky_name, known), = names
    note = f"{plan.gpus[0].name} is SkyPilot's {sky_name}" if known else (
        f"{plan.gpus[0].name}: not a name known here, asked as {sky_name} (check `sky show-gpus`)")
    return f"{sky_name}:{plan.processes_per_machine}", note


def run_script(plan: LaunchPlan, config_path: str, script: str, run_args: tuple[str, ...] | list[str] = ()) -> str:
    """The ``run`` section: every node starts its processes; a plan of several machines takes its place from SkyPilot.
    ``script``: words (``-m hf_gpu_train.finetune``); ``run_args``: the run's arguments, its last words."""
    launch = f"hf-gpu-train launch --config-file {shlex.quote(str(config_path))}"
    entry = " ".join(shlex.quote(word) for word in script_words(script)) + run_args_text(run_args)
    if plan.accelerate["num_machines"] == 1:
        return f"set -euo pipefail\nexec {launch} {entry}\n"
    port = plan.accelerate.get("main_process_port", 29500)
    return "\n".join([
        "set -euo pipefail",
        'MAIN_IP=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)  # the first address is machine rank 0',
        "PER_NODE=${SKYPILOT_NUM_GPUS_PER_NODE:-0}",
        f'if [ "$PER_NODE" -lt 1 ]; then PER_NODE={plan.processes_per_machine}; fi  # no GPUs: the plan\'s CPU processes',
        f'exec {launch} --num_machines "$SKYPILOT_NUM_NODES" --num_processes "$((SKYPILOT_NUM_NODES * PER_NODE))" \\',
        f'    --machine_rank "$SKYPILOT_NODE_RANK" --main_process_ip "$MAIN_IP" --main_process_port {port} \\',
        f"    {entry}",
    ]) + "\n"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (setup, run) as literal blocks, as SkyPilot's own examples write them."""


_Dumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def render_skypilot(plan: LaunchPlan, config_path: str, script: str = FINETUNE_ENTRY, *, job_name: str,
                    workdir: str = ".", image: str | None = None, setup: str = DEFAULT_SETUP,
                    path_hint: str = "NAME.sky.yaml", run_args: tuple[str, ...] | list[str] = ()) -> str:
    """The task YAML. ``config_path`` and ``script``: relative to ``workdir`` (SkyPilot runs setup and run there);
    ``image``: a container image to run them in (``image_id: docker:IMAGE``), else the cloud's default image;
    ``run_args``: the run's arguments (``--config NAME key=value``), the run section's last words."""
    accelerators, note = _accelerators(plan)
    resources: dict = {"accelerators": accelerators} if accelerators else {
        "cpus": f"{max(1, int(plan.env_dict.get('OMP_NUM_THREADS', '1') or 1)) * plan.processes_per_machine}+"}
    if image:
        resources["image_id"] = f"docker:{image}"
    doc = {
        "name": job_name,
        "workdir": workdir,
        "num_nodes": plan.accelerate["num_machines"],
        "resources": resources,
        "envs": dict(plan.env_dict),
        "setup": setup + "\n",
        "run": run_script(plan, config_path, script, run_args),
    }
    header = [
        f"# SkyPilot task for {plan.machine} x{plan.accelerate['num_machines']} node(s), generated by hf-gpu-train {__version__}",
        f"# resources: {note}",
        f"# workdir {workdir} (this project, with {config_path} and its .env and .plan.json) is synced to every node;",
        f"# setup installs hf-gpu-train there ({setup}).",
        "# The run's arguments: " + (f"{' '.join(shlex.quote(a) for a in run_args)}, the last words of run (edit them there)."
                                     if run_args else "none given, so it trains the default run: add --config NAME key=value at the "
                                     "end of run (or give them to hf-gpu-train config after --)."),
        f"# Submit from that directory: sky launch -c {job_name} {path_hint}",
    ]
    return "\n".join(header) + "\n" + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096)
