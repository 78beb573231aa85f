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

The files: the image holds hf-gpu-train (a pip install) and, at ``workdir``, the directory ``hf-gpu-train config``
ran in as it is there (the generated NAME.yaml, NAME.env, NAME.plan.json, and a training script of the user's own if
the run is one: e.g. ``COPY . /workspace``); the command changes into it (a TrainJob's trainer has no workingDir
field). The fine-tune is the installed package's module (``-m hf_gpu_train.finetune``, ``render.FINETUNE_ENTRY``),
so the image needs no clone. The run's arguments are the manifest's ``args`` (``spec.trainer.args`` / the
container's ``args``): the command is ``bash -c SCRIPT hf-gpu-train`` and SCRIPT ends with ``"$@"``.

Each pod also gets: the GPUs of a node (``nvidia.com/gpu``; none on a CPU-only plan, which asks for its CPU processes'
cores instead), a memory-backed ``/dev/shm`` (a container's default is 64 MiB: NCCL's shared-memory transport and the
DataLoader's workers need more), and the grace between Kubernetes' SIGTERM and SIGKILL the run needs to save
(``terminationGracePeriodSeconds``, ``launch/grace.py``), which the run also reads (``HF_GPU_TRAIN_GRACE_SECONDS``) and
torchrun waits for its workers (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default).

Where the checkpoints live: a container's own filesystem goes with it, so the container the operator restarts after
exit 75 (and a pod rescheduled on another node) would start from step 0. With ``checkpoint_volume`` (a
PersistentVolumeClaim the user made) every pod mounts that claim at ``WORKDIR/outputs``, where every shipped recipe's
``output_dir`` is (``outputs/NAME``, relative to the working directory), so the next container resumes from the newest
complete checkpoint there; for several nodes the claim must be ReadWriteMany (every rank writes its part of a
checkpoint and reads it back when the run resumes). Without one the manifest says, in its header, that the checkpoints do not outlive the pod. No torch here.
"""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath

import yaml

from .. import __version__
from ..plan.planner import LaunchPlan
from ..plan.run_plan_file import PLAN_ENV, plan_path_for
from .grace import GRACE_ENV, Grace
from .render import FINETUNE_ENTRY, script_words

__all__ = ["CHECKPOINT_SUBDIR", "DEFAULT_WORKDIR", "checkpoint_mount_path", "checkpoint_volume", "container_command",
           "container_env", "no_volume_warning", "pod_resources", "render_pytorchjob", "render_trainjob", "shm_volume"]

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
CHECKPOINT_VOLUME = "checkpoints"  # the volume's name in the pod spec (the claim is the user's)
CHECKPOINT_SUBDIR = "outputs"  # under the workdir: every shipped recipe's output_dir is outputs/NAME
GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's resource


def container_command(plan: LaunchPlan, config_path: str, script: str, workdir: str) -> list[str]:
    """``bash -c 'cd WORKDIR && exec hf-gpu-train launch ...' hf-gpu-train``: ``exec`` makes the launcher the
    container's PID 1, which Kubernetes' SIGTERM reaches; ``config_path`` and ``script`` are relative to ``workdir``.
    A plan of several machines takes its place from the ``PET_*`` variables the operator sets."""
    words = ["hf-gpu-train", "launch", "--config-file", shlex.quote(str(config_path))]
    if plan.accelerate["num_machines"] > 1:
        words += ['--machine_rank "$PET_NODE_RANK"', '--main_process_ip "$PET_MASTER_ADDR"', '--main_process_port "$PET_MASTER_PORT"']
    words += [shlex.quote(word) for word in script_words(script)] + ['"$@"']
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


def checkpoint_mount_path(workdir: str) -> str:
    """Where the checkpoint volume is mounted: ``WORKDIR/outputs``, the folder of every shipped recipe's output_dir."""
    return str(PurePosixPath(workdir) / CHECKPOINT_SUBDIR)


def checkpoint_volume(claim: str, workdir: str) -> tuple[dict, dict]:
    """(the volume, its mount): the user's PersistentVolumeClaim at ``WORKDIR/outputs``, which outlives the pod."""
    return ({"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": claim}},
            {"name": CHECKPOINT_VOLUME, "mountPath": checkpoint_mount_path(workdir)})


def no_volume_warning(workdir: str) -> str:
    """What a manifest without a checkpoint volume means for the run, said where it is written and printed."""
    return (f"the checkpoints are written in the container's own filesystem (output_dir under {workdir}: a shipped "
            "recipe's is outputs/NAME) and do not outlive the pod: the container restarted after a preemption (exit 75) "
            "or a pod on another node starts from step 0; give --checkpoint-volume CLAIM (a PersistentVolumeClaim) to "
            "keep them")


def _volumes(workdir: str, claim: str | None) -> tuple[list[dict], list[dict]]:
    """(the pod's volumes, the container's mounts): /dev/shm, and the checkpoint volume when there is one."""
    pairs = [shm_volume()] + ([checkpoint_volume(claim, workdir)] if claim else [])
    return [volume for volume, _ in pairs], [mount for _, mount in pairs]


def _header(plan: LaunchPlan, kind: str, workdir: str, grace: Grace, config_path: str, submit: str, args_field: str,
            claim: str | None, run_args: tuple[str, ...] | list[str]) -> str:
    nodes = plan.accelerate["num_machines"]
    if claim:
        storage = [f"# Checkpoints: the PersistentVolumeClaim {claim} is mounted at {checkpoint_mount_path(workdir)} in every pod:",
                   f"# an output_dir under {CHECKPOINT_SUBDIR}/ (every shipped recipe's is outputs/NAME) outlives the pod, and a restarted",
                   "# container or a pod on another node resumes from the newest complete checkpoint there"
                   + (f"; {nodes} nodes mount it at once: the claim must be ReadWriteMany." if nodes > 1 else ".")]
    else:
        storage = [f"# WARNING: {no_volume_warning(workdir)}."]
    return "\n".join([
        f"# Kubeflow {kind} for {plan.machine} x{nodes} node(s), generated by hf-gpu-train {__version__}",
        f"# The image holds hf-gpu-train with its dependencies (e.g. `pip install hf-gpu-train` in its Dockerfile) and, at {workdir},",
        f"# {config_path} with its .env and .plan.json beside it (and a training script of your own, if the run is one):",
        f"# e.g. `COPY . {workdir}` from the directory `hf-gpu-train config` ran in.",
        f"# The run's arguments: {args_field}" + (" (hf-gpu-train config ... -- ARGS wrote them)." if run_args else
                                                  ", e.g. [\"--config\", \"minilm_text_demo\"]; none: the default run."),
        *storage,
        f"# Grace from SIGTERM to SIGKILL: {grace.describe()}.",
        f"# Submit: {submit}",
    ]) + "\n"


def _dump(doc: dict) -> str:
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=4096)


def render_trainjob(plan: LaunchPlan, config_path: str, script: str = FINETUNE_ENTRY, *, image: str, job_name: str,
                    grace: Grace, workdir: str = DEFAULT_WORKDIR, path_hint: str = "NAME.trainjob.yaml",
                    run_args: tuple[str, ...] | list[str] = (), checkpoint_claim: str | None = None) -> str:
    """A TrainJob of Kubeflow Trainer v2 on its torch-distributed runtime. ``config_path``: the accelerate YAML as the
    container sees it, relative to ``workdir``; the pod's grace and /dev/shm go through ``runtimePatches``, the only
    place a TrainJob patches its runtime's pod template (kubeflow/trainer docs/operator-guides/runtime-patches.md;
    the trainer container's env, command, image and resources only through ``spec.trainer``). ``run_args``: the run's
    arguments (``spec.trainer.args``); ``checkpoint_claim``: the PersistentVolumeClaim the checkpoints go to."""
    volumes, mounts = _volumes(workdir, checkpoint_claim)
    doc = {
        "apiVersion": TRAINJOB_API,
        "kind": "TrainJob",
        "metadata": {"name": job_name},
        "spec": {
            "runtimeRef": {"name": RUNTIME},
            "trainer": {
                "image": image,
                "command": container_command(plan, config_path, script, workdir),
                "args": list(run_args),
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
                        "volumes": volumes,
                        "containers": [{"name": TRAINER_CONTAINER, "volumeMounts": mounts}],
                    }}}},
                }]}}},
            }],
        },
    }
    return _header(plan, "Trainer v2 TrainJob", workdir, grace, config_path, f"kubectl apply -f {path_hint}",
                   "spec.trainer.args", checkpoint_claim, run_args) + _dump(doc)


PYTORCHJOB_BACKOFF_LIMIT = 10  # restarts before the job is failed: preemptions count too


def render_pytorchjob(plan: LaunchPlan, config_path: str, script: str = FINETUNE_ENTRY, *, image: str, job_name: str,
                      grace: Grace, workdir: str = DEFAULT_WORKDIR, path_hint: str = "NAME.pytorchjob.yaml",
                      run_args: tuple[str, ...] | list[str] = (), checkpoint_claim: str | None = None) -> str:
    """A PyTorchJob of the Kubeflow training-operator (v1): a Master and, for several machines, Workers, restarted
    on failure (a preempted run exits 75 and, with ``checkpoint_claim``, resumes from its checkpoint on that volume).
    The master port is the plan's; ``run_args``: the run's arguments (each container's ``args``)."""
    nodes = plan.accelerate["num_machines"]
    volumes, mounts = _volumes(workdir, checkpoint_claim)

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
                    "args": list(run_args),
                    "env": container_env(plan, config_path, workdir, grace),
                    "ports": [{"name": PYTORCHJOB_PORT_NAME, "containerPort": plan.accelerate.get("main_process_port", 29500)}],
                    "resources": pod_resources(plan),
                    "volumeMounts": mounts,
                }],
                "volumes": volumes,
            }},
        }

    specs = {"Master": replica(1)}
    if nodes > 1:
        specs["Worker"] = replica(nodes - 1)
    doc = {
        "apiVersion": PYTORCHJOB_API,
        "kind": "PyTorchJob",
        "metadata": {"name": job_name},
        # OnFailure restarts a preempted run (exit 75), which resumes from its checkpoint where the checkpoints outlive
        # the container (checkpoint_claim); the limit ends a run that fails the same
        # way every time (a usage error, exit 2) instead of restarting it forever. (restartPolicy ExitCode would
        # retry 128-255 only: 75 counts as permanent there.)
        "spec": {"nprocPerNode": str(plan.processes_per_machine), "pytorchReplicaSpecs": specs,
                 "runPolicy": {"backoffLimit": PYTORCHJOB_BACKOFF_LIMIT}},
    }
    return _header(plan, "training-operator PyTorchJob", workdir, grace, config_path, f"kubectl apply -f {path_hint}",
                   "each replica's container args", checkpoint_claim, run_args) + _dump(doc)
