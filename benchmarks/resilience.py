"""Resilience (issue 38): what a checkpoint costs the training, and what each way a job ends costs the run.

``saves``: one process, a plain ``transformers.Trainer`` with ``guard_saves`` (what scripts/finetune.py installs), a
BERT-base-sized model (6 layers, hidden 768: ~67 M parameters, random weights, no hub) and AdamW: each checkpoint holds
the weights, the optimizer's two moments, the scheduler and the RNG (~0.8 GB). Side by side in one process, alternating:
the training time each save blocks (the first save's included: it allocates the staging buffers): the Trainer's own
save (no ``guard_saves``), synchronous (``HF_GPU_TRAIN_BACKGROUND_SAVES=0``, the default on a CPU) and background (the
default on a GPU); and the steps/s (from the third step's end to the last) of a run that saves every N steps against one that never
saves. Arms alternate their order from round to round, after a warm-up run in none. The
background write ``fsync``s its files (the synchronous save does not): the comparison favours the synchronous save.

``events``: the default fine-tune (MiniLM-L6, the built-in text set, 40 steps, a checkpoint every 10, background
saves on as on a GPU), 2 gloo processes; each way a job ends, as a row: steps lost, seconds from the event to the
first step of the training again (the next start's first step end, tests/finetune/kill_probe.py's stamp), and the
final weights against the uninterrupted run. Ours (``hf-gpu-train launch``, restarting by itself) against plain
``torchrun --max-restarts 1`` running the same script:

1. rank 1 SIGKILLed after step 15 (checkpoint-10 complete);
2. rank 1 SIGKILLed at the save of step 20, while its background write is in flight;
3. SIGTERM to the launcher after step 15 (a scheduler's stop), then the same command again (the requeued job);
4. a node lost, fewer after: rank 1 SIGKILLed after step 15 with no restart, then the same command on one process.

``fsdp``: the blocked time per save under FSDP (2 gloo processes, MiniLM-L6), synchronous against background.

``nodes``: the launcher SIGKILLed with its processes after step 15, then the same command; and a node lost after step 15
under ``hf-gpu-train launch --nnodes 1:2`` (two launchers of one process each), the other going on alone.

    python benchmarks/resilience.py [--only saves|fsdp|events|nodes] [--rounds 2] [--steps 24] [--save-every 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _trainer(out: Path, steps: int, save_every: int | None, background: bool | None, gpu: bool = False):
    """``background``: None for the Trainer's own save (no ``guard_saves``), else guarded, in the background or not."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from hf_gpu_train.faults.disk_full import guard_saves

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 4096

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randint(1, 30000, (64,), generator=g), "labels": torch.tensor(i % 2)}

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_hidden_layers=6, hidden_size=768, intermediate_size=3072,
                                                     num_attention_heads=12, vocab_size=30522))
    args = TrainingArguments(str(out), max_steps=steps, per_device_train_batch_size=4, report_to="none", use_cpu=not gpu,
                             bf16=gpu,
                             disable_tqdm=True, logging_steps=steps, save_strategy="steps" if save_every else "no",
                             save_steps=save_every or 1, save_total_limit=2)
    trainer = Trainer(model=model, args=args, train_dataset=Rows())
    if background is not None:
        guard_saves(trainer, background=background)
    blocked: list[float] = []
    original = trainer._save_checkpoint

    def timed(*a, **kw):
        start = time.perf_counter()
        result = original(*a, **kw)
        blocked.append(time.perf_counter() - start)
        return result

    trainer._save_checkpoint = timed
    return trainer, blocked


def _step_ends(trainer) -> list[float]:
    """The time of each step's end (steps/s is taken from the third on: the first steps warm the allocator up)."""
    from transformers import TrainerCallback

    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer.add_callback(StepEnds())
    return ends


def _checkpoint_bytes(out: Path) -> int:
    found = sorted(out.glob("checkpoint-*"))
    return sum(p.stat().st_size for p in found[-1].rglob("*") if p.is_file()) if found else 0


def saves(rounds: int, steps: int, save_every: int, gpu: bool = False) -> dict[str, float]:
    """Prints the table; returns the medians (blocked seconds and steps/s per arm, and the ratios)."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    arms = {"never saves": (None, True), "the Trainer's own saves (no guard)": (save_every, None),
            "synchronous saves": (save_every, False), "background saves": (save_every, True)}
    results: dict[str, dict[str, list[float]]] = {name: {"blocked": [], "steps_per_s": [], "write": []} for name in arms}
    size = 0
    warm, _ = _trainer(Path(tempfile.mkdtemp()), 2, None, True, gpu)
    warm.train()  # torch's and the allocator's first steps, in no arm
    for round_index in range(rounds):
        order = list(arms.items())
        for name, (every, background) in (order if round_index % 2 == 0 else order[::-1]):
            with tempfile.TemporaryDirectory() as folder:
                trainer, blocked = _trainer(Path(folder), steps, every, background, gpu)
                ends = _step_ends(trainer)
                trainer.train()
                results[name]["steps_per_s"].append((len(ends) - 2) / (ends[-1] - ends[1]))
                results[name]["blocked"] += blocked
                written = getattr(trainer, "_hf_gpu_train_background_saves", None)
                if background and written is not None:
                    results[name]["write"] += written.write_seconds
                size = max(size, _checkpoint_bytes(Path(folder)))
    sync = statistics.median(results["synchronous saves"]["blocked"])
    never = statistics.median(results["never saves"]["steps_per_s"])
    where = "one GPU, bf16" if gpu else "one process on the CPU"
    print(f"\nsaves: {where}, ~67 M parameters + AdamW, a checkpoint of {size / 2**30:.2f} GiB every {save_every} steps "
          f"of {steps}, {rounds} rounds (medians)")
    print("| arm | training blocked per save | vs synchronous | background write per save | steps/s | vs never saves |")
    print("|---|---|---|---|---|---|")
    medians = {}
    for name, found in results.items():
        blocked = statistics.median(found["blocked"]) if found["blocked"] else None
        write = statistics.median(found["write"]) if found["write"] else None
        rate = statistics.median(found["steps_per_s"])
        medians[name] = {"blocked_s": blocked, "steps_per_s": rate, "write_s": write}
        print(f"| {name} | {'-' if blocked is None else f'{blocked:.2f} s'} | "
              f"{'-' if blocked is None else f'{blocked / sync:.2f}x'} | {'-' if write is None else f'{write:.2f} s'} | "
              f"{rate:.3f} | {rate / never:.2f}x |")
    own = medians["the Trainer's own saves (no guard)"]["blocked_s"]
    print(f"blocked per save: background {medians['background saves']['blocked_s'] / own:.2f}x and synchronous (guarded) "
          f"{sync / own:.2f}x the Trainer's own save's")
    return {"blocked_ratio": medians["background saves"]["blocked_s"] / sync,
            "blocked_vs_trainer": medians["background saves"]["blocked_s"] / own,
            "background_vs_never": medians["background saves"]["steps_per_s"] / never,
            "synchronous_vs_never": medians["synchronous saves"]["steps_per_s"] / never}


SCRIPT = str(ROOT / "scripts" / "finetune.py")
KILL_PROBE = str(ROOT / "tests" / "finetune" / "kill_probe.py")
SIGNAL_PROBE = str(ROOT / "tests" / "faults" / "signal_probe.py")
EVENT_RUN = ["max_steps=40", "save_strategy=steps", "save_steps=10", "eval_strategy=no", "telemetry=false",
             "per_device_train_batch_size=16", "max_length=64", "logging_steps=10", "background_saves=true"]


def _weights_against(out: Path, reference: Path) -> str:
    from safetensors.torch import load_file

    if not (out / "model.safetensors").is_file():
        return "no final model"
    x, y = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    return f"max abs diff {max(float((x[k].float() - y[k].float()).abs().max()) for k in y):.2g}"


def _starts(stamps: Path) -> list[tuple[float, int]]:
    """(time, step) of the first step end of each start (rank 0's stamps, tests/finetune/kill_probe.py)."""
    if not stamps.is_file():
        return []
    return [(float(t), int(step)) for t, step in (line.split() for line in stamps.read_text().splitlines() if line.strip())]


def _lost(stamps: Path, reached: int) -> str:
    """Steps lost: the step reached before the event against the step the next start resumed from."""
    starts = _starts(stamps)
    return str(reached - (starts[-1][1] - 1)) if starts and starts[-1][1] > 1 or len(starts) > 1 else "-"


def _back_to_training(stamps: Path, event_at: float) -> str:
    """Seconds from the event to the first step end of the next start."""
    after = [t for t, _ in _starts(stamps) if t > event_at]
    return f"{min(after) - event_at:.1f} s" if after else "never"


def _run(cmd: list[str], env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def events() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gloo_launch import cpu_config

    tmp = Path(tempfile.mkdtemp(prefix="resilience-"))
    config = cpu_config(tmp)
    ours = [sys.executable, "-m", "hf_gpu_train", "launch", "--config-file", config]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    reference = tmp / "uninterrupted"
    whole = _run([*ours, SCRIPT, *EVENT_RUN, f"output_dir={reference}"], {})
    assert whole.returncode == 0, whole.stderr[-2000:]
    rows = []

    def killed(name: str, launcher: list[str], kill_step: int, **env) -> None:
        out, stamp, steps = tmp / name, tmp / f"{name}.kill", tmp / f"{name}.steps"
        run = _run([*launcher, KILL_PROBE, *EVENT_RUN, f"output_dir={out}"],
                   {"KILL_RANK": "1", "KILL_AT_STEP": str(kill_step), "KILL_ONCE": str(tmp / f"{name}.once"),
                    "KILL_STAMP": str(stamp), "STEP_STAMP": str(steps), **env})
        event_at = float(stamp.read_text()) if stamp.is_file() else 0.0
        rows.append((name, f"exit {run.returncode}", _lost(steps, kill_step) if len(_starts(steps)) > 1 else "-",
                     _back_to_training(steps, event_at), _weights_against(out, reference)))

    killed("rank killed after step 15, ours", ours, 15)
    killed("rank killed after step 15, torchrun --max-restarts 1", torchrun, 15)
    killed("rank killed during the background write of step 20, ours", ours, 20, KILL_DURING_WRITE="1")

    # a scheduler's stop: SIGTERM to the launcher in the middle of step 16; exit 75; the same command again
    out, steps = tmp / "stop", tmp / "stop.steps"
    stopped = _run([*ours, SIGNAL_PROBE, *EVENT_RUN, f"output_dir={out}"],
                   {"SIGNALS": "TERM:launcher:accumulation:16", "SIGNAL_RANK": "0"})
    import re

    at = re.search(r"rank 0 after step (\d+)", stopped.stderr)
    begin = time.time()
    again = _run([*ours, KILL_PROBE, *EVENT_RUN, f"output_dir={out}"], {"KILL_RANK": "9", "KILL_AT_STEP": "0",
                                                                          "STEP_STAMP": str(steps)})
    rows.append(("stop signal to the launcher in step 16, then the same command", f"exit {stopped.returncode}, then {again.returncode}",
                 _lost(steps, int(at.group(1))) if at else "-", f"{_back_to_training(steps, begin)} (from the new start)",
                 _weights_against(out, reference)))

    # a node lost: rank 1 killed after step 15, no restart; the same command on the one process left
    out, stamp, steps = tmp / "fewer", tmp / "fewer.kill", tmp / "fewer.steps"
    _run([*ours, "--max-restarts", "0", KILL_PROBE, *EVENT_RUN, f"output_dir={out}"],
         {"KILL_RANK": "1", "KILL_AT_STEP": "15", "KILL_STAMP": str(stamp)})
    begin = time.time()
    one = _run([sys.executable, KILL_PROBE, *EVENT_RUN, f"output_dir={out}"], {"KILL_RANK": "9", "KILL_AT_STEP": "0",
                                                                              "STEP_STAMP": str(steps)})
    rows.append(("rank killed after step 15, the same command on 1 process", f"exit {one.returncode}", _lost(steps, 15),
                 f"{_back_to_training(steps, begin)} (from the new start, by hand)", _weights_against(out, reference)))

    print("\nevents: the default fine-tune, 40 steps, a checkpoint every 10 (background saves), 2 gloo processes")
    print("| event | exit | steps lost | from the event to training again | final weights against the uninterrupted run |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def fsdp_saves(rounds: int = 2) -> None:
    """The default fine-tune (MiniLM-L6) under FSDP on 2 gloo processes, 16 steps, a checkpoint every 4: the training
    time each save blocks (the run's own measure, ``hf_gpu_train_checkpointing.json``: the slowest rank's), synchronous
    against background, alternating, ``rounds`` runs each. The first save of a background run allocates the host copy
    of the shards every later save copies into: the later saves are the steady state."""
    tmp = Path(tempfile.mkdtemp(prefix="resilience-fsdp-"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import json

    from gloo_launch import cpu_config, launch

    config = cpu_config(tmp, 2, "fsdp")
    blocked: dict[str, list[list[float]]] = {"false": [], "true": []}
    for index in range(rounds):
        for background in (("false", "true") if index % 2 == 0 else ("true", "false")):
            out = tmp / f"{background}-{index}"
            run = launch(config, SCRIPT, "max_steps=16", "save_strategy=steps", "save_steps=4", "eval_strategy=no",
                         "telemetry=false", "evaluate_before=false", f"background_saves={background}", f"output_dir={out}")
            assert run.returncode == 0, run.stderr[-3000:]
            blocked[background].append(json.loads((out / "hf_gpu_train_checkpointing.json").read_text())["blocked_seconds"])
    sync = statistics.median(b for run in blocked["false"] for b in run)
    first = statistics.median(run[0] for run in blocked["true"])
    later = statistics.median(b for run in blocked["true"] for b in run[1:])
    print(f"\nFSDP, 2 gloo processes, MiniLM-L6, a save every 4 of 16 steps, {rounds} runs each, medians:")
    print("| arm | training blocked per save | vs synchronous |")
    print("|---|---|---|")
    print(f"| synchronous | {sync:.3f} s | 1.00x |")
    print(f"| background, first save (allocates the host copy) | {first:.3f} s | {first / sync:.2f}x |")
    print(f"| background, later saves | {later:.3f} s | {later / sync:.2f}x |")


def nodes() -> None:
    """Two ways a machine goes: its launcher SIGKILLed with its processes (nothing of ours is left to restart: the
    scheduler or a person runs the command again), and a node of an elastic launch lost (``--nnodes 1:2``, two
    launchers of one process each on this machine, the defaults as shipped: torchelastic's 30 s last call)."""
    tmp = Path(tempfile.mkdtemp(prefix="resilience-nodes-"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gloo_launch import cpu_config

    config = cpu_config(tmp)
    ours = [sys.executable, "-m", "hf_gpu_train", "launch", "--config-file", config]
    reference = tmp / "uninterrupted"
    assert _run([*ours, SCRIPT, *EVENT_RUN, f"output_dir={reference}"], {}).returncode == 0
    rows = []

    out, stamp, steps = tmp / "launcher", tmp / "launcher.kill", tmp / "launcher.steps"
    gone = _run([*ours, KILL_PROBE, *EVENT_RUN, f"output_dir={out}"],
                {"KILL_RANK": "1", "KILL_AT_STEP": "15", "KILL_WHOLE_NODE": "1", "KILL_STAMP": str(stamp)})
    begin = time.time()
    again = _run([*ours, KILL_PROBE, *EVENT_RUN, f"output_dir={out}"], {"KILL_RANK": "9", "KILL_AT_STEP": "0",
                                                                          "STEP_STAMP": str(steps)})
    rows.append(("launcher killed with its processes after step 15, then the same command",
                 f"exit {gone.returncode}, then {again.returncode}", _lost(steps, 15),
                 f"{_back_to_training(steps, begin)} (from the new start)", _weights_against(out, reference)))

    two = tmp / "two-nodes"
    made = subprocess.run([sys.executable, "-m", "hf_gpu_train", "config", "--machine", "cpu-only", "--num-processes", "1",
                           "--num-machines", "2", "--main-process-ip", "127.0.0.1", "--output", str(two)],
                          capture_output=True, text=True, cwd=ROOT)
    assert made.returncode == 0, made.stderr
    out, stamp, steps = tmp / "elastic", tmp / "elastic.kill", tmp / "elastic.steps"
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    launchers = []
    for node, env in ((0, {"KILL_RANK": "-1", "KILL_AT_STEP": "-1", "STEP_STAMP": str(steps)}),
                      (1, {"KILL_RANK": "any", "KILL_AT_STEP": "15", "KILL_WHOLE_NODE": "1", "KILL_STAMP": str(stamp)})):
        launchers.append(subprocess.Popen(
            [sys.executable, "-m", "hf_gpu_train", "launch", "--nnodes", "1:2", "--machine_rank", str(node),
             "--main_process_port", port, "--config-file", f"{two}.yaml", KILL_PROBE, *EVENT_RUN, f"output_dir={out}"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, stdout=subprocess.DEVNULL,
            stderr=open(tmp / f"node{node}.err", "w")))  # a file: a pipe read only at the end could fill and block
    codes = [p.wait(timeout=1800) for p in launchers]
    assert stamp.is_file(), f"node 1 was never killed: {(tmp / 'node1.err').read_text()[-3000:]}"
    rows.append(("a node lost after step 15, `launch --nnodes 1:2`: the other goes on alone", f"exit {codes[0]} (node 0)",
                 _lost(steps, 15), _back_to_training(steps, float(stamp.read_text()) if stamp.is_file() else 0.0),
                 _weights_against(out, reference)))
    print("\nnodes: the default fine-tune, 40 steps, a checkpoint every 10 (background saves), 2 gloo processes")
    print("| event | exit | steps lost | from the event to training again | final weights against the uninterrupted run |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["saves", "fsdp", "events", "nodes"], default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=8)
    args = parser.parse_args(argv)
    if args.only in (None, "saves"):
        saves(args.rounds, args.steps, args.save_every)
    if args.only in (None, "events"):
        events()
    if args.only in (None, "fsdp"):
        fsdp_saves(args.rounds)
    if args.only in (None, "nodes"):
        nodes()
    return 0


if __name__ == "__main__":
    sys.exit(main())
