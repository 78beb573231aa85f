"""The training processes of `hf-gpu-train tune`: ``accelerate launch -m hf_gpu_train.tune.worker SPEC.json``.

Every process loads the recipe's model and data once (``trials.TrialSession``) and runs the same trials. Rank 0
drives the search (its clock is the budget's), broadcasts each candidate to the others, gathers every process's
measurement, and writes the results to the file the spec names after every trial, so a launch that stops half-way
still leaves what it measured. The spec is written by ``cli/tune.py``::

    {"recipe": "recipes/x.yaml" | null, "overrides": ["key=value", ...], "space": CandidateSpace, "budget_s": 60,
     "warmup_steps": 2, "measure_steps": null, "cached": {candidate key: TrialResult}, "results_path": ...,
     "output_dir": ..., "search": "tune" | "grid" | "fixed", "candidates": [Candidate, ...] (with "fixed")}
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from ..errors import UsageError, report_usage_error
from ..finetune.launch_plan import apply_launch_plan
from ..finetune.loading import load_config_and_keys
from ..process_group import exit_process
from .candidates import Candidate, CandidateSpace
from .results import TrialResult
from .search import run_fixed, run_grid, run_search

RESULTS_FORMAT = "hf_gpu_train.tune_trials"


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def _broadcast(message, world_size: int):
    if world_size < 2:
        return message
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(local, world_size: int) -> list:
    if world_size < 2:
        return [local]
    import torch.distributed as dist

    found = [None] * world_size
    dist.all_gather_object(found, local)
    return found


def _quiet_libraries() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("hf_gpu_train.telemetry").setLevel(logging.WARNING)
    logging.getLogger("hf_gpu_train.loss_scaling").setLevel(logging.WARNING)


def run(spec: dict, started: float) -> int:

    cfg, explicit = load_config_and_keys(spec["recipe"], spec["overrides"])
    cfg, _ = apply_launch_plan(cfg, explicit)  # the plan's environment first: CUDA and NCCL read it once
    _quiet_libraries()
    from .trials import TrialSession, combine, trial_line

    space = CandidateSpace.from_dict(spec["space"])
    session = TrialSession(cfg, spec["output_dir"])
    world = session.world_size
    if world != space.world_size:
        raise UsageError(f"tune planned for {space.world_size} process(es) but {world} started: pass the same "
                         "--num_processes to hf-gpu-train tune as to the launch")
    if session.rank != 0:
        while (message := _broadcast(None, world)) is not None:
            _gather(session.run(Candidate.from_dict(message[0]), message[1], message[2]), world)
        return 0
    startup_s = time.perf_counter() - started
    for note in session.notes:
        print(f"tune: {note}", flush=True)
    budget = "" if spec.get("search") == "fixed" else f"; budget {spec['budget_s']:.0f} s of trials"
    print(f"tune: model and data loaded in {startup_s:.1f} s on {world} process(es){budget}", flush=True)
    results_path = Path(spec["results_path"])
    done: list[TrialResult] = []
    doc = {"format": RESULTS_FORMAT, "startup_s": round(startup_s, 2), "world_size": world, "trials": [], "complete": False}

    def run_trial(candidate: Candidate, warmup_steps: int, measure_steps: int | None) -> TrialResult:
        _broadcast([candidate.to_dict(), warmup_steps, measure_steps], world)
        start = time.perf_counter()
        local = session.run(candidate, warmup_steps, measure_steps)
        result = combine(candidate, _gather(local, world), warmup_steps, time.perf_counter() - start, world, space.memory_budget_bytes)
        done.append(result)
        print(trial_line(len(done), result), flush=True)
        _write(results_path, {**doc, "trials": [r.to_dict() for r in done]})
        return result

    cached = {k: TrialResult.from_dict(v) for k, v in spec.get("cached", {}).items()}
    if spec.get("search") == "grid":  # benchmarks/tune_vs_grid.py: every candidate, for comparison
        outcome = run_grid(space, run_trial, spec["warmup_steps"], spec.get("measure_steps"))
    elif spec.get("search") == "fixed":  # tune's strategy round: these candidates in this launch, no search
        outcome = run_fixed([Candidate.from_dict(c) for c in spec["candidates"]], run_trial, spec["warmup_steps"],
                            spec.get("measure_steps"))
    else:
        outcome = run_search(space, spec["budget_s"], run_trial, cached, spec["warmup_steps"], spec.get("measure_steps"))
    _broadcast(None, world)  # the others leave their loop (after an error every process stops instead)
    _write(results_path, {**doc, "trials": [r.to_dict() for r in outcome.results], "notes": list(outcome.notes),
                          "spent_s": round(outcome.spent_s, 2), "complete": True})
    return 0


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hf_gpu_train.tune.worker SPEC.json (started by hf-gpu-train tune)", file=sys.stderr)
        return 2
    try:
        return run(json.loads(Path(argv[0]).read_text()), started)
    except UsageError as error:
        report_usage_error(f"tune: error: {error}")
        return 2


if __name__ == "__main__":
    exit_process(main())  # every trial ended on every rank: the process group is left before exit
