import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from hf_gpu_train.cli import main
from hf_gpu_train.launch.render import parse_env, render_env, render_yaml, torchrun_command
from hf_gpu_train.launch.slurm import render_sbatch
from hf_gpu_train.plan.lint import ERROR, WARNING, lint
from hf_gpu_train.plan.planner import PlanOptions, make_plan
from tests.conftest import REFERENCE_MACHINES

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
    assert findings == []  # what `hf-gpu-train config` writes has nothing to warn about either


@pytest.mark.parametrize("name", REFERENCE_MACHINES)
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
    assert "--machine_rank \"$SLURM_NODEID\"" in script and "--rdzv_backend c10d" in script


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


def test_lint_warns_when_p2p_is_disabled_or_limited_for_nothing(machine):
    h100 = {**BASE, "num_processes": 8}
    found = lint_levels(h100, machine("8x-h100-sxm"), {"NCCL_P2P_DISABLE": "1"})
    assert (WARNING, "NCCL_P2P_DISABLE=1 but P2P works on every selected pair (NVLink on 0-1, 0-2, 0-3, 0-4, 0-5, 0-6 and "
            "22 more): collectives lose that bandwidth for nothing; remove NCCL_P2P_DISABLE") in found
    assert any("NCCL_P2P_LEVEL=LOC stops P2P on working pairs" in m for _, m in lint_levels(h100, machine("8x-h100-sxm"), {"NCCL_P2P_LEVEL": "LOC"}))
    assert lint_levels(h100, machine("8x-h100-sxm"), {"NCCL_P2P_LEVEL": "PIX"}) == []  # NVLink pairs keep P2P at PIX
    switches = {**BASE, "num_processes": 4, "gpu_ids": "0,1,2,3"}
    found = lint_levels(switches, machine("8x-a100-pcie-switches"), {"NCCL_P2P_LEVEL": "PIX"})
    assert found == [(WARNING, "NCCL_P2P_LEVEL=PIX stops P2P on working pairs 0-2, 0-3, 1-2, 1-3 (PXB): collectives "
                      "lose that bandwidth for nothing; use NCCL_P2P_LEVEL=PXB or leave it unset")]
    # where P2P is broken on some pairs, disabling or limiting it is the point: no warning
    bridged = {**BASE, "num_processes": 4}
    assert lint_levels(bridged, machine("4x-rtx3090-nvlink-pairs"), {"NCCL_P2P_LEVEL": "NVL"}) == []
    found = lint_levels(bridged, machine("4x-rtx3090-nvlink-pairs"), {"NCCL_P2P_DISABLE": "1"})
    assert found == [(WARNING, "NCCL_P2P_DISABLE=1 also stops P2P on the NVLinked pairs 0-1, 2-3, where it works: "
                      "NCCL_P2P_LEVEL=NVL keeps it there and off the broken pairs")]
    assert lint_levels({**BASE, "num_processes": 2}, machine("2x-rtx4090"), {"NCCL_P2P_DISABLE": "1"}) == []


def test_lint_mig_configs(machine):
    box = machine("1x-a100-mig")
    uuid = box.gpus[0].mig_instances[0].uuid
    single = {**BASE, "distributed_type": "NO", "num_processes": 1, "gpu_ids": uuid}
    assert lint_levels(single, box) == []
    found = lint_levels({**single, "gpu_ids": "MIG-nope"}, box)
    assert found == [(ERROR, f"gpu_ids MIG-nope: no such MIG instance on 1x-a100-mig (instances: {uuid}, "
                      f"{box.gpus[0].mig_instances[1].uuid})")]
    both = ",".join(m.uuid for m in box.gpus[0].mig_instances)
    found = lint_levels({**BASE, "gpu_ids": both}, box)
    assert any(level == ERROR and "NCCL cannot join MIG instances" in m for level, m in found)
    found = lint_levels({**single, "gpu_ids": "0"}, box)
    assert found == [(WARNING, f"gpu_ids 0 names GPU 0, which is in MIG mode: CUDA sees its MIG instances, not the GPU; "
                      f"name one instance instead (gpu_ids: {uuid})")]


def test_lint_warns_about_accelerate_cpu_affinity_on_other_gpus_and_pending_mig(machine):
    from tests.hardware.odd_machines import odd_machine

    cfg = {**BASE, "mixed_precision": "fp16", "num_processes": 4, "gpu_ids": "4,5,6,7", "enable_cpu_affinity": True}
    found = lint_levels(cfg, machine("8x-v100-dgx1"))
    assert (WARNING, "enable_cpu_affinity pins process i to the CPUs of NVML GPU i (accelerate ignores CUDA_VISIBLE_DEVICES "
            "there), but gpu_ids is 4,5,6,7: processes land next to GPUs 0,1,2,3; remove it and launch under "
            "`taskset -c 20-39,60-79`") in found
    assert not any("enable_cpu_affinity" in m for _, m in lint_levels({**cfg, "gpu_ids": "0,1,2,3"}, machine("8x-v100-dgx1")))
    found = lint_levels({**BASE, "gpu_ids": "0,1"}, odd_machine("2x-a100-mig-pending"))
    assert any(level == WARNING and m.startswith("GPU 1 has a MIG mode change pending") for level, m in found)


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


def test_taskset_binding_prefixes_torchrun_and_the_sbatch_launch(machine):
    from dataclasses import replace

    dgx1 = machine("8x-v100-dgx1")
    busy = replace(dgx1, gpus=(replace(dgx1.gpus[0], memory_used_bytes=20 * 2**30), *dgx1.gpus[1:]))
    plan = make_plan(busy, PlanOptions(gpus="4", num_machines=2, main_process_ip="node0"))
    assert plan.cpu_binding.command_prefix == "taskset -c 20-39,60-79"
    assert " ACCELERATE_MIXED_PRECISION=fp16 taskset -c 20-39,60-79 torchrun --nnodes=2 " in torchrun_command(plan)
    script = render_sbatch(plan, "launch_configs/x.yaml")
    assert "--kill-on-bad-exit=1 bash -c 'exec taskset -c 20-39,60-79 $HF_GPU_TRAIN launch --config-file \"$HF_GPU_TRAIN_CONFIG_FILE\"" in script
    assert "export HF_GPU_TRAIN_CONFIG_FILE=launch_configs/x.yaml " in script
    assert "export HF_GPU_TRAIN_PLAN=launch_configs/x.plan.json\n" in script
    unbound = make_plan(machine("8x-h100-sxm"), PlanOptions(num_machines=2, main_process_ip="node0"))
    assert "taskset" not in torchrun_command(unbound) and "taskset" not in render_sbatch(unbound, "x.yaml")


def test_torchrun_command_names_the_plan(machine):
    cmd = torchrun_command(make_plan(machine("2x-rtx4090")), "train.py", "cfg/box.yaml")
    assert "NCCL_P2P_DISABLE=1 TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 OMP_NUM_THREADS=12 HF_GPU_TRAIN_PLAN=cfg/box.plan.json ACCELERATE_MIXED_PRECISION=bf16 torchrun" in cmd
