"""LaunchPlan -> Kubernetes manifests: a Kubeflow Trainer v2 ``TrainJob`` and the legacy Kubeflow ``PyTorchJob``.

Both run ``hf-gpu-train launch`` in every pod (one pod a node), so a pod gets what a launch on a machine gets: the
plan's .env and NAME.plan.json applied and scoped to the hardware it finds there, the CPU binding, DeepSpeed's
precision flag, stop signals forwarded to the training processes and the preemption exit code. The operators give
each pod its place as torchrun's ``PET_*`` variables: Kubeflow Trainer's torch-distributed runtime
(``pkg/runtime/framework/plugins/torch/torch.go`` in kubeflow/trainer) sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
``PET_NODE_RANK`` (the Job completion index), ``PET_MASTER_ADDR`` (``NAME-node-0-0.NAME``) and ``PET_MASTER_PORT``
(29500); the training-operator (``pkg/controller.v1/pytorch/envvar.go``, release-1.9) sets the same from the Master
replica's ``pytorchjob-port``. For a plan of several machines the launch takes its machine rank and main node from
them (``--machine_rank $PET_NODE_RANK --main_process_ip $PET_MASTER_ADDR --main_process_port $PET_MASTER_PORT``).

The files: the image holds this project as it is where ``hf-gpu-train config`` ran (the training script, and the
generated NAME.yaml, NAME.env, NAME.plan.json beside it: e.g. ``COPY . /workspace``) at ``workdir``; the command
changes into it (a TrainJob's trainer has no workingDir field). The script's arguments are the manifest's
``args`` (``spec.trainer.args`` / the container's ``args``): the command is ``bash -c SCRIPT hf-gpu-train`` and SCRIPT
ends with ``"$@"``.

Each pod also gets: the GPUs of a node (``nvidia.com/gpu``; none on a CPU-only plan, which asks for its CPU processes'
cores instead), a memory-backed ``/dev/shm`` (a container's default is 64 MiB: NCCL's shared-memory transport and the
DataLoader's workers need more), and the grace between Kubernetes' SIGTERM and SIGKILL the run needs to save
(``terminationGracePeriodSeconds``, ``launch/grace.py``), which the run also reads (``HF_GPU_TRAIN_GRACE_SECONDS``) and
torchrun waits for its workers (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default). No torch here.
"""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath

import yaml

from .. import __version__
from ..plan.planner import LaunchPlan
from ..plan.run_plan_file import PLAN_ENV, plan_path_for
from .grace import GRACE_ENV, Grace

__all__ = ["DEFAULT_WORKDIR", "container_command", "container_env", "pod_resources", "render_pytorchjob",
           "render_trainjob", "shm_volume"]

DEFAULT_WORKDIR = "/workspace"
TORCHRUN_SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torch.distributed.launcher.api: SIGTERM to SIGKILL of workers
TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
PYTORCHJOB_API = "kubeflow.org/v1"
RUNTIME = "torch-distributed"  # the ClusterTrainingRuntime Kubeflow Trainer installs (manifests/base/runtimes/)
TRAINER_CONTAINER = "node"  # that runtime's trainer container and replicated job (constants.Node)
PYTORCHJOB_CONTAINER = "pytorch"  # the training-operator finds the master port on this container (PyTorchJobDefaultContainerName)
PYTORCHJOB_PORT_NAME = "pytorchjob-port"  # PyTorchJobDefaultPortName
PATCH_MANAGER = "hf-gpu-train"  # our entry in the TrainJob's runtimePatches (one entry per manager)
SHM_VOLUME = "dshm"
GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's resource


def container_command(plan: LaunchPlan, config_path: str, script: str, workdir: str) -> list[str]:
    """``bash -c 'cd WORKDIR && exec hf-gpu-train launch ...' hf-gpu-train``: ``exec`` makes the launcher the
    container's PID 1, which Kubernetes' SIGTERM reaches; ``config_path`` and ``script`` are relative to ``workdir``.
    A plan of several machines takes its place from the ``PET_*`` variables the operator sets."""
    words = ["hf-gpu-train", "launch", "--config-file", shlex.quote(str(config_path))]
    if plan.accelerate["num_machines"] > 1:
        words += ['--machine_rank "$PET_NODE_RANK"', '--main_process_ip "$PET_MASTER_ADDR"', '--main_process_port "$PET_MASTER_PORT"']
    words += [shlex.quote(script), '"$@"']
    return ["bash", "-c", f"cd {shlex.quote(workdir)} && exec " + " ".join(words), "hf-gpu-train"]


def container_env(plan: LaunchPlan, config_path: str, workdir: str, grace: Grace) -> list[dict[str, str]]:
    """The plan's environment, where the plan is as the container sees it, and the grace (Kubernetes env: strings)."""
    env = dict(plan.env_dict)
    env[PLAN_ENV] = str(PurePosixPath(workdir) / plan_path_for(config_path))
    env[GRACE_ENV] = str(grace.seconds)
    env.setdefault(TORCHRUN_SHUTDOWN_ENV, str(grace.seconds))
    return [{"name": k, "value": str(v)} for k, v in env.items()]


def pod_resources(plan: LaunchPlan) -> dict:
    """What one pod (one node) asks for: its GPUs (an extended resource: a limit, which is also the request), or on a
    CPU-only plan the cores its processes' threads use."""
    if plan.gpus:
        return {"limits": {GPU_RESOURCE: plan.processes_per_machine}}
    threads = int(plan.env_dict.get("OMP_NUM_THREADS", "1") or 1)
    return {"requests": {"cpu": max(1, threads) * plan.processes_per_machine}}


def shm_volume() -> tuple[dict, dict]:
    """(the volume, its mount): ``/dev/shm`` backed by memory; it counts against the pod's memory, no size cap here."""
    return {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}, {"name": SHM_VOLUME, "mountPath": "/dev/shm"}


def _header(plan: LaunchPlan, kind: str, workdir: str, grace: Grace, config_path: str, submit: str, args_field: str) -> str:
    return "\n".join([
        f"# Kubeflow {kind} for {plan.machine} x{plan.accelerate['num_machines']} node(s), generated by hf-gpu-train {__version__}",
        f"# The image holds this project at {workdir} (the training script and {config_path} with its .env and",
        "# .plan.json beside it), and hf-gpu-train with its dependencies: e.g. `COPY . " + workdir + "` in its Dockerfile.",
        f"# The training script's arguments: {args_field}, e.g. [\"--config\", \"minilm_text_demo\"].",
        f"# Grace from SIGTERM to SIGKILL: {grace.describe()}.",
        f"# Submit: {submit}",
    ]) + "\n"


def _dump(doc: dict) -> str:
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=4096)


def render_trainjob(plan: LaunchPlan, config_path: str, script: str = "scripts/finetune.py", *, image: str, job_name: str,
                    grace: Grace, workdir: str = DEFAULT_WORKDIR, path_hint: str = "NAME.trainjob.yaml") -> str:
    """A TrainJob of Kubeflow Trainer v2 on its torch-distributed runtime. ``config_path``: the accelerate YAML as the
    container sees it, relative to ``workdir``; the pod's grace and /dev/shm go through ``runtimePatches``, the only
    place a TrainJob patches its runtime's pod template (kubeflow/trainer docs/operator-guides/runtime-patches.md;
    the trainer container's env, command, image and resources only through ``spec.trainer``)."""
    volume, mount = shm_volume()
    doc = {
        "apiVersion": TRAINJOB_API,
        "kind": "TrainJob",
        "metadata": {"name": job_name},
        "spec": {
            "runtimeRef": {"name": RUNTIME},
            "trainer": {
                "image": image,
                "command": container_command(plan, config_path, script, workdir),
                "args": [],
                "env": container_env(plan, config_path, workdir, grace),
                "numNodes": plan.accelerate["num_machines"],
                "numProcPerNode": plan.processes_per_machine,
                "resourcesPerNode": pod_resources(plan),
            },
            "runtimePatches": [{
                "manager": PATCH_MANAGER,
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
                    "name": TRAINER_CONTAINER,
                    "template": {"spec": {"template": {"spec": {
                        "terminationGracePeriodSeconds": grace.seconds,
                        "volumes": [volume],
                        "containers": [{"name": TRAINER_CONTAINER, "volumeMounts": [mount]}],
                    }}}},
                }]}}},
            }],
        },
    }
    return _header(plan, "Trainer v2 TrainJob", workdir, grace, config_path, f"kubectl apply -f {path_hint}",
                   "spec.trainer.args") + _dump(doc)


PYTORCHJOB_BACKOFF_LIMIT = 10  # restarts before the job is failed: preemptions count too


def render_pytorchjob(plan: LaunchPlan, config_path: str, script: str = "scripts/finetune.py", *, image: str, job_name: str,
                      grace: Grace, workdir: str = DEFAULT_WORKDIR, path_hint: str = "NAME.pytorchjob.yaml") -> str:
    """A PyTorchJob of the Kubeflow training-operator (v1): a Master and, for several machines, Workers, restarted
    on failure (a preempted run exits 75 and resumes from its checkpoint). The master port is the plan's."""
    nodes = plan.accelerate["num_machines"]
    volume, mount = shm_volume()

    def replica(count: int) -> dict:
        return {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": {"spec": {
                "terminationGracePeriodSeconds": grace.seconds,
                "containers": [{
                    "name": PYTORCHJOB_CONTAINER,
                    "image": image,
                    "workingDir": workdir,
                    "command": container_command(plan, config_path, script, workdir),
                    "args": [],
                    "env": container_env(plan, config_path, workdir, grace),
                    "ports": [{"name": PYTORCHJOB_PORT_NAME, "containerPort": plan.accelerate.get("main_process_port", 29500)}],
                    "resources": pod_resources(plan),
                    "volumeMounts": [mount],
                }],
                "volumes": [volume],
            }},
        }

    specs = {"Master": replica(1)}
    if nodes > 1:
        specs["Worker"] = replica(nodes - 1)
    doc = {
        "apiVersion": PYTORCHJOB_API,
        "kind": "PyTorchJob",
        "metadata": {"name": job_name},
        # OnFailure restarts a preempted run (exit 75) from its checkpoint; the limit ends a run that fails the same
        # way every time (a usage error, exit 2) instead of restarting it forever. (restartPolicy ExitCode would
        # retry 128-255 only: 75 counts as permanent there.)
        "spec": {"nprocPerNode": str(plan.processes_per_machine), "pytorchReplicaSpecs": specs,
                 "runPolicy": {"backoffLimit": PYTORCHJOB_BACKOFF_LIMIT}},
    }
    return _header(plan, "training-operator PyTorchJob", workdir, grace, config_path, f"kubectl apply -f {path_hint}",
                   "each replica's container args") + _dump(doc)
