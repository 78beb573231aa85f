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
                   "--main_process_ip", "job-node-0-0.job", "--main_process_port", "29500", "scripts/finetune.py",
                   "--config", "minilm_text_demo"]


def test_one_node_takes_its_place_from_the_config_alone(machine, fake_launcher):
    bin_dir, workdir = fake_launcher
    job = trainjob(plan_for(machine, "cpu-only", 1), workdir=str(workdir))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = subprocess.run(job["spec"]["trainer"]["command"], env=env, capture_output=True, text=True, timeout=30,
                         check=True).stdout.splitlines()
    assert out == [str(workdir), "launch", "--config-file", "launch_configs/x.yaml", "scripts/finetune.py"]


def test_a_cpu_only_plan_asks_for_its_processes_cores_and_no_gpu(machine):
    plan = plan_for(machine, "cpu-only", 1)
    resources = trainjob(plan)["spec"]["trainer"]["resourcesPerNode"]
    assert resources == {"requests": {"cpu": plan.processes_per_machine * int(plan.env_dict["OMP_NUM_THREADS"])}}
