import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from hf_gpu_train.cli import main
from hf_gpu_train.launch.lint import ERROR, WARNING, lint
from hf_gpu_train.launch.plan import PlanOptions, make_plan
from hf_gpu_train.launch.render import parse_env, render_env, render_sbatch, render_yaml, torchrun_command

from ..conftest import REFERENCE_MACHINES

ROOT = Path(__file__).resolve().parents[2]


def test_committed_launch_configs_match_the_generator():
    result = subprocess.run([sys.executable, str(ROOT / "scripts/generate_launch_configs.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, "run `python scripts/generate_launch_configs.py`:\n" + result.stdout


@pytest.mark.parametrize("path", sorted((ROOT / "launch_configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_committed_config_loads_with_accelerates_loader_and_lints_clean(path):
    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
    machine = path.stem.split("-2node")[0].removesuffix("-fsdp")
    from hf_gpu_train.hardware.snapshot import load_machine

    env = parse_env(path.with_suffix(".env").read_text())
    findings = lint(yaml.safe_load(path.read_text()), load_machine(machine), env, mpirun_available=False)
    assert [f for f in findings if f.level == ERROR] == []


@pytest.mark.parametrize("name", [n for n in REFERENCE_MACHINES if n != "1x-a100-mig"])
def test_yaml_renders_for_every_machine_and_round_trips(tmp_path, machine, name):
    plan = make_plan(machine(name))
    path = tmp_path / "c.yaml"
    path.write_text(render_yaml(plan, "test"))
    assert yaml.safe_load(path.read_text()) == plan.accelerate
    assert load_config_from_file(str(path)).distributed_type is not None
    assert parse_env(render_env(plan)) == plan.env_dict


def test_torchrun_and_sbatch(machine):
    plan = make_plan(machine("8x-h100-sxm"), PlanOptions(num_machines=2, main_process_ip="node0", rdzv_backend="c10d"))
    cmd = torchrun_command(plan)
    assert "--nnodes=2 --nproc-per-node=8" in cmd and "--rdzv-endpoint=node0:29500" in cmd
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in cmd
    script = render_sbatch(plan, "launch_configs/x.yaml")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script and "--gpus-per-node=8" in script
    assert "--machine_rank \\$SLURM_NODEID" in script and "--rdzv_backend c10d" in script


def lint_levels(config, box, env=None, **kw):
    return [(f.level, f.message) for f in lint(config, box, env or {}, **kw)]


BASE = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "mixed_precision": "bf16",
        "num_processes": 2, "num_machines": 1, "machine_rank": 0, "use_cpu": False}


@pytest.mark.parametrize("change, machine_name, pattern", [
    ({"num_processes": 4}, "2x-rtx4090", "num_processes 4"),
    ({"gpu_ids": "0,7"}, "2x-rtx4090", r"gpu_ids \[7\] out of range"),
    ({"num_processes": 1}, "1x-t4", "has no bf16: use fp16"),
    ({"num_machines": 2, "num_processes": 3, "main_process_ip": "n0"}, "8x-h100-sxm", "not divisible"),
    ({"num_machines": 2, "num_processes": 16}, "8x-h100-sxm", "without main_process_ip"),
    ({"distributed_type": "MULTI_CPU", "mixed_precision": "no", "use_cpu": True}, "cpu-only", "needs mpirun"),
    ({"mixed_precison": "bf16"}, "8x-h100-sxm", "did you mean 'mixed_precision'"),
    ({"mixed_precision": "no"}, "cpu-only", "independent trainings"),
])
def test_lint_errors(machine, change, machine_name, pattern):
    import re

    found = lint_levels({**BASE, **change}, machine(machine_name), mpirun_available=False)
    assert any(level == ERROR and re.search(pattern, msg) for level, msg in found), found


def test_lint_warnings(machine):
    found = lint_levels(BASE, machine("2x-rtx4090"))
    assert (WARNING, "P2P not supported between GPUs 0-1 but NCCL_P2P_DISABLE is not set: NCCL collectives may hang") in found
    assert not any(level == WARNING for level, _ in lint_levels(BASE, machine("2x-rtx4090"), {"NCCL_P2P_DISABLE": "1"}))
    mixed = lint_levels({**BASE, "gpu_ids": "0,1"}, machine("mixed-a100-rtx3090"))
    assert any("mixed GPU models" in m for _, m in mixed)
    busy = lint_levels({**BASE, "gpu_ids": "0,1"}, machine("2x-a100-one-busy"))
    assert any("GPU 1 is busy" in m for _, m in busy)


def test_check_config_exit_codes(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({**BASE, "num_processes": 8}))
    assert main(["check-config", str(good), "--machine", "8x-h100-sxm"]) == 0
    assert main(["check-config", str(good), "--machine", "2x-rtx4090"]) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("key: [unclosed")
    assert main(["check-config", str(bad), "--machine", "2x-rtx4090"]) == 2
    assert main(["check-config", str(tmp_path / "none.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_config_command_writes_files_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "cfg" / "box"
    assert main(["config", "--machine", "2x-rtx4090", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "NCCL_P2P_DISABLE" in printed and f"hf-gpu-train launch --config-file {out}.yaml" in printed
    assert load_config_from_file(f"{out}.yaml").num_processes == 2
    assert parse_env((tmp_path / "cfg" / "box.env").read_text())["NCCL_P2P_DISABLE"] == "1"
    before = (tmp_path / "cfg" / "box.yaml").read_text()
    assert main(["config", "--machine", "1x-t4", "--output", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "cfg" / "box.yaml").read_text() == before
    assert main(["config", "--machine", "1x-t4", "--precision", "bf16", "--output", str(tmp_path / "t4")]) == 2
    assert "use --precision fp16" in capsys.readouterr().err


def test_plan_memory_command(capsys):
    assert main(["plan-memory", "--params", "7e9", "--gpu-memory-gib", "80", "--gpus", "8", "--seq-len", "2048"]) == 0
    out = capsys.readouterr().out
    assert "deepspeed-zero3" in out and "Plan:" in out
    assert main(["plan-memory"]) == 2
