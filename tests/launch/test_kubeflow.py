"""The Kubeflow manifests (launch/kubeflow.py) against the CRDs' own schemas, vendored in tests/launch/schemas/
(README.md there: where from), and their command run by bash as a pod would run it."""

import os
import subprocess

import pytest
import yaml

from hf_gpu_train.launch.grace import GRACE_ENV, Grace
from hf_gpu_train.launch.kubeflow import render_pytorchjob, render_trainjob
from hf_gpu_train.plan.planner import PlanOptions, make_plan
from tests.launch.crd_schema import errors, load_crd, validator_for_crd
from tests.launching import executable

TRAINJOB_CRD = "trainer.kubeflow.org_trainjobs.yaml"
PYTORCHJOB_CRD = "kubeflow.org_pytorchjobs.yaml"
GRACE = Grace(save_seconds=100.0, source="test")  # 230 s
PET_RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}


@pytest.fixture(scope="module")
def trainjob_validator():
    return validator_for_crd(TRAINJOB_CRD)


@pytest.fixture(scope="module")
def pytorchjob_validator():
    return validator_for_crd(PYTORCHJOB_CRD)


def plan_for(machine, name, nodes):
    options = PlanOptions(num_machines=nodes, main_process_ip="job-node-0-0.job") if nodes > 1 else PlanOptions()
    return make_plan(machine(name), options)


def trainjob(plan, **kw):
    return yaml.safe_load(render_trainjob(plan, "launch_configs/x.yaml", image="ghcr.io/me/train:1", job_name="job",
                                          grace=GRACE, **kw))


def pytorchjob(plan, **kw):
    return yaml.safe_load(render_pytorchjob(plan, "launch_configs/x.yaml", image="ghcr.io/me/train:1", job_name="job",
                                            grace=GRACE, **kw))


CASES = [("8x-h100-sxm", 1), ("8x-h100-sxm", 2), ("1x-t4", 1), ("cpu-only", 1), ("cpu-only", 3)]


@pytest.mark.parametrize(("name", "nodes"), CASES)
def test_the_trainjob_is_valid_against_the_trainjob_crd(machine, trainjob_validator, name, nodes):
    plan = plan_for(machine, name, nodes)
    job = trainjob(plan)
    assert errors(trainjob_validator, job) == []
    trainer = job["spec"]["trainer"]
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed"}
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (nodes, plan.processes_per_machine)
    gpus = trainer["resourcesPerNode"].get("limits", {}).get("nvidia.com/gpu")
    assert gpus == (plan.processes_per_machine if plan.gpus else None)
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert {k: env[k] for k in plan.env_dict} == plan.env_dict
    assert env["HF_GPU_TRAIN_PLAN"] == "/workspace/launch_configs/x.plan.json"
    assert env[GRACE_ENV] == "230" and env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "230"
    assert not PET_RESERVED & set(env)  # the torch plugin's webhook refuses a TrainJob that sets them (torch.go)
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert pod["name"] == "node"
    spec = pod["template"]["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == 230
    assert spec["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    assert spec["containers"] == [{"name": "node", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}]


@pytest.mark.parametrize(("name", "nodes"), CASES)
def test_the_pytorchjob_is_valid_against_the_pytorchjob_crd(machine, pytorchjob_validator, name, nodes):
    plan = plan_for(machine, name, nodes)
    job = pytorchjob(plan)
    assert errors(pytorchjob_validator, job) == []
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    assert specs.get("Worker", {}).get("replicas") == (nodes - 1 if nodes > 1 else None)
    assert job["spec"]["nprocPerNode"] == str(plan.processes_per_machine)
    assert job["spec"]["runPolicy"] == {"backoffLimit": 10}  # a run failing the same way every time ends
    for replica in specs.values():
        assert replica["restartPolicy"] == "OnFailure"
        pod = replica["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 230
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"  # the operator reads the master port from this container only
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": plan.accelerate.get("main_process_port", 29500)}]
        assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
        assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        assert ("nvidia.com/gpu" in container["resources"].get("limits", {})) == bool(plan.gpus)
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["HF_GPU_TRAIN_PLAN"] == "/workspace/launch_configs/x.plan.json" and env[GRACE_ENV] == "230"


def test_the_validators_reject_broken_manifests(machine, trainjob_validator, pytorchjob_validator):
    """The validation is not vacuous: each of these is a mistake the API server refuses."""
    plan = plan_for(machine, "8x-h100-sxm", 2)
    good = trainjob(plan)

    def broken(change):
        job = yaml.safe_load(yaml.safe_dump(good))
        change(job)
        return errors(trainjob_validator, job)

    assert any("numNodes" in e and "'2' is not of type 'integer'" in e
               for e in broken(lambda j: j["spec"]["trainer"].update(numNodes="2")))
    # the field this API had before runtimePatches: pruned or refused by the API server, not silently ignored here
    assert any("podTemplateOverrides" in e for e in broken(lambda j: j["spec"].update(podTemplateOverrides=[])))
    assert broken(lambda j: j["spec"]["trainer"].update(numProcPerNode=0))  # CEL: self >= 1
    assert broken(lambda j: j["spec"]["trainer"]["env"].append({"name": "X", "value": 1}))  # env values are strings
    assert broken(lambda j: j["metadata"].update(name="Job_1"))  # CEL: an RFC 1035 label
    assert broken(lambda j: j.update(kind="PyTorchJob"))
    assert broken(lambda j: j["spec"].pop("runtimeRef"))
    assert broken(lambda j: j["spec"]["runtimePatches"][0].pop("manager"))
    # a pod field the runtime patches may not set (PodSpecPatch has no restartPolicy), deep inside the patch
    pod_patch = ("spec", "runtimePatches", 0, "trainingRuntimeSpec", "template", "spec", "replicatedJobs", 0, "template",
                 "spec", "template", "spec")

    def at(job, path):
        for key in path:
            job = job[key]
        return job

    assert any("restartPolicy" in e for e in broken(lambda j: at(j, pod_patch).update(restartPolicy="Never")))
    assert broken(lambda j: at(j, pod_patch)["containers"][0].update(image="other"))  # image only through spec.trainer

    job = pytorchjob(plan)
    assert errors(pytorchjob_validator, job) == []
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "1"
    assert any("replicas" in e for e in errors(pytorchjob_validator, job))
    assert errors(pytorchjob_validator, {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "x"},
                                         "spec": {}})  # pytorchReplicaSpecs is required
    assert errors(pytorchjob_validator, {**pytorchjob(plan), "apiVersion": "kubeflow.org/v2"})


def test_the_crds_write_int_or_string_as_any_of():
    """crd_schema.py adds anyOf [integer, string] where x-kubernetes-int-or-string stands alone: in these CRDs it never does."""

    def alone(node):
        if isinstance(node, dict):
            return int(bool(node.get("x-kubernetes-int-or-string")) and "anyOf" not in node) + sum(map(alone, node.values()))
        return sum(map(alone, node)) if isinstance(node, list) else 0

    assert [alone(load_crd(name)) for name in (TRAINJOB_CRD, PYTORCHJOB_CRD)] == [0, 0]


@pytest.fixture
def fake_launcher(tmp_path):
    """An `hf-gpu-train` on PATH that prints the directory it runs in and its arguments, one a line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "hf-gpu-train", '#!/bin/sh\npwd\nfor a in "$@"; do echo "$a"; done\n')
    workdir = tmp_path / "work"
    workdir.mkdir()
    return bin_dir, workdir


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_the_command_runs_hf_gpu_train_launch_in_the_workdir_with_the_operators_pet_variables(machine, fake_launcher, kind):
    bin_dir, workdir = fake_launcher
    plan = plan_for(machine, "8x-h100-sxm", 2)
    job = (trainjob if kind == "trainjob" else pytorchjob)(plan, workdir=str(workdir))
    container = job["spec"]["trainer"] if kind == "trainjob" else job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    argv = container["command"] + ["--config", "minilm_text_demo"]  # the manifest's args
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0.job",
           "PET_MASTER_PORT": "29500"}
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", **pet}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    assert out == [str(workdir), "launch", "--config-file", "launch_configs/x.yaml", "--machine_rank", "1",
                   "--main_process_ip", "job-node-0-0.job", "--main_process_port", "29500", "-m", "hf_gpu_train.finetune",
                   "--config", "minilm_text_demo"]


def test_one_node_takes_its_place_from_the_config_alone(machine, fake_launcher):
    bin_dir, workdir = fake_launcher
    job = trainjob(plan_for(machine, "cpu-only", 1), workdir=str(workdir))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = subprocess.run(job["spec"]["trainer"]["command"], env=env, capture_output=True, text=True, timeout=30,
                         check=True).stdout.splitlines()
    assert out == [str(workdir), "launch", "--config-file", "launch_configs/x.yaml", "-m", "hf_gpu_train.finetune"]


def test_a_cpu_only_plan_asks_for_its_processes_cores_and_no_gpu(machine):
    plan = plan_for(machine, "cpu-only", 1)
    resources = trainjob(plan)["spec"]["trainer"]["resourcesPerNode"]
    assert resources == {"requests": {"cpu": plan.processes_per_machine * int(plan.env_dict["OMP_NUM_THREADS"])}}


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
@pytest.mark.parametrize(("script", "words"), [
    ("-m hf_gpu_train.finetune", ["-m", "hf_gpu_train.finetune"]),  # issue 38: was one word, '-m hf_gpu_train.finetune'
    ("scripts/finetune.py", ["scripts/finetune.py"]),
    ("'my train.py' --seed 3", ["my train.py", "--seed", "3"]),  # a script's words as a shell reads the printed lines
])
def test_the_script_is_the_words_the_printed_lines_give_it(machine, fake_launcher, kind, script, words):
    bin_dir, workdir = fake_launcher
    render = trainjob if kind == "trainjob" else pytorchjob
    job = render(plan_for(machine, "cpu-only", 1), workdir=str(workdir), script=script)
    container = job["spec"]["trainer"] if kind == "trainjob" else job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    out = subprocess.run(container["command"] + container["args"], env={"PATH": f"{bin_dir}:{os.environ['PATH']}"},
                         capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    assert out == [str(workdir), "launch", "--config-file", "launch_configs/x.yaml", *words]


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_the_runs_arguments_are_the_manifests_args(machine, fake_launcher, kind):
    bin_dir, workdir = fake_launcher
    render = trainjob if kind == "trainjob" else pytorchjob
    run_args = ["--config", "minilm_text_demo", "learning_rate=3e-5", "run_name=a b"]
    job = render(plan_for(machine, "cpu-only", 1), workdir=str(workdir), run_args=run_args)
    container = job["spec"]["trainer"] if kind == "trainjob" else job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["args"] == run_args
    out = subprocess.run(container["command"] + container["args"], env={"PATH": f"{bin_dir}:{os.environ['PATH']}"},
                         capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    assert out[-4:] == run_args


def _pod_specs(job: dict) -> list[tuple[dict, dict]]:
    """(pod spec, the training container's spec) of every replica: the TrainJob's runtime patch, each PyTorchJob replica."""
    if job["kind"] == "TrainJob":
        patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        pod = patch["template"]["spec"]["template"]["spec"]
        return [(pod, pod["containers"][0])]
    return [(r["template"]["spec"], r["template"]["spec"]["containers"][0]) for r in job["spec"]["pytorchReplicaSpecs"].values()]


@pytest.mark.parametrize(("name", "nodes"), [("8x-h100-sxm", 2), ("cpu-only", 1)])
def test_a_checkpoint_volume_is_the_users_claim_mounted_where_output_dir_is(machine, trainjob_validator, pytorchjob_validator,
                                                                              name, nodes):
    """Issue 38, item 5: a container restarted after exit 75 (or a pod on another node) starts with a fresh
    filesystem; with a claim the checkpoints are on a volume that outlives it, at WORKDIR/outputs where every
    shipped recipe's output_dir (outputs/NAME, relative to the working directory) is."""
    plan = plan_for(machine, name, nodes)
    for render, validator in ((trainjob, trainjob_validator), (pytorchjob, pytorchjob_validator)):
        text = render_trainjob if render is trainjob else render_pytorchjob
        header = text(plan, "launch_configs/x.yaml", image="i:1", job_name="job", grace=GRACE, checkpoint_claim="train-ckpt")
        job = render(plan, checkpoint_claim="train-ckpt")
        assert errors(validator, job) == []
        for pod, container in _pod_specs(job):
            assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "train-ckpt"}} in pod["volumes"]
            assert {"name": "checkpoints", "mountPath": "/workspace/outputs"} in container["volumeMounts"]
            assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert "PersistentVolumeClaim train-ckpt is mounted at /workspace/outputs" in header
        assert ("ReadWriteMany" in header) == (nodes > 1)  # every node mounts it: every rank writes and reads
        assert "WARNING" not in header


@pytest.mark.parametrize("render", [render_trainjob, render_pytorchjob])
def test_without_a_checkpoint_volume_the_manifest_says_the_checkpoints_die_with_the_pod(machine, render):
    plan = plan_for(machine, "cpu-only", 1)
    text = render(plan, "launch_configs/x.yaml", image="i:1", job_name="job", grace=GRACE)
    warning = next(line for line in text.splitlines() if line.startswith("# WARNING"))
    assert "do not outlive the pod" in warning and "starts from step 0" in warning and "--checkpoint-volume" in warning
    job = yaml.safe_load(text)
    assert all(v.get("persistentVolumeClaim") is None for pod, _ in _pod_specs(job) for v in pod["volumes"])
