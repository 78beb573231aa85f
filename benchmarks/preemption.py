"""Preemption (issue 30): a stop signal at a step between checkpoints, during an evaluation and during a save, on 2
processes. For each: the steps lost (goal <= 1), the seconds from the signal to every process gone (goal < the
grace: 30 s, SLURM's KillWait and Kubernetes' default), the exit code, and the weights after the same command again
(SLURM: the requeued job) against the uninterrupted run (goal: equal within 1e-6).

The run: the default fine-tune (MiniLM-L6, the built-in text set), 40 steps, a checkpoint every 10, an evaluation
every 7 where the evaluation case needs one; the signal comes from tests/faults/signal_probe.py.

1. ``local``: 2 gloo processes under ``hf-gpu-train launch``; SIGTERM to the launcher only (what Kubernetes does: PID 1)
   in the middle of step 15; then, side by side, the same with ``preemption=false`` (what the Trainer and accelerate
   do with a signal: nothing); then SIGUSR1 during the evaluation at step 14, and during the save of step 20.
2. ``cost``: what handling the signals costs when none comes: the default fine-tune as shipped (preemption on: the
   ranks agree on the control flags at every step) against ``preemption=false``, alternating launches, steps/s.
3. ``slurm`` (where tests/slurm_cluster.py can start a real cluster: Debian's slurm-wlm and munge, root): the
   generated 2-node sbatch; at step 15 the job gets ``scancel --signal=TERM --full`` (every process of the job, as
   at a time limit); the job requeues itself and the requeued job ends the run.

    python benchmarks/preemption.py [--only local|cost|slurm] [--steps 40] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from gloo_launch import ROOT, cpu_config, launch

sys.path.insert(0, str(ROOT))

from hf_gpu_train.faults.checkpoint_marker import complete_checkpoints  # noqa: E402

SCRIPT = str(ROOT / "scripts" / "finetune.py")
PROBE = str(ROOT / "tests" / "faults" / "signal_probe.py")
GRACE_S = 30.0


def default_run(steps: int) -> list[str]:
    return [f"max_steps={steps}", "save_strategy=steps", "save_steps=10", "eval_strategy=no", "telemetry=false",
            "per_device_train_batch_size=16", "max_length=64", "logging_steps=10"]


def weights_diff(out: Path, reference: Path) -> str:
    from safetensors.torch import load_file

    if not (out / "model.safetensors").is_file():
        return "no final model"
    x, y = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    worst = max(float((x[k].float() - y[k].float()).abs().max()) for k in y)
    return f"max |diff| {worst:.3g} ({'equal' if x.keys() == y.keys() and worst <= 1e-6 else 'NOT equal'} within 1e-6)"


def resumed_from(out: Path, stdout: str) -> int:
    """The step the rerun resumed from (0: from the start)."""
    for line in stdout.splitlines():
        if "resuming from" in line:
            return int(line.rsplit("checkpoint-", 1)[1].split()[0].rstrip(")").rstrip(","))
    return 0


def case(config: str, tmp: Path, name: str, reference: Path, run_args: list[str], env: dict) -> None:
    out, stamp = tmp / name, tmp / f"{name}.stamp"
    args = [*run_args, f"output_dir={out}"]
    stopped = launch(config, PROBE, *args, env={**env, "SIGNAL_STAMP": str(stamp)})
    gone = time.time()
    sent = json.loads(stamp.read_text())
    kept = [c.name for c in complete_checkpoints(out)]
    again = launch(config, SCRIPT, *args)
    start = resumed_from(out, again.stdout)
    lost = max(0, sent["finished_step"] - start)
    print(f"   {name}: exit {stopped.returncode}; signal to every process gone {gone - sent['time']:.1f} s "
          f"(goal < {GRACE_S:.0f} s); last step finished at the signal {sent['finished_step']}, complete checkpoints "
          f"{kept}; the same command: exit {again.returncode}, resumed from step {start}, steps lost {lost} (goal <= 1); "
          f"weights vs uninterrupted: {weights_diff(out, reference)}")


def local(tmp: Path, steps: int) -> None:
    config = cpu_config(tmp)
    run_args = default_run(steps)
    reference = tmp / "uninterrupted"
    whole = launch(config, SCRIPT, *run_args, f"output_dir={reference}")
    assert whole.returncode == 0, whole.stderr[-2000:]
    print(f"1. local: the default fine-tune, 2 gloo processes, {steps} steps, a checkpoint every 10")
    term = {"SIGNALS": "TERM:launcher:accumulation:15", "SIGNAL_RANK": "0"}
    case(config, tmp, "SIGTERM to the launcher in step 15 (as shipped)", reference, run_args, term)
    case(config, tmp, "the same with preemption=false (the Trainer's own handling)", reference, [*run_args, "preemption=false"], term)
    evaluated = [*run_args, "eval_strategy=steps", "eval_steps=7"]
    reference_eval = tmp / "uninterrupted-eval"
    assert launch(config, SCRIPT, *evaluated, f"output_dir={reference_eval}").returncode == 0
    case(config, tmp, "SIGUSR1 to rank 1 during the evaluation at step 14", reference_eval, evaluated,
         {"SIGNALS": "USR1:self:evaluation:14", "SIGNAL_RANK": "1"})
    case(config, tmp, "SIGTERM to the launcher during the save of step 20", reference, run_args,
         {"SIGNALS": "TERM:launcher:save:20", "SIGNAL_RANK": "0"})


def cost(tmp: Path, rounds: int, steps: int) -> None:
    import statistics

    config = cpu_config(tmp)
    arms = {"off": "preemption=false", "on": "preemption=true"}
    found: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds):
        for arm in (("off", "on") if r % 2 == 0 else ("on", "off")):
            folder = tmp / f"cost{r}"
            run = launch(config, str(ROOT / "benchmarks" / "default_finetune_probe.py"), str(folder), arm, str(steps), arms[arm])
            assert run.returncode == 0, run.stderr[-2000:]
            found[arm].append(json.loads((folder / f"{arm}.json").read_text())["steps_per_second"])
    off, on = statistics.median(found["off"]), statistics.median(found["on"])
    print(f"2. cost with no signal: MiniLM-L6, 2 gloo processes, {steps} steps, {rounds} round(s)")
    print(f"   steps/s preemption=false: {[round(x, 3) for x in found['off']]} (median {off:.3f}); as shipped: "
          f"{[round(x, 3) for x in found['on']]} (median {on:.3f}); ratio {on / off:.3f} (goal >= 0.99)")


def slurm_job(cluster, tmp: Path, name: str, run_args: list[str], signals: str | None, timeout: float = 1800) -> dict:
    """The generated 2-node sbatch (one process a node) on the real cluster; with ``signals``, the probe sends them.
    Returns the figures: the seconds from the first signal to the job leaving RUNNING (every process gone), the
    state, restarts, and where the run resumed from."""
    from tests.launch.test_slurm_cluster import submit_environment, two_node_sbatch

    folder = tmp / "".join(c if c.isalnum() else "-" for c in name)[:40]
    folder.mkdir(parents=True)
    out, stamp = folder / "out", folder / "signal.json"
    extra = {"SIGNALS": signals, "SIGNAL_RANK": "0", "SIGNAL_STAMP": str(stamp)} if signals else {}
    env, options = submit_environment(cluster, **extra)
    script = two_node_sbatch(folder, PROBE if signals else SCRIPT)
    job = cluster.sbatch(script, *run_args, f"output_dir={out}", cwd=folder, env=env, options=options)
    figures: dict = {"out": out, "gone_s": None}
    if signals:
        deadline = time.monotonic() + timeout
        while not stamp.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.wait(job, timeout, states={"PENDING", "REQUEUED", "REQUEUE_HOLD", "COMPLETED", "FAILED", "CANCELLED"},
                     poll_s=0.1)
        figures["gone_s"] = time.time() - json.loads(stamp.read_text())["time"]
        figures["finished_at_signal"] = json.loads(stamp.read_text())["finished_step"]
    state, code = cluster.wait(job, timeout)
    info, output = cluster.job_info(job), cluster.output(job, tail=2_000_000)
    resumed = [int(line.rsplit("checkpoint-", 1)[1].split()[0].rstrip(",;)")) for line in output.splitlines()
               if "resuming from" in line and "checkpoint-" in line]
    figures.update(state=state, code=code, restarts=int(info.get("Restarts", 0)), resumed=resumed, job=job, script=script,
                   env=env, options=options, output=output)
    return figures


def slurm(tmp: Path, steps: int) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.slurm_cluster import _ensure_hosts, reap_leftovers, start_cluster, why_not_available

    print(f"3. slurm: the generated 2-node sbatch (one process a node) on a real cluster (slurmctld + 2 slurmd on this "
          f"machine), the default fine-tune, {steps} steps, a checkpoint every 10, the signal in step 15")
    reason = why_not_available() or _ensure_hosts()
    if reason:
        print(f"   skipped: {reason}")
        return
    reap_leftovers()
    (tmp / "slurm").mkdir()
    cluster = start_cluster(tmp / "slurm")
    try:
        run_args = default_run(steps)
        reference = slurm_job(cluster, tmp, "uninterrupted", run_args, None)
        assert reference["state"] == "COMPLETED", reference["output"][-3000:]
        cases = {"TERM to the job steps (what preemption sends at the start of GraceTime)": "TERM:steps:accumulation:15",
                 "USR1 to the batch shell (#SBATCH --signal=B:USR1@N before a time limit)": "USR1:batch:accumulation:15",
                 "TERM to every process, srun included (scancel --full; a time limit)": "TERM:job:accumulation:15"}
        for name, signals in cases.items():
            job = slurm_job(cluster, tmp, name, run_args, signals)
            again = ""
            if job["restarts"] == 0 and job["state"] != "COMPLETED":  # not requeued: the user submits it again
                rerun = cluster.sbatch(job["script"], *run_args, f"output_dir={job['out']}", cwd=job["out"].parent,
                                       env=job["env"], options=job["options"])
                cluster.wait(rerun, 1800)
                output = cluster.output(rerun, tail=2_000_000)
                job["resumed"] = [int(line.rsplit("checkpoint-", 1)[1].split()[0].rstrip(",;)")) for line in output.splitlines()
                                  if "resuming from" in line and "checkpoint-" in line]
                again = "; not requeued (srun SIGKILLed the tasks): the same sbatch submitted again"
            start = job["resumed"][0] if job["resumed"] else 0
            print(f"   {name}: signal to every process gone {job['gone_s']:.1f} s (goal < {GRACE_S:.0f} s); requeued "
                  f"{job['restarts']} time(s){again}; resumed from step {start}, steps lost "
                  f"{max(0, job['finished_at_signal'] - start)} (goal <= 1); final state {job['state']}; weights vs "
                  f"uninterrupted: {weights_diff(job['out'], reference['out'])}")
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["local", "cost", "slurm"])
    parser.add_argument("--steps", type=int, default=40, help="local and cost; the slurm jobs run 30")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="preemption_") as folder:
        if args.only in (None, "local"):
            local(Path(folder), args.steps)
        if args.only in (None, "cost"):
            cost(Path(folder), args.rounds, args.steps)
        if args.only in (None, "slurm"):
            slurm(Path(folder), 30)


if __name__ == "__main__":
    main()
