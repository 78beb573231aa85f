import json
import subprocess
import sys

import pytest

from hf_gpu_train.cli import main
from hf_gpu_train.hardware.snapshot import load, load_machine


def test_detect_table_and_topology(capsys):
    assert main(["detect", "--machine", "4x-rtx3090-nvlink-pairs"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA GeForce RTX 3090" in out and "8.6" in out
    assert "GPU0  X     NV4   PHB   PHB" in out
    assert "P2P: OK on 2 of 6 pairs" in out


def test_detect_json_and_save_round_trip(tmp_path, capsys):
    target = tmp_path / "box.json"
    assert main(["detect", "--machine", "8x-h100-sxm", "--json", "--save", str(target)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["format"] == "hf_gpu_train.machine" and len(printed["profile"]["gpus"]) == 8
    assert load(target) == load_machine("8x-h100-sxm")
    assert main(["detect", "--machine", str(target)]) == 0


def test_usage_errors_exit_2_without_traceback(tmp_path, capsys):
    assert main(["detect", "--machine", "no-such-box"]) == 2
    err = capsys.readouterr().err
    assert "no-such-box" in err and "hf-gpu-train machines" in err and "Traceback" not in err
    (tmp_path / "x.json").write_text("[]")
    assert main(["doctor", "--machine", str(tmp_path / "x.json")]) == 2
    with pytest.raises(SystemExit) as info:
        main(["detect", "--bogus"])
    assert info.value.code == 2


def test_doctor_on_snapshots(capsys):
    assert main(["doctor", "--machine", "2x-a100-one-busy"]) == 0
    assert "[WARN] other processes" in capsys.readouterr().out
    assert main(["doctor", "--machine", "cpu-only", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checks"][0]["status"] == "WARN" and report["exit_code"] == 0


def test_machines_lists_every_reference_machine(capsys):
    assert main(["machines"]) == 0
    out = capsys.readouterr().out
    for name in ("8x-h100-sxm", "1x-t4", "cpu-only", "2x-rtx4090"):
        assert name in out


def test_console_script_detect_runs_without_torch():
    code = ("import sys; from hf_gpu_train.cli import main; rc = main(['detect']); "
            "assert 'torch' not in sys.modules, 'detect imported torch'; sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Machine:" in result.stdout


@pytest.mark.slow
def test_live_doctor_on_this_machine_exits_cleanly():
    result = subprocess.run([sys.executable, "-m", "hf_gpu_train", "doctor", "--json"], capture_output=True, text=True, timeout=120)
    report = json.loads(result.stdout)
    assert result.returncode == report["exit_code"]
    assert report["checks"][0]["name"] == "driver"


def test_detect_shows_mig_instances_and_pending_changes(capsys):
    from tests.hardware.odd_machines import TEST_MACHINES_DIR

    assert main(["detect", "--machine", "1x-a100-mig"]) == 0
    out = capsys.readouterr().out
    assert "MIG instances (CUDA_VISIBLE_DEVICES takes the UUID):" in out
    assert "  GPU0  3g.40gb  39.2 GiB  0.0 GiB  GI 1 CI 0  MIG-a100-sxm-80-00-gi1-0000-000000000000" in out
    assert main(["detect", "--machine", str(TEST_MACHINES_DIR / "2x-a100-mig-pending.json")]) == 0
    out = capsys.readouterr().out
    assert "off->on" in out
    assert "MIG mode changes pending (applied at the next GPU reset): GPU1 off now, on after the reset" in out


def test_doctor_cli_reports_pending_mig_and_nvlink_without_p2p(capsys):
    from tests.hardware.odd_machines import TEST_MACHINES_DIR

    assert main(["doctor", "--machine", str(TEST_MACHINES_DIR / "2x-a100-mig-pending.json")]) == 0
    out = capsys.readouterr().out
    assert "[WARN] MIG: GPU1: MIG mode change pending" in out and "sudo nvidia-smi -i 1 -r" in out
    assert main(["doctor", "--machine", str(TEST_MACHINES_DIR / "4x-h100-vm-nvlink-no-p2p.json")]) == 0
    assert "[WARN] NVLink P2P: NVLinks active but P2P reported unsupported" in capsys.readouterr().out


def test_config_counts_and_indices_and_cpu_binding_prefix(tmp_path, capsys):
    from dataclasses import replace

    from hf_gpu_train.hardware.snapshot import save

    assert main(["config", "--machine", "2x-rtx4090", "--gpus", "0", "--output", str(tmp_path / "a")]) == 2
    assert "pass --gpu-ids 0" in capsys.readouterr().err
    assert main(["config", "--machine", "2x-rtx4090", "--gpu-ids", "1", "--output", str(tmp_path / "b")]) == 0
    assert "gpu_ids: '1'" in (tmp_path / "b.yaml").read_text()
    dgx1 = load_machine("8x-v100-dgx1")
    busy = replace(dgx1, gpus=(replace(dgx1.gpus[0], memory_used_bytes=20 * 2**30), *dgx1.gpus[1:]))
    box = save(busy, tmp_path / "dgx1-busy.json")
    capsys.readouterr()
    assert main(["config", "--machine", str(box), "--gpus", "4", "--output", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    # hf-gpu-train launch applies the taskset binding itself (tests/cli/test_launch.py); the others carry the prefix
    assert f"\n  hf-gpu-train launch --config-file {tmp_path / 'c'}.yaml -m hf_gpu_train.finetune\n" in out
    assert "taskset -c 20-39,60-79 accelerate launch" in out and "taskset -c 20-39,60-79 torchrun" in out
    assert json.loads((tmp_path / "c.plan.json").read_text())["cpu_binding"]["command_prefix"] == "taskset -c 20-39,60-79"
    assert "gpu_ids: 4,5,6,7" in (tmp_path / "c.yaml").read_text()
