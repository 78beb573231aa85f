"""The generated sbatch, run by bash as SLURM runs it (a stand-in srun that runs the task with SLURM_NODEID=1, a
stand-in hf-gpu-train that records its arguments): every node's task gets exactly the launch the plan means, from a
folder whose name holds spaces, quotes and parentheses, with arguments that hold spaces; and the exit code that
says "preempted" makes the script requeue the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_gpu_train.errors import UsageError
from hf_gpu_train.launch.render import render_yaml
from hf_gpu_train.launch.slurm import render_sbatch
from hf_gpu_train.plan.planner import PlanOptions, make_plan
from hf_gpu_train.plan.run_plan_file import env_path_for
from tests.launching import executable

RECORDER = """#!{python}
import json, os, sys
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "node": os.environ.get("SLURM_NODEID")}}) + "\\n")
if os.environ.get("VERDICTS") and len(open(os.environ["RECORD"]).readlines()) > 1:  # started again: trains to the end
    raise SystemExit(0)
for verdict in filter(None, os.environ.get("VERDICTS", "").split(",")):  # NODE.restart / NODE.stop, as launchers leave
    open(os.path.join(os.environ["HF_GPU_TRAIN_REQUEUE_DIR"], verdict), "w").write("said")
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


@pytest.fixture
def job(tmp_path, machine):
    folder = tmp_path / "it's a (test) run"
    folder.mkdir()
    plan = make_plan(machine("cpu-only"), PlanOptions(num_machines=2, cpu_processes=1, main_process_ip="n1"))
    config = folder / "job.yaml"
    config.write_text(render_yaml(plan, "test"))
    env_path_for(config).write_text("OMP_NUM_THREADS=1\n")
    script = folder / "job.sbatch"
    script.write_text(render_sbatch(plan, config, "train it.py"))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    executable(bindir / "srun", "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nSLURM_NODEID=1 exec \"$@\"\n")
    executable(bindir / "scontrol", "#!/bin/bash\necho \"$@\" >> \"$SCONTROL_RECORD\"\n[ \"$1\" = show ] && printf 'n1\\nn2\\n'\nexit 0\n")
    # the nodes' states as sinfo -N -o '%N %T' says them (SINFO_STATES), all usable by default
    executable(bindir / "sinfo", "#!/bin/bash\n"
               # SIGNAL_SHELL_FILE: a stop signal to the batch shell (its pid in that file) while it decides on a restart
               "if [ -n \"${SIGNAL_SHELL_FILE:-}\" ]; then for _ in $(seq 100); do [ -s \"$SIGNAL_SHELL_FILE\" ] && break; "
               "sleep 0.05; done; kill -USR1 \"$(cat \"$SIGNAL_SHELL_FILE\")\"; sleep 0.2; fi\n"
               "printf '%b' \"${SINFO_STATES:-n1 mixed\\nn2 mixed\\n}\"\n")
    executable(bindir / "recorder", RECORDER.format(python=sys.executable))
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "HF_GPU_TRAIN": str(bindir / "recorder"),
           "RECORD": str(tmp_path / "record.jsonl"), "SCONTROL_RECORD": str(tmp_path / "scontrol.txt"),
           "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_SUBMIT_DIR": str(folder)}
    return script, config, env, tmp_path


def run(script: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60)


def test_every_task_gets_the_plans_launch_from_any_folder_and_the_arguments_as_given(job):
    script, config, env, tmp_path = job
    done = run(script, env, "--config", "my recipe.yaml", "extra={adam_epsilon: 1.0e-6}")
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "record.jsonl").read_text())
    assert record["node"] == "1"
    assert record["argv"] == ["launch", "--config-file", str(config), "--max-restarts", "3", "--num_machines", "2",
                              "--num_processes", "2",
                              "--machine_rank", "1", "--main_process_ip", "n1", "--main_process_port", "29500",
                              "--rdzv_backend", "c10d", "--same_network", "train", "it.py", "--config", "my recipe.yaml",
                              "extra={adam_epsilon: 1.0e-6}"]  # --script is words, as in every printed command
    assert not (tmp_path / "scontrol.txt").read_text().startswith("requeue")


def test_exit_75_requeues_the_job_and_any_other_failure_does_not(job):
    script, _, env, tmp_path = job
    preempted = run(script, {**env, "EXIT_WITH": "75"})
    assert preempted.returncode == 75 and "requeueing job 42" in preempted.stdout
    assert "requeue 42" in (tmp_path / "scontrol.txt").read_text()
    (tmp_path / "scontrol.txt").unlink()
    failed = run(script, {**env, "EXIT_WITH": "1"})  # no launcher said whether a restart helps: requeued, up to the limit
    assert failed.returncode == 1 and "requeue 42" in (tmp_path / "scontrol.txt").read_text()
    assert "no node's launcher said whether a restart helps (killed before it could): requeueing job 42" in failed.stdout
    (tmp_path / "scontrol.txt").unlink()
    last = run(script, {**env, "EXIT_WITH": "1", "SLURM_RESTART_COUNT": "3"})
    assert last.returncode == 1 and "requeue" not in (tmp_path / "scontrol.txt").read_text()
    assert "was requeued 3 time(s) (HF_GPU_TRAIN_MAX_RESTARTS): not again" in last.stdout


@pytest.mark.parametrize(("verdicts", "restarted"), [("1.restart", True), ("0.restart,1.stop", False), ("1.stop", False)])
def test_a_failure_starts_again_in_the_job_when_a_node_says_a_restart_helps_and_none_says_no(job, verdicts, restarted):
    """Each node's launcher leaves its restart verdict (launch/restarts.py record_verdict); a usage error, the same
    failure twice or the restarts used up say stop, and one stop keeps the training from starting again."""
    script, _, env, tmp_path = job
    done = run(script, {**env, "EXIT_WITH": "1", "VERDICTS": verdicts})
    assert done.returncode == (0 if restarted else 1), done.stdout + done.stderr
    starts = (tmp_path / "record.jsonl").read_text().splitlines()
    assert len(starts) == (2 if restarted else 1) and json.loads(starts[-1])["argv"] == json.loads(starts[0])["argv"]
    assert ("a rank failed (exit 1): starting again on 2 node(s) of the job (n1,n2)" in done.stdout) == restarted
    assert "requeue" not in (tmp_path / "scontrol.txt").read_text()
    assert not list(tmp_path.rglob(".hf-gpu-train-restarts-42"))  # the verdicts' folder gone with the job


def test_a_node_drained_the_job_goes_on_with_the_nodes_left_or_requeues_below_its_least(job, machine):
    script, config, env, tmp_path = job
    drained = {**env, "EXIT_WITH": "1", "VERDICTS": "0.restart", "SINFO_STATES": "n1 mixed\\nn2 draining\\n"}
    requeued = run(script, drained)  # at least 2 nodes (the default): requeued for SLURM to give two again
    assert requeued.returncode == 1 and "1 of the job's nodes are usable (at least 2 wanted): requeueing job 42" in requeued.stdout
    assert "requeue 42" in (tmp_path / "scontrol.txt").read_text()
    assert list(tmp_path.rglob(".hf-gpu-train-restarts-42"))  # kept for the requeued job's verdicts
    (tmp_path / "record.jsonl").unlink()
    plan = make_plan(machine("cpu-only"), PlanOptions(num_machines=2, cpu_processes=2, main_process_ip="n1"))
    elastic = config.with_name("elastic.sbatch")
    elastic.write_text(render_sbatch(plan, config, "train.py", min_nodes=1))
    assert "#SBATCH --no-kill\n" in elastic.read_text() and "#SBATCH --no-kill" not in script.read_text()
    went_on = run(elastic, {**drained, "SINFO_STATES": "n1 mixed\\nn2 down*\\n"})
    assert went_on.returncode == 0 and "starting again on 1 node(s) of the job (n1)" in went_on.stdout, went_on.stdout
    first, again = (json.loads(line)["argv"] for line in (tmp_path / "record.jsonl").read_text().splitlines())
    assert (first[first.index("--num_machines") + 1], first[first.index("--num_processes") + 1]) == ("2", "4")
    assert (again[again.index("--num_machines") + 1], again[again.index("--num_processes") + 1]) == ("1", "2")
    with pytest.raises(UsageError, match="--min-machines 3: between 1 and --num-machines 2"):
        render_sbatch(plan, config, "train.py", min_nodes=3)


@pytest.mark.parametrize(("states", "nodes"), [("n1 mixed-\\nn2 allocated$\\n", "n1,n2"), ("n1 mixed@\\nn2 idle*\\n", "n1"),
                                              ("n1 drained\\nn2 mixed\\n", "n2"), ("n1 down\\nn2 failing\\n", "")])
def test_the_nodes_a_restart_runs_on_are_those_sinfo_says_are_usable(job, machine, states, nodes):
    """Planned-by-backfill (-), maintenance-reserved ($) or reboot-pending (@) nodes still run the job; not responding
    (*), drained, down or failing ones do not."""
    _, config, env, tmp_path = job
    plan = make_plan(machine("cpu-only"), PlanOptions(num_machines=2, cpu_processes=1, main_process_ip="n1"))
    elastic = config.with_name("elastic.sbatch")
    elastic.write_text(render_sbatch(plan, config, "train.py", min_nodes=1))
    done = run(elastic, {**env, "EXIT_WITH": "1", "VERDICTS": "0.restart", "SINFO_STATES": states})
    if nodes:
        assert done.returncode == 0 and f"node(s) of the job ({nodes})" in done.stdout, done.stdout + done.stderr
    else:
        assert "0 of the job's nodes are usable (at least 1 wanted): requeueing job 42" in done.stdout, done.stdout


def test_a_stop_signal_while_a_restart_is_decided_requeues_instead(job):
    script, _, env, tmp_path = job
    pid_file = tmp_path / "shell.pid"
    shell = subprocess.Popen(["bash", str(script)], env={**env, "EXIT_WITH": "1", "VERDICTS": "0.restart",
                                                          "SIGNAL_SHELL_FILE": str(pid_file)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file.write_text(str(shell.pid))
    out, err = shell.communicate(timeout=60)
    assert "hf-gpu-train: SIGUSR1 at" in out and "and a stop signal came: requeueing job 42" in out, out + err
    assert len((tmp_path / "record.jsonl").read_text().splitlines()) == 1 and "starting again" not in out


def test_a_node_killed_while_it_exits_after_another_nodes_75_still_requeues(job):
    """srun --kill-on-bad-exit kills a node still exiting after another node's 75, and srun then reports 137: the
    launch that ended with 75 left the marker file, and the script requeues on it."""
    script, _, env, tmp_path = job
    marker_writer = tmp_path / "bin" / "recorder"
    marker_writer.write_text(RECORDER.format(python=sys.executable).replace(
        "sys.exit(", "open(os.environ['HF_GPU_TRAIN_PREEMPTED_MARKER'], 'w').write('rank 0 after step 3')\nsys.exit("))
    done = run(script, {**env, "EXIT_WITH": "137"})
    assert done.returncode == 75 and "requeueing job 42" in done.stdout, done.stdout + done.stderr
    assert not list(Path(env["SLURM_SUBMIT_DIR"]).glob(".hf-gpu-train-preempted-*"))  # gone before the requeued start


def test_usr1_to_the_batch_shell_goes_on_to_srun_and_its_75_requeues(job):
    """What #SBATCH --signal=B:USR1@N does: the shell passes it to srun as USR1, and the exit code it waits for is
    srun's, however the signal interrupted the wait."""
    script, _, env, tmp_path = job
    executable(tmp_path / "bin" / "srun", "#!/bin/bash\ntrap 'exit 75' USR1\nsleep 30 >/dev/null 2>&1 & wait\n")
    shell = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(100):  # until the script has started srun
        if any("srun" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
               for pid in children(shell.pid)):
            break
        time.sleep(0.05)
    os.kill(shell.pid, signal.SIGUSR1)
    out, err = shell.communicate(timeout=30)
    assert shell.returncode == 75 and "hf-gpu-train: SIGUSR1 at" in out and "requeueing job 42" in out, out + err
    assert "requeue 42" in (tmp_path / "scontrol.txt").read_text()


def children(pid: int) -> list[int]:
    from hf_gpu_train.launch.signals import children_of

    return children_of(pid)


def test_a_stop_signal_that_reaches_the_shell_as_srun_exits_75_still_requeues(job):
    """The trap interrupts the wait just as srun ends, and bash no longer knows srun's status (the interrupted wait says
    138): the marker the node's launch left decides (the independent review's stand-in; 10 of 10 runs ended 138,
    unrequeued, before)."""
    script, _, env, tmp_path = job
    # srun lives on through a USR1 (it forwards it to the tasks), and ends with the tasks' 75, whose launch left the marker
    executable(tmp_path / "bin" / "srun", "#!/bin/bash\ntrap true USR1\nsleep 0.3\necho 'rank 0 after step 3' > "
               "\"$HF_GPU_TRAIN_PREEMPTED_MARKER\"\nkill -USR1 $PPID\nexit 75\n")
    done = run(script, env)
    assert done.returncode == 75 and "requeueing job 42" in done.stdout, done.stdout + done.stderr
