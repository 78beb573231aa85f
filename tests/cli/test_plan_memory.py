"""`hf-gpu-train plan-memory`: the planner table and plan, against the memory one process really has."""

from hf_gpu_train.cli import main
from hf_gpu_train.hardware.snapshot import load_machine


def test_plan_memory_on_a_mig_box_plans_against_the_instance(capsys):
    box = load_machine("1x-a100-mig")
    largest = max(box.gpus[0].mig_instances, key=lambda m: m.memory_free_bytes)
    assert main(["plan-memory", "--machine", "1x-a100-mig", "--params", "1e9"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first == (f"1e+09 parameters: 1000.0M parameters; 1 MIG instance ({largest.uuid}) x "
                     f"{largest.memory_free_bytes / 2**30:.1f} GiB; bf16, adamw, seq 512, image 224")
    assert f"of {largest.memory_free_bytes / 2**30:.1f} GiB (8% kept as headroom)" in out


def test_plan_memory_on_whole_gpus_uses_the_free_memory_of_the_selection(capsys):
    assert main(["plan-memory", "--machine", "2x-a100-one-busy", "--params", "1e9", "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    box = load_machine("2x-a100-one-busy")
    free = max(g.memory_free_bytes for g in box.gpus)  # the idle GPU, not the busy one
    assert f"1 GPU(s) x {free / 2**30:.1f} GiB" in out.splitlines()[0]
