"""`hf-gpu-train config --target NAME`: the files each target writes, what it prints, and the usage errors (exit 2,
one line naming the bad value and the fix). The manifests themselves: tests/launch/test_kubeflow.py, test_skypilot.py."""

import json
from dataclasses import replace

import pytest
import yaml

from hf_gpu_train.cli import build_parser, main
from hf_gpu_train.hardware.snapshot import load_machine, save
from hf_gpu_train.launch import slurm, targets
from hf_gpu_train.launch.grace import RECORD, Grace


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The project directory `config` runs in: the files a job gets are relative to it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def config(*argv):
    return main(["config", *argv])


def usage_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_the_default_target_writes_what_config_always_wrote(project, capsys):
    assert config("--machine", "8x-h100-sxm", "--output", "launch_configs/one") == 0
    assert sorted(p.name for p in (project / "launch_configs").iterdir()) == ["one.env", "one.plan.json", "one.yaml"]
    assert "sbatch" not in capsys.readouterr().out
    assert config("--machine", "8x-h100-sxm", "--output", "launch_configs/two", "--num-machines", "2",
                  "--main-process-ip", "node0") == 0
    assert (project / "launch_configs/two.sbatch").is_file()
    assert "On SLURM: sbatch launch_configs/two.sbatch" in capsys.readouterr().out


def test_slurm_writes_the_sbatch_for_one_machine_too(project, capsys):
    assert config("--machine", "1x-t4", "--output", "launch_configs/t4", "--target", "slurm", "--time-limit", "2-00:00:00",
                  "--partition", "gpu") == 0
    assert (project / "launch_configs/t4.sbatch").read_text().startswith("#!/bin/bash")
    assert "On SLURM: sbatch launch_configs/t4.sbatch" in capsys.readouterr().out


def test_the_sbatch_gets_time_limit_partition_and_grace(project, monkeypatch):
    seen = {}

    def fake_sbatch(plan, config_path, script, **kw):
        seen.update(kw)
        return "#!/bin/bash\n"

    monkeypatch.setattr(slurm, "render_sbatch", fake_sbatch)
    assert config("--machine", "1x-t4", "--output", "t4", "--target", "slurm", "--time-limit", "04:00:00",
                  "--partition", "gpu,gpu-long", "--params", "1e8") == 0
    assert seen["time_limit"] == "04:00:00" and seen["partition"] == "gpu,gpu-long"
    assert isinstance(seen["grace"], Grace) and "estimated" in seen["grace"].source


@pytest.mark.parametrize("value", ["4h", "04:00:00:00", "1-25:00", "10:61", "-1", "", "0"])
def test_a_time_limit_slurm_cannot_read_is_a_usage_error(project, capsys, value):
    assert config("--machine", "1x-t4", "--output", "t4", "--target", "slurm", "--time-limit", value) == 2
    err = usage_error(capsys)
    assert f"--time-limit {value!r}" in err and "HOURS:MINUTES:SECONDS" in err and "2-00:00:00" in err


@pytest.mark.parametrize(("value", "seconds"), [("90", 5400), ("90:30", 5430), ("04:00:00", 14400), ("2-0", 172800),
                                                ("1-12:30", 131400), ("2-00:00:00", 172800)])
def test_slurm_time_formats(value, seconds):
    assert slurm.slurm_time_limit(value) == seconds


def test_a_bad_partition_is_a_usage_error(project, capsys):
    assert config("--machine", "1x-t4", "--output", "t4", "--target", "slurm", "--partition", "gpu long") == 2
    assert "--partition 'gpu long'" in usage_error(capsys)


def test_slurm_options_for_another_target_are_usage_errors(project, capsys):
    assert config("--machine", "1x-t4", "--output", "t4", "--target", "kubeflow", "--image", "x:1", "--time-limit", "1:00:00") == 2
    assert "--time-limit 1:00:00: --target kubeflow has no use for it (it is for --target accelerate or slurm)" in usage_error(capsys)
    assert config("--machine", "1x-t4", "--output", "t4", "--time-limit", "1:00:00") == 2  # accelerate, one machine: no sbatch
    assert "add --target slurm" in usage_error(capsys)
    assert config("--machine", "1x-t4", "--output", "t4", "--image", "x:1") == 2
    assert "--image x:1: --target accelerate has no use for it" in usage_error(capsys)
    assert not list(project.iterdir())  # nothing written


@pytest.mark.parametrize("target", ["kubeflow", "pytorchjob"])
def test_the_kubernetes_targets_need_an_image(project, capsys, target):
    assert config("--machine", "8x-h100-sxm", "--output", "box", "--target", target) == 2
    assert f"--target {target} needs --image IMAGE" in usage_error(capsys)


@pytest.mark.parametrize(("target", "suffix", "kind", "main_node"), [
    ("kubeflow", ".trainjob.yaml", "TrainJob", "box-2node-node-0-0.box-2node"),
    ("pytorchjob", ".pytorchjob.yaml", "PyTorchJob", "box-2node-master-0"),
])
def test_the_kubernetes_targets_write_their_manifest_and_the_command_to_submit_it(project, capsys, target, suffix, kind, main_node):
    assert config("--machine", "8x-h100-sxm", "--output", "launch_configs/box_2node", "--target", target,
                  "--image", "ghcr.io/me/train:1", "--num-machines", "2") == 0
    out = capsys.readouterr().out
    manifest = project / f"launch_configs/box_2node{suffix}"
    assert f"kubectl apply -f launch_configs/box_2node{suffix}" in out and "grace" in out
    job = yaml.safe_load(manifest.read_text())
    assert job["kind"] == kind and job["metadata"]["name"] == "box-2node"
    # without --main-process-ip, the plan's main node is the address the operator gives machine rank 0
    assert yaml.safe_load((project / "launch_configs/box_2node.yaml").read_text())["main_process_ip"] == main_node
    assert "sbatch" not in out and not (project / "launch_configs/box_2node.sbatch").exists()


def test_skypilot_writes_its_task_and_the_command_to_launch_it(project, capsys):
    assert config("--machine", "8x-a100-sxm-80gb", "--output", "launch_configs/a100", "--target", "skypilot",
                  "--num-machines", "2") == 0
    out = capsys.readouterr().out
    assert "sky launch -c a100 launch_configs/a100.sky.yaml" in out
    task = yaml.safe_load((project / "launch_configs/a100.sky.yaml").read_text())
    assert task["resources"]["accelerators"] == "A100-80GB:8" and task["num_nodes"] == 2


def test_the_grace_comes_from_a_previous_runs_measured_save(project, capsys):
    run = project / "outputs/run"
    run.mkdir(parents=True)
    (run / RECORD).write_text(json.dumps({"save_seconds_max": 100.0}))
    assert config("--machine", "1x-t4", "--output", "t4", "--target", "kubeflow", "--image", "x:1",
                  "--save-time-from", str(run)) == 0
    assert "measured by the run in" in capsys.readouterr().out
    job = yaml.safe_load((project / "t4.trainjob.yaml").read_text())
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert patch["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 230  # 30 + 2 x 100 s
    assert config("--machine", "1x-t4", "--output", "t4b", "--target", "kubeflow", "--image", "x:1",
                  "--save-time-from", "outputs/none") == 2
    assert "--save-time-from outputs/none: no such directory" in usage_error(capsys)


def test_the_files_a_job_gets_must_be_inside_the_project(project, tmp_path_factory, capsys):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    assert config("--machine", "1x-t4", "--output", str(elsewhere / "t4"), "--target", "skypilot") == 2
    assert f"--output {elsewhere / 't4'}: outside" in usage_error(capsys)


def test_a_plan_on_gpus_a_job_would_not_have_is_refused_with_the_fix(project, capsys):
    dgx1 = load_machine("8x-v100-dgx1")
    busy = replace(dgx1, gpus=(replace(dgx1.gpus[0], memory_used_bytes=20 * 2**30), *dgx1.gpus[1:]))
    box = save(busy, project / "dgx1-busy.json")
    assert config("--machine", str(box), "--gpus", "4", "--output", "c", "--target", "pytorchjob", "--image", "x:1") == 2
    assert "plan with --gpu-ids 0,1,2,3" in usage_error(capsys)
    assert config("--machine", "1x-a100-mig", "--output", "m", "--target", "kubeflow", "--image", "x:1") == 2
    assert "MIG instance" in usage_error(capsys)


def test_an_existing_manifest_is_not_overwritten_without_force(project, capsys):
    args = ("--machine", "1x-t4", "--output", "t4", "--target", "skypilot")
    assert config(*args) == 0
    (project / "t4.yaml").unlink()
    assert config(*args) == 2
    assert "t4.sky.yaml" in usage_error(capsys)
    assert config(*args, "--force") == 0


def test_the_target_choices_come_from_the_registry(project, monkeypatch, capsys):
    def render(plan, yaml_path, script, settings):
        path = settings.path(".ray.py")
        return targets.Rendered(((path, f"# {plan.machine}\n"),), (f"ray job submit -- python {path}",))

    monkeypatch.setitem(targets._TARGETS, "ray", targets.Target("ray", render, "a Ray job"))
    assert "ray" in build_parser().parse_args(["config", "--output", "x", "--target", "ray"]).target
    assert config("--machine", "1x-t4", "--output", "t4", "--target", "ray") == 0
    assert (project / "t4.ray.py").read_text() == "# 1x-t4\n"
    assert "ray job submit -- python t4.ray.py" in capsys.readouterr().out
    with pytest.raises(ValueError, match="registered already"):
        targets.register_target(targets.Target("kubeflow", render, "again"))


def test_job_names_are_kubernetes_names():
    assert targets.job_name_for("box") == "box"
    assert targets.job_name_for("8x-H100_sxm.v2") == "hf-8x-h100-sxm-v2"
    assert len(targets.job_name_for("a" * 80)) == 40


def test_a_time_limit_too_short_for_the_warning_is_a_usage_error(project, capsys):
    """--signal=B:USR1@N with N at or past the time limit warns at the start: every requeued job would stop again
    before its first step, forever."""
    assert config("--machine", "1x-t4", "--output", "t4", "--target", "slurm", "--time-limit", "3") == 2
    err = usage_error(capsys)
    assert "--time-limit 3" in err and "s of warning before its limit" in err and "--save-time-from" in err


def printed_commands(out: str) -> list[str]:
    """The three launch lines `config` prints, each the line after its heading."""
    lines = out.splitlines()
    return [lines[lines.index(heading) + 1].strip() for heading in ("Launch:", "or with plain accelerate:", "or with torchrun:")]


TARGETS = [("accelerate", ()), ("slurm", ()), ("kubeflow", ("--image", "x:1")), ("pytorchjob", ("--image", "x:1")),
           ("skypilot", ()), ("ray", ())]


@pytest.mark.parametrize(("target", "extra"), TARGETS)
def test_every_printed_line_and_file_names_the_installed_fine_tune_not_a_clones_script(project, capsys, target, extra):
    """Issue 38, item 5: every printed line and manifest named scripts/finetune.py, which a pip install does not have;
    the module of the installed package is in a pip install and a clone alike."""
    assert config("--machine", "cpu-only", "--output", "launch_configs/cpu", "--target", target, *extra) == 0
    out = capsys.readouterr().out
    written = {p.name: p.read_text() for p in (project / "launch_configs").iterdir()}
    assert "scripts/finetune.py" not in out and not [name for name, text in written.items() if "scripts/finetune.py" in text]
    assert all("-m hf_gpu_train.finetune" in line for line in printed_commands(out))


def test_the_runs_arguments_after_a_double_dash_end_every_command_and_file(project, capsys):
    run_args = ["--config", "minilm_text_demo", "learning_rate=3e-5", "run_name=a b"]
    assert config("--machine", "cpu-only", "--num-machines", "2", "--output", "cpu", "--target", "skypilot", "--", *run_args) == 0
    out = capsys.readouterr().out
    quoted = "--config minilm_text_demo learning_rate=3e-5 'run_name=a b'"
    for line in printed_commands(out):
        assert line.rstrip(")").endswith(f"-m hf_gpu_train.finetune {quoted}"), line
    task = yaml.safe_load((project / "cpu.sky.yaml").read_text())
    assert task["run"].rstrip().endswith(f"-m hf_gpu_train.finetune {quoted}")
    assert config("--machine", "cpu-only", "--output", "job", "--target", "slurm", "--", *run_args) == 0
    assert f"On SLURM: sbatch job.sbatch {quoted}  (" in capsys.readouterr().out  # the sbatch passes its arguments on
    assert config("--machine", "cpu-only", "--output", "k", "--target", "pytorchjob", "--image", "x:1", "--", *run_args) == 0
    job = yaml.safe_load((project / "k.pytorchjob.yaml").read_text())
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"] == run_args
    assert config("--machine", "cpu-only", "--output", "r", "--target", "ray", "--", *run_args) == 0
    ray_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("On Ray"))
    assert ray_line.endswith(quoted)


@pytest.mark.parametrize("target", ["kubeflow", "pytorchjob"])
def test_a_checkpoint_volume_goes_into_the_manifest_and_without_one_config_warns(project, capsys, target):
    suffix = ".trainjob.yaml" if target == "kubeflow" else ".pytorchjob.yaml"
    assert config("--machine", "1x-t4", "--output", "t4", "--target", target, "--image", "x:1") == 0
    out = capsys.readouterr().out
    warning = next(line for line in out.splitlines() if line.startswith("warning:"))
    assert "do not outlive the pod" in warning and "starts from step 0" in warning and "--checkpoint-volume CLAIM" in warning
    assert config("--machine", "1x-t4", "--output", "t4v", "--target", target, "--image", "x:1",
                  "--checkpoint-volume", "train-ckpt") == 0
    out = capsys.readouterr().out
    assert "warning:" not in out and "checkpoints: the PersistentVolumeClaim train-ckpt at /workspace/outputs" in out
    text = (project / f"t4v{suffix}").read_text()
    assert "claimName: train-ckpt" in text and "mountPath: /workspace/outputs" in text


def test_a_checkpoint_volume_is_for_kubernetes_and_a_claims_name(project, capsys):
    assert config("--machine", "1x-t4", "--output", "t4", "--target", "skypilot", "--checkpoint-volume", "ckpt") == 2
    assert "--checkpoint-volume ckpt: --target skypilot has no use for it (it is for --target kubeflow or pytorchjob)" in usage_error(capsys)
    assert config("--machine", "1x-t4", "--output", "t4", "--target", "kubeflow", "--image", "x:1",
                  "--checkpoint-volume", "My_Claim") == 2
    assert "--checkpoint-volume 'My_Claim': the name of a PersistentVolumeClaim" in usage_error(capsys)
    assert not list(project.iterdir())
