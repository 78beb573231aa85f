"""``hf-gpu-train launch --nnodes MIN:MAX``: torchrun's command with the variables accelerate would export, the
rendezvous hosted by node 0, usage errors named, and the restart loop around it (the run with a node lost:
tests/finetune/test_resume.py)."""

import sys

import pytest

from hf_gpu_train.cli import launch as launch_cli
from hf_gpu_train.cli import main
from hf_gpu_train.cli.launch import build_launch, take_nnodes
from hf_gpu_train.errors import UsageError
from hf_gpu_train.hardware.snapshot import load_machine
from hf_gpu_train.launch.accelerate_env import launch_environment
from hf_gpu_train.launch.elastic import NodeRange, parse_node_range
from hf_gpu_train.launch.restarts import Outcome

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture
def two_nodes(tmp_path):
    assert main(["config", "--machine", "cpu-only", "--num-processes", "2", "--num-machines", "2", "--main-process-ip",
                 "10.0.0.1", "--main-process-port", "29611", "--output", str(tmp_path / "cpu")]) == 0
    return tmp_path / "cpu.yaml"


def option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize(("value", "nodes"), [("1:2", NodeRange(1, 2)), ("3", NodeRange(3, 3)), ("2:8", NodeRange(2, 8))])
def test_a_node_range_is_read(value, nodes):
    assert parse_node_range(value) == nodes and str(nodes) == (value if ":" in value else f"{value}:{value}")


@pytest.mark.parametrize("value", ["2:1", "0:2", "a:b", "1:", ""])
def test_a_node_range_that_is_not_one_is_a_usage_error_naming_it(value):
    with pytest.raises(UsageError, match=f"--nnodes {value}: give MIN:MAX"):
        parse_node_range(value)


def test_the_elastic_launch_is_torchrun_with_accelerates_variables_and_node_0_hosting_the_rendezvous(two_nodes):
    nodes, argv = take_nnodes(["--nnodes", "1:2", "--config-file", str(two_nodes), "-m", "hf_gpu_train.finetune", "lr=1"])
    assert nodes == NodeRange(1, 2) and "--nnodes" not in argv
    launch = build_launch(argv, environ={}, nodes=nodes)
    cmd = launch.cmd
    assert cmd[:3] == TORCHRUN and option(cmd, "--nnodes") == "1:2" and option(cmd, "--nproc-per-node") == "2"
    assert option(cmd, "--rdzv-backend") == "c10d" and option(cmd, "--rdzv-endpoint") == "10.0.0.1:29611"
    assert option(cmd, "--rdzv-conf") == "join_timeout=600,last_call_timeout=30,is_host=1"
    assert option(cmd, "--max-restarts") == "0"  # hf-gpu-train launch restarts (restarts.py), torchrun never
    assert cmd[-3:] == ["--module", "hf_gpu_train.finetune", "lr=1"]
    assert launch.env["ACCELERATE_MIXED_PRECISION"] == "no" and launch.env["ACCELERATE_USE_CPU"] == "1"
    assert launch.env["HF_GPU_TRAIN_PLAN"].endswith("cpu.plan.json") and launch.nodes == nodes and launch.machines == 2
    joining = build_launch(["--machine_rank", "1", "--rdzv_conf", "last_call_timeout=5", *argv], environ={}, nodes=nodes)
    assert option(joining.cmd, "--rdzv-conf") == "join_timeout=600,last_call_timeout=5,is_host=0"
    assert "(node 1 joins the rendezvous)" in joining.notes[-1]


def test_the_strategy_reaches_the_processes_as_accelerate_would_export_it(tmp_path):
    assert main(["config", "--machine", "2x-rtx4090", "--params", "1.1e8", "--strategy", "fsdp", "--output",
                 str(tmp_path / "f")]) == 0
    script = tmp_path / "train.py"
    script.write_text("")
    launch = build_launch(["--config-file", str(tmp_path / "f.yaml"), str(script)], environ={}, nodes=NodeRange(1, 1),
                          here=load_machine("2x-rtx4090"))
    import yaml

    expected = launch_environment(yaml.safe_load((tmp_path / "f.yaml").read_text()))
    assert expected["ACCELERATE_USE_FSDP"] == "true"
    assert {k: launch.env[k] for k in expected} == expected
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "0,1" and option(launch.cmd, "--rdzv-endpoint").startswith("127.0.0.1:")


def test_an_option_the_elastic_launch_would_drop_is_a_usage_error(two_nodes):
    with pytest.raises(UsageError, match="--dynamo_backend with --nnodes 1:2: an elastic launch runs torchrun itself"):
        build_launch(["--dynamo_backend", "inductor", "--config-file", str(two_nodes), "-m", "x"], environ={},
                     nodes=NodeRange(1, 2))
    with pytest.raises(UsageError, match="--rdzv_backend static with --nnodes 1:2"):
        build_launch(["--rdzv_backend", "static", "--config-file", str(two_nodes), "-m", "x"], environ={}, nodes=NodeRange(1, 2))


def test_several_nodes_without_a_rendezvous_address_is_a_usage_error(tmp_path):
    assert main(["config", "--machine", "cpu-only", "--num-processes", "2", "--output", str(tmp_path / "one")]) == 0
    with pytest.raises(UsageError, match="--nnodes 1:2 needs the rendezvous: --main_process_ip HOST"):
        build_launch(["--config-file", str(tmp_path / "one.yaml"), "-m", "x"], environ={}, nodes=NodeRange(1, 2))


def test_the_command_line_says_a_bad_range_with_exit_2(two_nodes, capsys):
    assert main(["launch", "--nnodes", "4:2", "--config-file", str(two_nodes), "-m", "hf_gpu_train.finetune"]) == 2
    assert "--nnodes 4:2: give MIN:MAX" in capsys.readouterr().err


def run_loop(monkeypatch, two_nodes, outcomes: list[Outcome], *extra: str) -> int:
    starts = iter(outcomes)
    monkeypatch.setattr(launch_cli, "launch_once", lambda cmd, env: next(starts))
    monkeypatch.setattr(launch_cli.time, "sleep", lambda seconds: None)
    return main(["launch", "--nnodes", "1:2", *extra, "--config-file", str(two_nodes), "-m", "hf_gpu_train.finetune"])


def test_a_start_that_found_the_rendezvous_closed_joins_again_without_counting_a_restart(monkeypatch, two_nodes, capsys):
    closed = Outcome(1, rendezvous_closed=True)
    died = Outcome(1, (1, -9), ((0, 5), (1, 5)), resumes=True)
    assert run_loop(monkeypatch, two_nodes, [died, closed, closed, Outcome(0)]) == 0
    err = capsys.readouterr().err
    assert err.count("joining again") == 2 and "restarting (1 of 3, --max-restarts)" in err  # 3 by default with --nnodes
    assert "the same failure" not in err


def test_restarts_default_to_none_on_several_fixed_machines_and_three_elastic(monkeypatch, two_nodes, capsys):
    died = Outcome(1, (1, -9), ((0, 5),), resumes=True)
    starts = iter([died])
    monkeypatch.setattr(launch_cli, "launch_once", lambda cmd, env: next(starts))
    assert main(["launch", "--config-file", str(two_nodes), "-m", "hf_gpu_train.finetune"]) == 1
    assert "restarting" not in capsys.readouterr().err
    assert run_loop(monkeypatch, two_nodes, [died, died], "--max-restarts", "1") == 1
    err = capsys.readouterr().err
    assert "restarting (1 of 1, --max-restarts)" in err and "the same failure as the start before" in err


def test_nodes_with_their_own_config_files_meet_at_one_rendezvous(tmp_path):
    """The documented multi-node setup gives each node its own file (NAME-rank0.yaml, NAME-rank1.yaml): the rendezvous's
    name comes from what their commands share, the address, never the file's name."""
    commands = []
    for rank in (0, 1):
        assert main(["config", "--machine", "cpu-only", "--num-processes", "1", "--num-machines", "2", "--machine-rank",
                     str(rank), "--main-process-ip", "10.0.0.1", "--main-process-port", "29611", "--output",
                     str(tmp_path / f"job-rank{rank}")]) == 0
        commands.append(build_launch(["--config-file", str(tmp_path / f"job-rank{rank}.yaml"), "-m", "x"], environ={},
                                     nodes=NodeRange(1, 2)).cmd)
    assert option(commands[0], "--rdzv-id") == option(commands[1], "--rdzv-id") == "hf-gpu-train-10.0.0.1-29611"
    assert [option(c, "--rdzv-conf").endswith(f"is_host={h}") for c, h in zip(commands, "10")] == [True, True]


@pytest.mark.parametrize(("argv", "message"), [
    (["--rdzv_conf", "join_timeout:900"], "--rdzv_conf join_timeout:900: 'join_timeout:900' is not key=value"),
    (["--no_python"], "-m and --no_python together"),
    (["--rdzv_conf", "join_timeout=ten"], "--rdzv_conf join_timeout=ten: seconds, a number"),
])
def test_launch_options_the_elastic_launch_cannot_read_are_usage_errors(two_nodes, argv, message):
    with pytest.raises(UsageError, match=message):
        build_launch([*argv, "--config-file", str(two_nodes), "-m", "x"], environ={}, nodes=NodeRange(1, 2))


@pytest.mark.parametrize(("section", "message"), [
    ("dynamo_config:\n  dynamo_backend: INDUCTOR\n", "dynamo_backend INDUCTOR with --nnodes 1:2"),
    ("fp8_config:\n  backend: TE\n", "fp8_config with --nnodes 1:2"),
    ("distributed_type: XLA\n", "distributed_type XLA with --nnodes 1:2"),
])
def test_config_sections_the_elastic_launch_would_drop_are_refused(two_nodes, section, message):
    text = two_nodes.read_text().replace("distributed_type: MULTI_GPU\n", "") if "distributed_type" in section else two_nodes.read_text()
    two_nodes.write_text(text + section)
    with pytest.raises(UsageError, match=message):
        build_launch(["--config-file", str(two_nodes), "-m", "x"], environ={}, nodes=NodeRange(1, 2))


def test_nnodes_without_a_value_says_so():
    with pytest.raises(UsageError, match="--nnodes needs a value: MIN:MAX"):
        take_nnodes(["--nnodes"])


FAKE_TORCHRUN = """import json, os, sys
if os.environ.get("PREEMPTED_THEN_DONE"):  # torchelastic stopped the processes to take in a node; they saved, then finished
    open(os.path.join(os.environ["HF_GPU_TRAIN_PROGRESS_DIR"], "preempted-0.json"), "w").write(json.dumps({"step": 3}))
    sys.exit(0)
sys.stderr.write("torch.distributed.elastic.rendezvous.api.RendezvousClosedError\\n")
sys.exit(1)
"""


def test_the_launcher_reads_a_closed_rendezvous_and_an_exit_0_after_a_save_for_torchelastic(tmp_path):
    from hf_gpu_train.launch.rank_report import PROGRESS_DIR_ENV

    script = tmp_path / "fake_torchrun.py"
    script.write_text(FAKE_TORCHRUN)
    assert PROGRESS_DIR_ENV == "HF_GPU_TRAIN_PROGRESS_DIR"
    closed = launch_cli.launch_once([sys.executable, str(script)], {"PATH": "/usr/bin:/bin"})
    assert closed.code == 1 and closed.rendezvous_closed
    done = launch_cli.launch_once([sys.executable, str(script)], {"PATH": "/usr/bin:/bin", "PREEMPTED_THEN_DONE": "1"})
    assert done.code == 0 and not done.preempted and not done.rendezvous_closed


def test_a_rendezvous_closed_past_the_join_timeout_is_said_and_not_restarted(monkeypatch, two_nodes, capsys):
    closed = Outcome(1, rendezvous_closed=True)
    assert run_loop(monkeypatch, two_nodes, [closed, closed], "--rdzv_conf", "join_timeout=0") == 1
    err = capsys.readouterr().err
    assert "the rendezvous stayed closed for 0 s (join_timeout)" in err and "restarting" not in err
