"""What hf_gpu_train's two lines cost inside TRL's SFTTrainer on 2 gloo processes, and what an OOM costs with them.

Arms (each a fresh launch of ``overhead_in_trl_probe.py``, alternating order per round):
- off: TRL's SFTTrainer as its docs build it (LoRA, prompt/completion rows);
- on: the same with ``attach_telemetry(trainer)`` and ``enable_oom_recovery(trainer)``, no OOM;
- on-oom (once, after the rounds): the same with an out-of-memory error injected on rank 1 in the 3rd step.

Prints steps/s of ``train()`` per round, the ratio on/off (goal >= 0.98), and for the OOM run: optimizer steps run
against asked (goal: none redone), how the step was recovered, and the largest difference between its final LoRA
weights and the clean run's (goal: equal within fp32 tolerance, 1e-5).

    python benchmarks/overhead_in_trl.py [--rounds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from gloo_launch import ROOT, cpu_config, launch


def run_arm(config: str, out: Path, mode: str, steps: int) -> dict:
    done = launch(config, str(ROOT / "benchmarks" / "overhead_in_trl_probe.py"), str(out), mode, str(steps))
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((out / f"{mode}.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        config = cpu_config(tmp)
        for r in range(args.rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                out = Path(tmp) / f"round{r}"
                out.mkdir(exist_ok=True)
                rates[mode].append(run_arm(config, out, mode, args.steps)["steps_per_second"])
        clean_dir = Path(tmp) / "round0"
        oom = run_arm(config, clean_dir, "on-oom", args.steps)
        clean = json.loads((clean_dir / "on.json").read_text())
        weights_clean, weights_oom = torch.load(clean_dir / "on.pt"), torch.load(clean_dir / "on-oom.pt")
        diff = max((weights_clean[k] - weights_oom[k]).abs().max().item() for k in weights_clean)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    per_round = [b / a for a, b in zip(rates["off"], rates["on"])]
    print(f"TRL SFTTrainer, LoRA, small Llama (4 layers, hidden 256), 2 gloo processes on the CPU, {args.steps} steps, "
          f"{args.rounds} round(s)")
    print(f"steps/s without our pieces: {[round(x, 3) for x in rates['off']]} (median {off:.3f})")
    print(f"steps/s with telemetry + OOM recovery: {[round(x, 3) for x in rates['on']]} (median {on:.3f})")
    print(f"ratio (with / without): {on / off:.3f}; per round {[round(x, 3) for x in per_round]} (goal >= 0.98)")
    print(f"with an OOM on rank 1 at step 3: {oom['global_step']} optimizer steps for {args.steps} asked "
          f"({oom['global_step'] - args.steps} redone), micro-batch {oom['micro_batch']}, {oom['restarts']} step(s) computed "
          f"again by every rank; logged losses against the clean run's: max relative difference "
          f"{max(abs(a - b) / abs(b) for a, b in zip(oom['losses'], clean['losses'])):.2g} over {len(clean['losses'])} logs")
    print(f"final LoRA weights, OOM run against clean run: max |difference| {diff:.3g} (goal <= 1e-5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
