"""`hf-gpu-train launch`: accelerate's flags through, the .env and the plan in, the user's own variables kept."""

import sys
from dataclasses import replace

import pytest

from hf_gpu_train.cli import main
from hf_gpu_train.cli.launch import build_launch
from hf_gpu_train.errors import UsageError
from hf_gpu_train.hardware.snapshot import load_machine, save

ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


@pytest.fixture
def cpu(tmp_path):
    assert main(["config", "--machine", "cpu-only", "--num-processes", "1", "--output", str(tmp_path / "cpu")]) == 0
    script = tmp_path / "train.py"
    script.write_text("")
    return tmp_path / "cpu.yaml", script


def test_accelerate_options_pass_through_and_the_scripts_arguments_stay_the_scripts(cpu):
    cfg, script = cpu
    launch = build_launch(["--num_processes", "2", "--config-file", str(cfg), "--main_process_port=29999", "--same_network",
                           str(script), "--config", "recipe.yaml", "--num_processes", "9"], environ={})
    assert launch.cmd == [*ACCELERATE, "--config_file", str(cfg), "--num_processes", "2", "--main_process_port", "29999",
                          "--same_network", str(script), "--config", "recipe.yaml", "--num_processes", "9"]
    assert launch.env == {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "2", "HF_GPU_TRAIN_PLAN": str(cfg.with_suffix(".plan.json"))}
    assert launch.notes == ("--num_processes 2 overrides cpu.yaml's num_processes: 1",) and launch.cpus is None


def test_your_exported_variables_win_over_the_env_file_and_are_named(cpu):
    cfg, script = cpu
    launch = build_launch(["--config_file", str(cfg), str(script)], environ={"OMP_NUM_THREADS": "1", "PATH": "/bin"})
    assert launch.env["OMP_NUM_THREADS"] == "1" and launch.env["PATH"] == "/bin" and launch.env["ACCELERATE_USE_CPU"] == "1"
    assert launch.notes == ("keeping OMP_NUM_THREADS=1 from your environment over cpu.env's 2",)


def test_a_process_count_other_than_planned_says_what_happens_to_the_batch(tmp_path, cpu):
    _, script = cpu
    assert main(["config", "--machine", "2x-rtx4090", "--params", "1.1e8", "--global-batch", "64", "--output", str(tmp_path / "g")]) == 0
    launch = build_launch(["--num_processes", "1", "--config-file", str(tmp_path / "g.yaml"), str(script)], environ={},
                          here=load_machine("2x-rtx4090"))
    assert launch.notes == ("--num_processes 1 overrides g.yaml's num_processes: 2",
                            "the plan's micro-batch 32 was planned for 2 process(es): the run keeps it, works the accumulation "
                            "out again for the requested global batch 64, and checks the memory for the processes that run")


def test_the_taskset_binding_is_applied_by_the_launcher(tmp_path, cpu, monkeypatch):
    _, script = cpu
    dgx1 = load_machine("8x-v100-dgx1")
    busy = replace(dgx1, gpus=(replace(dgx1.gpus[0], memory_used_bytes=20 * 2**30), *dgx1.gpus[1:]))
    assert main(["config", "--machine", str(save(busy, tmp_path / "dgx1.json")), "--gpus", "4", "--output", str(tmp_path / "d")]) == 0
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(80)))
    launch = build_launch(["--config-file", str(tmp_path / "d.yaml"), str(script)], environ={}, here=busy)
    assert launch.cpus == frozenset([*range(20, 40), *range(60, 80)])
    moved = build_launch(["--gpu_ids", "0,1,2,3", "--config-file", str(tmp_path / "d.yaml"), str(script)], environ={}, here=busy)
    assert moved.cpus is None and moved.notes[-1] == "CPU binding not applied: --gpu_ids 0,1,2,3 is not the planned 4,5,6,7"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    elsewhere = build_launch(["--config-file", str(tmp_path / "d.yaml"), str(script)], environ={}, here=busy)
    assert elsewhere.cpus is None and elsewhere.notes[-1].startswith("CPU binding not applied: the plan's CPUs 20-39,60-79 are not")


def test_an_older_config_without_its_plan_is_launched_with_a_note(cpu):
    cfg, script = cpu
    cfg.with_suffix(".plan.json").unlink()
    launch = build_launch(["--config-file", str(cfg), str(script)], environ={})
    assert "HF_GPU_TRAIN_PLAN" not in launch.env and launch.env["ACCELERATE_USE_CPU"] == "1"
    assert launch.notes[0].startswith("no cpu.plan.json beside cpu.yaml: the run decides batch, accumulation and checkpointing "
                                      "itself; regenerate with `hf-gpu-train config --output ")


@pytest.mark.parametrize("argv, message", [
    (["train.py"], "--config-file FILE is required"),
    (["--config-file", "nowhere.yaml", "train.py"], "--config-file nowhere.yaml does not exist"),
    (["--config-file", "CFG"], "no training script after the options"),
    (["--config-file", "CFG", "missing.py"], "training script missing.py does not exist"),
])
def test_usage_errors(cpu, argv, message):
    cfg, _ = cpu
    with pytest.raises(UsageError, match=message):
        build_launch([str(cfg) if a == "CFG" else a for a in argv], environ={})


def test_help_and_errors_through_the_cli(cpu, capsys):
    assert main(["launch", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: hf-gpu-train launch [--max-restarts N] [--nnodes MIN:MAX] [ACCELERATE_LAUNCH_OPTIONS] --config-file")
    assert main(["launch", "--num_processes", "2", "train.py"]) == 2
    assert "--config-file FILE is required" in capsys.readouterr().err


def test_config_launch_and_the_run_plan_api_never_import_torch(tmp_path):
    import subprocess

    code = (
        "import sys\n"
        "from hf_gpu_train.cli import main\n"
        "from hf_gpu_train.cli.launch import build_launch\n"
        "import hf_gpu_train.plan.run_plan as api\n"
        f"assert main(['config', '--machine', '8x-h100-sxm', '--params', '7e9', '--output', {str(tmp_path / 'h')!r}]) == 0\n"
        f"launch = build_launch(['--num_processes', '4', '--config-file', {str(tmp_path / 'h.yaml')!r}, {__file__!r}], environ={{}})\n"
        "assert any('made for another machine' in note for note in launch.notes), launch.notes\n"
        "plan = api.read_run_plan(launch.env['HF_GPU_TRAIN_PLAN'], 'test', {'WORLD_SIZE': '4'})\n"
        "values, _ = api.resolve_with_plan(plan, {'per_device_train_batch_size': 8}, set())\n"
        "api.check_memory(plan, values)\n"
        "leaked = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'accelerate', 'transformers'))\n"
        "assert not leaked, leaked\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_worker_usage_error_ends_the_launch_with_its_line_and_exit_2(capfd):
    import sys

    from hf_gpu_train.cli.launch import run_reporting_usage_errors

    worker = ("import os, sys\n"
              "print('finetune: error: learning_rate=-1: must be positive', file=sys.stderr, flush=True)\n"
              "open(os.environ['HF_GPU_TRAIN_USAGE_ERROR_FILE'], 'a').write('finetune: error: learning_rate=-1: must be positive\\n')\n"
              "print('Traceback (most recent call last):\\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError', "
              "file=sys.stderr, flush=True)\n"
              "sys.exit(1)\n")
    assert run_reporting_usage_errors([sys.executable, "-c", worker], {}) == 2
    err = capfd.readouterr().err
    assert err.count("learning_rate=-1: must be positive") == 1
    assert "ChildFailedError" not in err and "Traceback" not in err and "exit 2" in err
    assert run_reporting_usage_errors([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"], {}) == 3
    assert "boom" in capfd.readouterr().err  # any other failure passes through as it is


def test_the_usage_line_is_shown_once_when_the_marker_is_seen_before_the_line(capfd):
    """The worker writes the marker and prints the line; when the launcher reads the line after the marker exists (a
    race CI met), the line is dropped as another rank's copy: it must still be shown once."""
    import sys

    from hf_gpu_train.cli.launch import run_reporting_usage_errors

    worker = ("import os, sys\n"
              "open(os.environ['HF_GPU_TRAIN_USAGE_ERROR_FILE'], 'a').write('finetune: error: learning_rate=-1: must be positive\\n')\n"
              "print('finetune: error: learning_rate=-1: must be positive', file=sys.stderr, flush=True)\n"
              "sys.exit(2)\n")
    assert run_reporting_usage_errors([sys.executable, "-c", worker], {}) == 2
    assert capfd.readouterr().err.count("learning_rate=-1: must be positive") == 1


def test_after_a_usage_error_other_ranks_tracebacks_still_reach_stderr(capfd):
    """Rank 0 stops on a usage error; rank 1 then fails for a reason of its own: its traceback is the user's to read.
    Only the usage line's copies from other ranks and the launcher's own report of the failed worker are dropped."""
    from hf_gpu_train.cli.launch import run_reporting_usage_errors

    usage = "finetune: error: learning_rate=-1: must be positive"
    worker = ("import os, sys, time\n"
              f"print({usage!r}, file=sys.stderr, flush=True)\n"
              f"open(os.environ['HF_GPU_TRAIN_USAGE_ERROR_FILE'], 'a').write({usage!r} + '\\n')\n"
              "time.sleep(0.2)\n"
              f"print({usage!r}, file=sys.stderr, flush=True)\n"  # rank 1 stopping on the same line
              "print('[rank1]: Traceback (most recent call last):\\n[rank1]:   File \"train.py\", line 9, in <module>\\n"
              "[rank1]: RuntimeError: rank 1 ran out of disk', file=sys.stderr, flush=True)\n"
              "print('Traceback (most recent call last):\\n  File \"other.py\", line 3, in <module>\\n    step()\\n"
              "ValueError: rank 1 saw a NaN', file=sys.stderr, flush=True)\n"
              "print('W0101 12:00:00.000000 1 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 7 closing "
              "signal SIGTERM', file=sys.stderr, flush=True)\n"
              "print('Traceback (most recent call last):\\n  File \"/x/bin/torchrun\", line 8, in <module>\\n    sys.exit(main())\\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \\n' + '=' * 60 + '\\ntrain.py FAILED\\n' + "
              "'-' * 60 + '\\nFailures:\\n  <NO_OTHER_FAILURES>\\n' + '-' * 60 + '\\nRoot Cause (first observed failure):\\n[0]:\\n"
              "  rank      : 0 (local_rank: 0)\\n  exitcode  : 2 (pid: 5)\\n' + '=' * 60, file=sys.stderr, flush=True)\n"
              "print('after the report', file=sys.stderr, flush=True)\n"
              "sys.exit(1)\n")
    assert run_reporting_usage_errors([sys.executable, "-c", worker], {}) == 2
    err = capfd.readouterr().err
    assert err.count(usage) == 1  # one line, however many ranks stopped on it
    assert "[rank1]: RuntimeError: rank 1 ran out of disk" in err and '[rank1]:   File "train.py", line 9' in err
    assert 'Traceback (most recent call last):\n  File "other.py", line 3, in <module>\n    step()\nValueError: rank 1 saw a NaN\n' in err
    assert "after the report" in err
    assert "ChildFailedError" not in err and "FAILED" not in err and "Root Cause" not in err and "closing signal" not in err
    assert err.rstrip().endswith("exit 2)")


def test_a_config_file_that_is_not_a_mapping_is_a_usage_error(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "box.yaml"
    bad.write_text("- just\n- a list\n")
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    run = subprocess.run([sys.executable, "-m", "hf_gpu_train", "launch", "--config-file", str(bad), str(script)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "not an accelerate config" in run.stderr and "Traceback" not in run.stderr


def test_gpu_ids_against_a_config_that_pins_cpus_is_refused(tmp_path):
    import subprocess
    import sys

    made = subprocess.run([sys.executable, "-m", "hf_gpu_train", "config", "--machine", "8x-h100-sxm", "--output", str(tmp_path / "box")],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert "enable_cpu_affinity: true" in (tmp_path / "box.yaml").read_text()  # 8 GPUs over two sockets, 0..7: pinned
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    run = subprocess.run([sys.executable, "-m", "hf_gpu_train", "launch", "--gpu_ids", "4,5", "--config-file", str(tmp_path / "box.yaml"),
                          str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "wrong socket" in run.stderr and "--gpu-ids 4,5" in run.stderr
