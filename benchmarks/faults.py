"""Faults across ranks (issue 18), 2 gloo processes on the CPU. For each fault: seconds from the fault to the end of
every process, whether the culprit was named, and (where the run can go on) whether the same command again ends with
the weights of an uninterrupted run. Goal: every fault ends within 60 s, named, nothing lost, an exact restart.

1. A rank dies: the default fine-tune (MiniLM, the built-in text set, 40 steps, a checkpoint every 10), rank 1
   SIGKILLed at step 15 (tests/finetune/kill_probe.py), then the same command again.
2. A rank stalls: tests/faults/hang_probe.py (rank 1 asleep in its collate function, then inside a collective
   rank 0 never enters, a 4 s limit). Without the watchdog both would wait out the collective timeout (1800 s).
3. A rank enters an evaluation alone (hang_probe.py "alone": rank 0 calls trainer.evaluate() at step 4).
4. A rank cannot join (benchmarks/preflight_probe.py: rank 1 on a port nobody listens on).
5. The disk fills up while the second checkpoint is written (the default fine-tune into a 400 MiB tmpfs; skipped
   where this process cannot mount one), then the same command again with space.
6. What the watchdog and the preflight cost when nothing fails: the default fine-tune with both on (as shipped)
   against ``watchdog=off`` and ``HF_GPU_TRAIN_PREFLIGHT_TIMEOUT=0``, alternating launches, steps/s from the run
   summaries. Goal >= 0.99.

    python benchmarks/faults.py [--rounds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gloo_launch import ROOT, cpu_config, launch

ARMS = {"off": "watchdog=off", "watchdog": "watchdog=auto"}
ARM_ENV = {"off": {"HF_GPU_TRAIN_PREFLIGHT_TIMEOUT": "0"}, "watchdog": {}}
SCRIPT = str(ROOT / "scripts" / "finetune.py")
DEFAULT_RUN = ["max_steps=40", "save_strategy=steps", "save_steps=10", "eval_strategy=no", "telemetry=false",
               "per_device_train_batch_size=16", "max_length=64", "logging_steps=10"]


def same_weights(a: Path, b: Path) -> str:
    from safetensors.torch import load_file

    if not (a / "model.safetensors").is_file():
        return "no final model"
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    worst = max(float((x[k].float() - y[k].float()).abs().max()) for k in y)
    return f"{'yes' if x.keys() == y.keys() and worst == 0.0 else 'no'} (max |diff| {worst:.3g})"


def last_line(stderr: str, starts: str) -> str:
    return next((line for line in reversed(stderr.splitlines()) if line.startswith(starts)), "(none)")[:160]


def uninterrupted(config: str, tmp: str) -> Path:
    out = Path(tmp) / "uninterrupted"
    run = launch(config, SCRIPT, *DEFAULT_RUN, f"output_dir={out}")
    assert run.returncode == 0, run.stderr[-2000:]
    return out


def dies(config: str, tmp: str, reference: Path) -> None:
    out, stamp = Path(tmp) / "killed", Path(tmp) / "kill-time"
    # the launch that ends and says so (benchmarks/resilience.py: the restart hf-gpu-train launch makes by default)
    run = launch(config, "--max-restarts", "0", str(ROOT / "tests" / "finetune" / "kill_probe.py"), *DEFAULT_RUN, f"output_dir={out}",
                 env={"KILL_RANK": "1", "KILL_AT_STEP": "15", "KILL_STAMP": str(stamp)})
    ended = time.time() - float(stamp.read_text())
    again = launch(config, SCRIPT, *DEFAULT_RUN, f"output_dir={out}")
    print("1. rank 1 SIGKILLed at step 15 of the default fine-tune")
    print(f"   exit {run.returncode}, kill to the end of every process {ended:.1f} s; "
          f"{last_line(run.stderr, 'hf-gpu-train launch:')}")
    print(f"   the same command again: exit {again.returncode}, "
          f"{'resumed' if 'resuming from' in again.stdout else 'did not resume'}; "
          f"same weights as the uninterrupted run: {same_weights(out, reference)}")


def cost(config: str, tmp: str, rounds: int, steps: int) -> None:
    results: dict[str, list[float]] = {"off": [], "watchdog": []}
    for r in range(rounds):
        for mode in (("off", "watchdog") if r % 2 == 0 else ("watchdog", "off")):
            round_dir = Path(tmp) / f"round{r}"
            run = launch(config, str(ROOT / "benchmarks" / "default_finetune_probe.py"), str(round_dir), mode, str(steps),
                         ARMS[mode], env=ARM_ENV[mode])
            assert run.returncode == 0, run.stderr[-2000:]
            results[mode].append(json.loads((round_dir / f"{mode}.json").read_text())["steps_per_second"])
    off, on = statistics.median(results["off"]), statistics.median(results["watchdog"])
    print(f"6. no fault, MiniLM-L6, 2 gloo processes, {steps} steps, {rounds} round(s)")
    print(f"   steps/s watchdog and preflight off: {[round(x, 3) for x in results['off']]} (median {off:.3f})")
    print(f"   steps/s both on (as shipped):      {[round(x, 3) for x in results['watchdog']]} (median {on:.3f})")
    print(f"   ratio (on / off): {on / off:.3f}; per round "
          f"{[round(a / b, 3) for a, b in zip(results['watchdog'], results['off'])]} (goal >= 0.99)")


def stalls(config: str, tmp: str) -> None:
    print("2. a stall on rank 1 (limit 4 s): seconds from the stall to the end of every process")
    for mode in ("collate", "collective"):
        out = Path(tmp) / f"stall-{mode}"
        start = time.monotonic()
        run = launch(config, str(ROOT / "tests" / "faults" / "hang_probe.py"), str(out), mode)
        ended = time.monotonic() - start
        folders = list(out.glob("hang-*"))
        report = json.loads((folders[0] / "summary.json").read_text()) if folders else {}
        stalled_for = max((s or {}).get("stalled_s", 0) for s in report.get("ranks", {}).values()) if report else None
        print(f"   {mode:10s}: exit {run.returncode}, launch to end {ended:.1f} s, stall to dump {stalled_for} s, "
              f"culprit named: {report.get('behind') == [1]}, stacks: {sorted(p.name for p in folders[0].iterdir()) if folders else None}")


def alone(config: str, tmp: str) -> None:
    out = Path(tmp) / "alone"
    start = time.monotonic()
    run = launch(config, str(ROOT / "tests" / "faults" / "hang_probe.py"), str(out), "alone")
    ended = time.monotonic() - start
    mismatch = next((line for line in run.stderr.splitlines() if "RankMismatch:" in line), "(none)")
    print("3. rank 0 calls trainer.evaluate() alone at step 4 (rank 1 alone asked for a save and an evaluation at step 2)")
    print(f"   exit {run.returncode}, launch to end {ended:.1f} s (the launch itself takes ~15 s here); both ranks saved "
          f"and evaluated at step 2: {(out / 'checkpoint-2' / 'rng_state_1.pth').is_file()}; "
          f"culprit named: {'rank 1' in mismatch}")
    print(f"   {mismatch.split('RankMismatch: ')[-1][:150]}")


def cannot_join(config: str) -> None:
    start = time.monotonic()
    run = launch(config, str(ROOT / "benchmarks" / "preflight_probe.py"), env={"HF_GPU_TRAIN_PREFLIGHT_TIMEOUT": "10"})
    ended = time.monotonic() - start
    named = last_line(run.stderr, "preflight_probe: error:")
    print("4. rank 1 cannot reach the rendezvous (a port nobody listens on), preflight timeout 10 s")
    print(f"   exit {run.returncode}, launch to end {ended:.1f} s; culprit named: {'rank 1' in named}; {named[:150]}")


def disk_fills(config: str, tmp: str, reference: Path) -> None:
    disk = Path(tmp) / "small-disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m", "tmpfs", str(disk)], capture_output=True, text=True)
    print("5. the disk fills up while the second checkpoint is written (400 MiB tmpfs; a checkpoint is ~270 MiB)")
    if mounted.returncode != 0:
        print(f"   skipped: cannot mount a tmpfs here ({mounted.stderr.strip()})")
        return
    try:
        out = disk / "run"
        start = time.monotonic()
        run = launch(config, SCRIPT, *DEFAULT_RUN, f"output_dir={out}")
        ended = time.monotonic() - start
        kept = sorted(p.name for p in out.glob("checkpoint-*"))
        print(f"   exit {run.returncode}, launch to end {ended:.1f} s; kept {kept} and the config: "
              f"{(out / 'finetune_config.yaml').is_file()}")
        print(f"   {last_line(run.stderr, 'finetune: error:')[:300]}")
        subprocess.run(["mount", "-o", "remount,size=1500m", str(disk)], check=True)
        again = launch(config, SCRIPT, *DEFAULT_RUN, f"output_dir={out}")
        print(f"   with space, the same command again: exit {again.returncode}, "
              f"{'resumed' if 'resuming from' in again.stdout else 'did not resume'}; "
              f"same weights as the uninterrupted run: {same_weights(out, reference)}")
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = cpu_config(tmp)
        reference = uninterrupted(config, tmp)
        dies(config, tmp, reference)
        stalls(config, tmp)
        alone(config, tmp)
        cannot_join(config)
        disk_fills(config, tmp, reference)
        cost(config, tmp, args.rounds, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
