"""``hf-gpu-train tune``: the fastest settings that fit, measured on the real model, written into the launch plan.

    hf-gpu-train tune [--budget-s 60] [--fresh] [--axes ...] [ACCELERATE_OPTIONS] --config-file NAME.yaml \\
        scripts/finetune.py --config recipe.yaml [key=value ...]
    hf-gpu-train tune --machine SNAPSHOT --config-file NAME.yaml scripts/finetune.py ...     # the candidates, no trials

The command line is `hf-gpu-train launch`'s with tune's own options anywhere before the script. The trials run in
one launch of the config (every process) through ``hf_gpu_train.tune.worker``; this process never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from ..errors import UsageError
from ..hardware.snapshot import load_machine
from ..plan.accelerate_argv import CONFIG_FILE_OPTIONS, flatten, split_launch_argv
from ..plan.accelerate_argv import SWITCHES as ACCELERATE_SWITCHES
from ..plan.run_plan_file import data_stamps
from ..textfmt import table
from ..tune.cache import TuneCache, cache_path_for
from ..tune.candidates import AXES, DEFAULT_AXES
from ..tune.job import load_job, recipe_wins
from ..tune.plot import write_plot
from ..tune.results import TrialResult, choose
from ..tune.search import DEFAULT_BUDGET_S, WARMUP_STEPS, run_search
from ..tune.tune_report import RunFacts, render_report, report_paths, trial_rows, write_report
from ..tune.writeback import write_winner
from . import example
from .launch import build_launch, run_reporting_usage_errors

USAGE = ("hf-gpu-train tune [--budget-s S] [--fresh] [--axes A,B] [--machine SNAPSHOT | --dry-run] [ACCELERATE_OPTIONS] "
         "--config-file NAME.yaml scripts/finetune.py --config RECIPE.yaml [key=value ...]")
DESCRIPTION = ("Measure the fastest settings that fit for this recipe on this launch config: micro-batch (the effective "
               "batch kept exact by the accumulation), gradient checkpointing, dataloader workers, precision, packing "
               "(causal LM) and torch.compile, a few real training steps each, all in one launch. The winner goes into "
               "NAME.plan.json and NAME.yaml's header (backups first), the table and a plot into NAME.tune_report.md and "
               "NAME.tune.svg, the measurements into NAME.tune.json (reused by a rerun unless --fresh). key=value after "
               "the recipe fixes that key: it is not tuned.")


def own_parser() -> argparse.ArgumentParser:

    p = argparse.ArgumentParser(prog="hf-gpu-train tune", usage=USAGE, description=DESCRIPTION, add_help=False)
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds of trials after the model and data are loaded (default {DEFAULT_BUDGET_S:.0f}: about a "
                   "minute holds the micro-batch ladder and the cheap axes on a GPU; torch.compile needs more)")
    p.add_argument("--fresh", action="store_true", help="measure again, ignoring NAME.tune.json")
    p.add_argument("--axes", default=",".join(DEFAULT_AXES),
                   help=f"what to tune, comma-separated, of {','.join(AXES)} (default: {','.join(DEFAULT_AXES)}; packing "
                   "only when named: the packed and padded layouts train on different batches)")
    p.add_argument("--machine", metavar="FILE_OR_NAME", help="a snapshot: print the candidates for it, run nothing")
    p.add_argument("--dry-run", action="store_true", help="print the candidates for this machine, run nothing")
    p.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="steps before the measured ones (not counted)")
    p.add_argument("--measure-steps", type=int, default=None, help="measured steps per trial (default: about 2 s of steps)")
    p.add_argument("--memory-budget-gib", type=float, default=None,
                   help="a candidate fits only when its measured peak stays under this (on a GPU torch's peak reserved with "
                   "the CUDA context, on the CPU the process's peak resident memory): to leave room for something else, "
                   "or to find the fastest levers within a memory size")
    return p


SWITCHES = ("--fresh", "--dry-run")
VALUED = ("--budget-s", "--axes", "--machine", "--warmup-steps", "--measure-steps", "--memory-budget-gib")


def split_tune_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(tune's own options, everything else): tune's options are taken from anywhere before the script."""

    own: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, _ = token.partition("=")
        if name in SWITCHES or name in VALUED:
            own.append(token)
            if name in VALUED and not eq and i + 1 < len(argv):
                own.append(argv[i + 1])
                i += 1
        elif token.startswith("-") and token != "-":
            rest.append(token)
            if not eq and token not in ACCELERATE_SWITCHES and i + 1 < len(argv):
                rest.append(argv[i + 1])
                i += 1
        else:
            rest += argv[i:]
            break
        i += 1
    return own, rest


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tune", help="measure the fastest settings that fit and write them into the launch plan",
                              usage=USAGE, description=DESCRIPTION, prefix_chars="+", add_help=False)
    p.add_argument("argv", nargs=argparse.REMAINDER, help="tune options, accelerate launch options, --config-file, SCRIPT, ARGS")
    return p


def _axes(text: str) -> tuple[str, ...]:

    axes = tuple(a.strip() for a in text.split(",") if a.strip())
    unknown = [a for a in axes if a not in AXES]
    if unknown or not axes:
        raise UsageError(f"--axes {text}: use names from {','.join(AXES)}")
    return axes


def print_space(job) -> None:

    s = job.space
    print(f"Candidates for {job.config_file.name} on {job.machine}: {s.world_size} process(es), effective batch "
          f"{s.effective_batch}, compared by {s.metric}")
    rows = [["Axis", "Options (the run's own first)"], ["micro-batch", ", ".join(map(str, s.micro_batches))],
            ["checkpointing", ", ".join([*(["off"] if False in s.checkpointing else []),
                                         *((({"all": "on"}.get(p, p)) for p in s.policies) if True in s.checkpointing else ())])],
            ["activation offloading", ", ".join("on" if c else "off" for c in s.offload)],
            ["workers", ", ".join(map(str, s.workers))], ["precision", ", ".join(s.precisions)],
            ["torch.compile", ", ".join("on" if c else "off" for c in s.compile)]]
    if s.base.packing is not None:
        rows.append(["packing", ", ".join("on" if c else "off" for c in s.packing)])
    print(table(rows))
    print(f"Start: {s.base.describe()}")
    for v in s.pruned():
        print(f"skipped (the planner says it does not fit): micro-batch {v.micro_batch}, checkpointing "
              f"{v.checkpoint_layers if v.gradient_checkpointing else 'off'}{', offloading' if v.offload_activations else ''}, "
              f"{v.precision}: {v.estimate_bytes / 2**30:.2f} GiB > "
              f"{v.usable_bytes / 2**30:.2f} GiB usable")
    for note in s.notes:
        print(f"note: {note}")


def launch_trials(job, options: list[str], spec: dict, folder: Path) -> tuple[int, dict | None]:
    """One launch of the config running ``hf_gpu_train.tune.worker``; (exit code, what it measured)."""

    spec_path, results_path = folder / "spec.json", folder / "results.json"
    spec_path.write_text(json.dumps({**spec, "results_path": str(results_path), "output_dir": str(folder / "trials")}))
    launch = build_launch([*options, "--config-file", str(job.config_file), "-m", "hf_gpu_train.tune.worker", str(spec_path)])
    for note in launch.notes:
        print(f"hf-gpu-train tune: {note}", file=sys.stderr)
    if launch.cpus:
        os.sched_setaffinity(0, launch.cpus)
    code = run_reporting_usage_errors(launch.cmd, launch.env)
    doc = json.loads(results_path.read_text()) if results_path.is_file() else None
    return code, doc


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    own_argv, rest = split_tune_argv(args.argv)
    if any(t in ("-h", "--help") for t in own_argv + rest[:1]):

        own_parser().print_help()
        print(f"\n{example('tune')}")
        return 0
    opts = own_parser().parse_args(own_argv)

    parsed = split_launch_argv(rest)
    config_file = parsed.value(*CONFIG_FILE_OPTIONS)
    if not config_file or parsed.script is None:
        raise UsageError(f"--config-file NAME.yaml and the training script are required: {USAGE}")
    profile = None
    if opts.machine:

        profile = load_machine(opts.machine)
    if opts.memory_budget_gib is not None and opts.memory_budget_gib <= 0:
        raise UsageError(f"--memory-budget-gib {opts.memory_budget_gib}: give a positive size in GiB (e.g. 20)")
    budget = int(opts.memory_budget_gib * 2**30) if opts.memory_budget_gib else None
    job = load_job(config_file, parsed.script, list(parsed.script_args), parsed.settings(), _axes(opts.axes), profile,
                   memory_budget_bytes=budget)
    for note in job.notes:
        print(f"hf-gpu-train tune: {note}")
    if opts.machine or opts.dry_run:
        print_space(job)
        return 0
    return _tune(job, opts, list(flatten(parsed.without(*CONFIG_FILE_OPTIONS))), started)


def _tune(job, opts, options: list[str], started: float) -> int:

    cache = TuneCache.load(cache_path_for(job.config_file), opts.fresh, datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
    saved = {} if opts.fresh else cache.results(job.cache_key)
    replay = run_search(job.space, opts.budget_s, None, saved, opts.warmup_steps, opts.measure_steps)
    startup_s, notes = None, list(replay.notes)
    results = list(replay.results)
    if replay.needs_trials:
        print(f"hf-gpu-train tune: {len(saved)} saved measurement(s) for this machine and recipe; measuring the rest "
              f"(budget {opts.budget_s:.0f} s of trials)", flush=True)
        spec = {"recipe": job.recipe, "overrides": list(job.overrides), "space": job.space.to_dict(), "budget_s": opts.budget_s,
                "warmup_steps": opts.warmup_steps, "measure_steps": opts.measure_steps,
                "cached": {k: r.to_dict() for k, r in saved.items()}}
        with tempfile.TemporaryDirectory(prefix="hf_gpu_train_tune_") as folder:
            code, doc = launch_trials(job, options, spec, Path(folder))
        measured = [TrialResult.from_dict(t) for t in (doc or {}).get("trials", [])]
        cache.store(job.cache_key, job.identity, measured, fresh=opts.fresh)
        if measured:
            cache.save()
        if code != 0 or doc is None or not doc.get("complete"):
            raise UsageError(f"the trial processes stopped (exit {code}; the error is above); {len(measured)} trial(s) "
                             f"measured were saved in {cache.path} and a rerun reuses them")
        results, notes, startup_s = measured, doc.get("notes", []), doc.get("startup_s")
        spent = doc.get("spent_s", 0.0)
    else:
        print(f"hf-gpu-train tune: every trial the search asks for is saved in {cache.path}: no trial run (--fresh to "
              "measure again)", flush=True)
        spent = replay.spent_s
    choice = choose(results, job.space.metric, job.space.base)
    return _write_and_print(job, opts, results, notes, choice, spent, startup_s, started)


def _write_and_print(job, opts, results, notes, choice, spent, startup_s, started) -> int:

    now = datetime.now(timezone.utc)
    stamp, when = now.strftime("%Y%m%d-%H%M%S"), now.strftime("%Y-%m-%d %H:%M UTC")
    report_path, plot_path = report_paths(job.config_file)

    written = write_winner(job.config_file, choice, results, job.space, stamp, when, job.recipe, list(job.overrides),
                           report_path.name, opts.budget_s, data=data_stamps(job.values))
    plot = write_plot(plot_path, results, job.space, choice.winner)
    items = [f"{job.config_file.name} (header block)",
             f"{written.plan.name}: {', '.join(written.keys) or 'no value'}",
             *(f"backup: {b.name}" for b in written.backups)]
    command = "hf-gpu-train " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["tune"] else "hf-gpu-train tune ..."
    facts = RunFacts(config_file=job.config_file.name, machine=job.machine, command=command, when=when, budget_s=opts.budget_s,
                     spent_s=spent, startup_s=startup_s, wall_s=time.perf_counter() - started, written=tuple(items))
    kept = write_report(report_path, render_report(facts, job.space, choice, results, notes, plot.name if plot else None), stamp)
    print()
    print(table([row[:8] + row[10:11] + row[13:14] + row[-1:] for row in trial_rows(results, job.space)]))
    print()
    for reason in choice.reasons:
        print(f"hf-gpu-train tune: {reason}")
    now = [r for r in results if r.ran and not r.from_cache]
    print(f"hf-gpu-train tune: {time.perf_counter() - started:.1f} s in all: {len(now)} trial(s) run now in "
          f"{sum(r.seconds for r in now):.1f} s" + (f", model and data loaded in {startup_s:.1f} s" if startup_s is not None else "")
          + f"; {len(results) - len(now)} result(s) saved or skipped; {spent:.1f} s of the {opts.budget_s:.0f} s budget counted")
    print("Wrote " + ", ".join([str(written.config), str(written.plan), str(report_path)] + ([str(plot)] if plot else []))
          + (f" (your earlier {report_path.name} kept as {kept.name})" if kept else ""))
    if choice.winner is None:
        return 1
    _say_how_to_use(job, choice.winner.candidate, written.keys)
    return 0


def _say_how_to_use(job, winner, keys) -> None:

    shadowed = recipe_wins(job, keys)
    script = "scripts/finetune.py" + (f" --config {job.recipe}" if job.recipe else "")
    launch = f"hf-gpu-train launch --config-file {job.config_file} {script}"
    if shadowed:
        print(f"hf-gpu-train tune: {job.recipe} sets {', '.join(shadowed)} itself; at launch the tuned values win over the "
              "recipe's while its text stays as it is (edit it and its own values apply again; key=value on the command "
              "line always wins)")
    print(f"Next: {launch}{_overrides(job)}")


def _overrides(job) -> str:
    return "".join(f" {shlex.quote(o)}" for o in job.overrides)
