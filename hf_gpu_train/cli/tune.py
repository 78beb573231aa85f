"""``hf-gpu-train tune``: the fastest settings that fit, measured on the real model, written into the launch plan.

    hf-gpu-train tune [--budget-s 60] [--fresh] [--axes ...] [ACCELERATE_OPTIONS] --config-file NAME.yaml \\
        -m hf_gpu_train.finetune --config recipe.yaml [key=value ...]     # or scripts/finetune.py in a clone
    hf-gpu-train tune --machine SNAPSHOT --config-file NAME.yaml -m hf_gpu_train.finetune ...     # the candidates, no trials

The command line is `hf-gpu-train launch`'s with tune's own options anywhere before the script. The trials run in
one launch of the config (every process) through ``hf_gpu_train.tune.worker``; this process never imports torch.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from ..errors import PlanError, UsageError
from ..finetune.recipe_names import is_shipped
from ..hardware.snapshot import load_machine
from ..launch.render import FINETUNE_ENTRY
from ..plan.accelerate_argv import CONFIG_FILE_OPTIONS, flatten, split_launch_argv
from ..plan.accelerate_argv import SWITCHES as ACCELERATE_SWITCHES
from ..plan.run_plan_file import data_stamps, plan_path_for, read_run_plan
from ..textfmt import table
from ..tune.cache import TuneCache, cache_path_for
from ..tune.candidates import AXES, DEFAULT_AXES
from ..tune.job import load_job, recipe_wins
from ..tune.plot import write_plot
from ..tune.results import FAILED, SKIPPED, TrialResult, choose
from ..tune.search import DEFAULT_BUDGET_S, WARMUP_STEPS, run_search
from ..tune.strategies import BY_NAME as STRATEGY_NAMES
from ..tune.strategies import ROUND as STRATEGY_ROUND
from ..tune.strategies import command_text, own_strategy, strategies_folder, strategy_config_argv
from ..tune.tune_report import RunFacts, render_report, report_paths, trial_rows, write_report
from ..tune.writeback import write_winner
from . import config as config_command
from . import example
from .launch import build_launch, run_reporting_usage_errors

USAGE = ("hf-gpu-train tune [--budget-s S] [--fresh] [--axes A,B] [--strategies LIST] [--machine SNAPSHOT | --dry-run] [ACCELERATE_OPTIONS] "
         "--config-file NAME.yaml -m hf_gpu_train.finetune --config RECIPE [key=value ...]")
DESCRIPTION = ("Measure the fastest settings that fit for this recipe on this launch config: micro-batch (the effective "
               "batch kept exact by the accumulation), gradient checkpointing, dataloader workers, precision, packing "
               "(causal LM) and torch.compile, a few real training steps each, all in one launch; with --strategies, "
               "distribution strategies too, one launch each. The winner goes into "
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
    p.add_argument("--strategies", metavar="LIST",
                   help="also measure these distribution strategies against the config's own, each in a launch of its own "
                   f"config (written to NAME.strategies/) at the search's winning values: all ({', '.join(STRATEGY_ROUND)}), "
                   f"own, or names from {','.join(STRATEGY_NAMES)} (default: the config's own only: "
                   "each strategy costs a launch, and the planner chose the config's by memory); the fastest that fits wins. "
                   "A config that shards the model (FSDP, DeepSpeed) is tuned only this way")
    p.add_argument("--memory-budget-gib", type=float, default=None,
                   help="a candidate fits only when its measured peak stays under this (on a GPU torch's peak reserved with "
                   "the CUDA context, on the CPU the process's peak resident memory): to leave room for something else, "
                   "or to find the fastest levers within a memory size")
    return p


SWITCHES = ("--fresh", "--dry-run")
VALUED = ("--budget-s", "--axes", "--machine", "--warmup-steps", "--measure-steps", "--memory-budget-gib", "--strategies")


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


def launch_trials(config_file: Path, options: list[str], spec: dict, folder: Path) -> tuple[int, dict | None]:
    """One launch of ``config_file`` running ``hf_gpu_train.tune.worker``; (exit code, what it measured)."""

    spec_path, results_path = folder / "spec.json", folder / "results.json"
    spec_path.write_text(json.dumps({**spec, "results_path": str(results_path), "output_dir": str(folder / "trials")}))
    launch = build_launch([*options, "--config-file", str(config_file), "-m", "hf_gpu_train.tune.worker", str(spec_path)])
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
                   memory_budget_bytes=budget, strategies=opts.strategies)
    for note in job.notes:
        print(f"hf-gpu-train tune: {note}")
    if opts.machine or opts.dry_run:
        print_space(job)
        if job.strategies:
            with tempfile.TemporaryDirectory(prefix="hf_gpu_train_tune_strategies_") as folder:
                print_round(job, render_strategy_configs(job, Path(folder), opts.machine))
        return 0
    entry = f"-m {parsed.script}" if parsed.has("-m", "--module") else shlex.quote(parsed.script)
    return _tune(job, opts, list(flatten(parsed.without(*CONFIG_FILE_OPTIONS))), started, entry)


def _tune(job, opts, options: list[str], started: float, entry: str = FINETUNE_ENTRY) -> int:

    cache = TuneCache.load(cache_path_for(job.config_file), opts.fresh, datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
    saved = {} if opts.fresh else cache.results(job.cache_key)
    configs = render_strategy_configs(job, strategies_folder(job.config_file), opts.machine) if job.strategies else []
    results, notes, startup_s, spent = [], [], None, 0.0
    if job.searches:
        results, notes, startup_s, spent = _search(job, opts, options, cache, saved)
    if job.strategies:
        found, more, loaded = _strategy_round(job, opts, options, cache, saved, results, configs)
        results, notes = results + found, notes + more
        startup_s = startup_s if startup_s is not None else loaded
    choice = choose(results, job.space.metric, job.space.base)
    return _write_and_print(job, opts, results, notes, choice, spent, startup_s, started, configs, entry)


def _search(job, opts, options: list[str], cache: TuneCache, saved: dict) -> tuple[list, list, float | None, float]:
    """The search under the config's own strategy, in one launch (none when every trial it asks for is saved): (results,
    notes, seconds the launch took to load, seconds of trials counted against the budget)."""
    replay = run_search(job.space, opts.budget_s, None, saved, opts.warmup_steps, opts.measure_steps)
    if not replay.needs_trials:
        print(f"hf-gpu-train tune: every trial the search asks for is saved in {cache.path}: no trial run (--fresh to "
              "measure again)", flush=True)
        return list(replay.results), list(replay.notes), None, replay.spent_s
    print(f"hf-gpu-train tune: {len(saved)} saved measurement(s) for this machine and recipe; measuring the rest "
          f"(budget {opts.budget_s:.0f} s of trials)", flush=True)
    spec = {"recipe": job.recipe, "overrides": list(job.overrides), "space": job.space.to_dict(), "budget_s": opts.budget_s,
            "warmup_steps": opts.warmup_steps, "measure_steps": opts.measure_steps,
            "cached": {k: r.to_dict() for k, r in saved.items()}}
    with tempfile.TemporaryDirectory(prefix="hf_gpu_train_tune_") as folder:
        code, doc = launch_trials(job.config_file, options, spec, Path(folder))
    measured = [TrialResult.from_dict(t) for t in (doc or {}).get("trials", [])]
    cache.store(job.cache_key, job.identity, measured, fresh=opts.fresh)
    if measured:
        cache.save()
    if code != 0 or doc is None or not doc.get("complete"):
        raise UsageError(f"the trial processes stopped (exit {code}; the error is above); {len(measured)} trial(s) "
                         f"measured were saved in {cache.path} and a rerun reuses them")
    return measured, doc.get("notes", []), doc.get("startup_s"), doc.get("spent_s", 0.0)


@dataclass(frozen=True)
class StrategyConfig:
    """A config `hf-gpu-train config --strategy ASKED` wrote for the strategy round (or the planner's refusal)."""

    asked: str
    command: str  # the hf-gpu-train config line that wrote it (the config's own, with --strategy and --output)
    config: Path | None = None  # NAME.strategies/ASKED.yaml
    strategy: str | None = None  # what the planner made of it, in its words (fsdp -> fsdp-shard-grad-op on GPUs)
    memory_strategy: str | None = None  # its memory plan's strategy (GPUs with --model), for the planner's check
    refused: str | None = None  # the planner's reason when it refused the strategy


def render_strategy_configs(job, folder: Path, machine: str | None) -> list[StrategyConfig]:
    """A config for every strategy of the round, written into ``folder`` by `hf-gpu-train config` itself: the command
    that wrote the config (its plan's), with ``--strategy S`` and ``--output FOLDER/S`` (``machine``: tune's
    ``--machine``, for a dry plan). A strategy the planner refuses (one that does not fit, FSDP of adapters) comes back
    with its reason; a command that cannot write a config like this one stops tune, naming it."""
    return [_render(job, asked, folder, machine) for asked in job.strategies]


def _render(job, asked: str, folder: Path, machine: str | None) -> StrategyConfig:
    argv = strategy_config_argv(job.plan.command, asked, folder / asked, machine=machine, force=True)
    command = command_text(argv)
    parser = argparse.ArgumentParser(prog="hf-gpu-train", add_help=False)
    config_command.register(parser.add_subparsers(dest="command"))
    said, argv_before = io.StringIO(), sys.argv
    try:
        sys.argv = ["hf-gpu-train", *argv]  # the YAML's header and the plan record this command as the one that wrote them
        with redirect_stdout(said), redirect_stderr(said):
            config_command.run(parser.parse_args(argv))
    except PlanError as error:
        return StrategyConfig(asked, command, refused=str(error))
    except (UsageError, SystemExit) as error:
        why = str(error) if isinstance(error, UsageError) else (said.getvalue().strip().splitlines() or ["?"])[-1]
        raise UsageError(f"--strategies: {job.config_file.name}'s plan was written by `{job.plan.command}`, and the same "
                         f"command for {asked} (`{command}`) fails: {why}; run tune where that command runs (its paths are "
                         "relative to where it ran), or regenerate the config with `hf-gpu-train config ... --output "
                         f"{job.config_file.with_suffix('')}`") from None
    finally:
        sys.argv = argv_before
    config = folder / f"{asked}.yaml"
    plan = read_run_plan(plan_path_for(config), "hf-gpu-train tune")
    if (plan.num_processes, plan.num_machines) != (job.plan.num_processes, job.plan.num_machines):
        raise UsageError(f"--strategies: `{command}` plans {plan.num_processes} process(es), {job.config_file.name} "
                         f"{job.plan.num_processes}: its plan's command (`{job.plan.command}`) does not write this config "
                         f"again; regenerate it with `hf-gpu-train config ... --output {job.config_file.with_suffix('')}` "
                         "and tune again")
    return StrategyConfig(asked, command, config, own_strategy(plan), plan.memory.strategy if plan.memory else None)


def _round_candidates(job, candidate, configs: list[StrategyConfig]) -> tuple[list, list, list[str]]:
    """(what to launch: [(candidate, config file)], skipped results, notes): the config's own first where its search did
    not measure it, every strategy once (two names the planner made the same strategy: the first), and none the
    planner refuses or says does not fit at these values."""
    launches, skipped, notes, seen = [], [], [], {job.own_strategy}
    if not job.searches:
        launches.append((candidate, job.config_file))
    for sc in configs:
        trial = replace(candidate, strategy=sc.strategy or sc.asked)
        if sc.refused is not None:
            skipped.append(TrialResult(trial, SKIPPED, f"the planner refuses {sc.asked} here: {sc.refused}"))
            continue
        if sc.strategy in seen:
            notes.append(f"strategy round: {sc.asked}: the planner made it {sc.strategy}, measured already")
            continue
        seen.add(sc.strategy)
        check = job.memory_check(trial.config_values(job.world_size), sc.memory_strategy) if sc.memory_strategy else None
        if check is not None and not check.fits:
            skipped.append(TrialResult(trial, SKIPPED, f"the planner says it does not fit under {sc.memory_strategy}: "
                                       f"{check.estimate_bytes / 2**30:.2f} GiB > {check.usable_bytes / 2**30:.2f} GiB usable"))
            continue
        launches.append((trial, sc.config))
    return launches, skipped, notes


def _strategy_round(job, opts, options: list[str], cache: TuneCache, saved: dict, results: list,
                    configs: list[StrategyConfig]) -> tuple[list, list[str], float | None]:
    """Each strategy measured at the search's winner (the plan's values where no search ran, or nothing of it fits), in
    one launch of its own config, over the same measured steps: (results, notes, the first launch's loading time)."""
    own_best = choose(results, job.space.metric, job.space.base).winner if results else None
    candidate = own_best.candidate if own_best is not None else job.space.base
    steps = own_best.measured_steps if own_best is not None else opts.measure_steps
    launches, found, notes = _round_candidates(job, candidate, configs)
    at = "the search's winner" if own_best is not None else "the plan's values"
    notes.insert(0, f"strategy round: each strategy at {at} ({candidate.describe()}), one launch of its own config each "
                    f"({strategies_folder(job.config_file).name}/), {steps or 'the first launch decides the'} measured steps; "
                    f"the micro-batch and the other axes were searched under {job.own_strategy} only")
    loaded = None
    for trial, config in launches:
        name = trial.strategy or job.own_strategy
        if trial.key in saved:
            found.append(saved[trial.key].cached())
            continue
        print(f"hf-gpu-train tune: strategy round: {name}, {trial.describe()}, in a launch of {config}", flush=True)
        spec = {"recipe": job.recipe, "overrides": list(job.overrides), "space": job.space.to_dict(), "budget_s": opts.budget_s,
                "warmup_steps": opts.warmup_steps, "measure_steps": steps, "search": "fixed", "candidates": [trial.to_dict()]}
        with tempfile.TemporaryDirectory(prefix="hf_gpu_train_tune_") as folder:
            code, doc = launch_trials(config, options, spec, Path(folder))
        measured = [TrialResult.from_dict(t) for t in (doc or {}).get("trials", [])]
        if not measured:
            found.append(TrialResult(trial, FAILED, f"the launch of {config.name} stopped (exit {code}; its error is above)"))
            continue
        cache.store(job.cache_key, job.identity, measured)
        cache.save()
        found += measured
        steps = steps or measured[0].measured_steps
        loaded = loaded if loaded is not None else doc.get("startup_s")
        notes.append(f"strategy round: {name}: model and data loaded in {doc.get('startup_s', 0):.1f} s, its trial "
                     f"{measured[0].seconds:.1f} s")
    return found, notes, loaded


def print_round(job, configs: list[StrategyConfig]) -> None:
    """The strategies the round would measure (--dry-run, --machine) and the ones the planner refuses or rules out."""
    launches, skipped, notes = _round_candidates(job, job.space.base, configs)
    folder = strategies_folder(job.config_file).name
    values = "the search's winner" if job.searches else "the plan's values"
    rows = [["Strategy", "Config", "Measured"]]
    if job.searches:
        rows.append([job.own_strategy, job.config_file.name, "the search's trials (the config's own strategy)"])
    asked = {sc.strategy: sc.asked for sc in configs}
    for trial, _ in launches:
        config = job.config_file.name if trial.strategy is None else f"{folder}/{asked[trial.strategy]}.yaml"
        rows.append([trial.strategy or job.own_strategy, config, f"one launch at {values}"])
    rows += [[result.candidate.strategy, "-", result.verdict()] for result in skipped]
    print(f"Strategies for {job.config_file.name} (each in a launch of its own config, written by `hf-gpu-train config "
          "--strategy S`):")
    print(table(rows))
    for note in notes:
        print(f"note: {note}")


def _write_and_print(job, opts, results, notes, choice, spent, startup_s, started, configs: list[StrategyConfig],
                     entry: str = FINETUNE_ENTRY) -> int:

    now = datetime.now(timezone.utc)
    stamp, when = now.strftime("%Y%m%d-%H%M%S"), now.strftime("%Y-%m-%d %H:%M UTC")
    report_path, plot_path = report_paths(job.config_file)
    other = _winning_config(choice, configs)
    # the config's own plan takes the fastest under its own strategy: the values its launches run
    own_choice = choice if other is None else choose([r for r in results if r.candidate.strategy is None], job.space.metric,
                                                     job.space.base)
    lines = _round_lines(job, choice, other)
    written = write_winner(job.config_file, own_choice, results, job.space, stamp, when, job.recipe, list(job.overrides),
                           report_path.name, opts.budget_s, data=data_stamps(job.values), notes=tuple(lines))
    items = [f"{job.config_file.name} (header block)",
             f"{written.plan.name}: {', '.join(written.keys) or 'no value'}",
             *(f"backup: {b.name}" for b in written.backups)]
    paths = [str(written.config), str(written.plan)]
    if other is not None:
        theirs = write_winner(other.config, choice, results, job.space, stamp, when, job.recipe, list(job.overrides),
                              report_path.name, opts.budget_s, data=data_stamps(job.values), notes=tuple(lines),
                              strategy_config=True)
        items += [f"{other.config.parent.name}/{other.config.name} (header block)",
                  f"{other.config.parent.name}/{theirs.plan.name}: {', '.join(theirs.keys)}"]
        paths += [str(theirs.config), str(theirs.plan)]
    items += [f"{sc.config.parent.name}/: {sc.config.stem}.yaml, .env, .plan.json (as `hf-gpu-train config` wrote it)"
              for sc in configs if sc.config is not None and sc is not other]
    plot = write_plot(plot_path, results, job.space, choice.winner)
    command = "hf-gpu-train " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["tune"] else "hf-gpu-train tune ..."
    facts = RunFacts(config_file=job.config_file.name, machine=job.machine, command=command, when=when, budget_s=opts.budget_s,
                     spent_s=spent, startup_s=startup_s, wall_s=time.perf_counter() - started, written=tuple(items))
    own = job.own_strategy if job.strategies else None
    kept = write_report(report_path, render_report(facts, job.space, choice, results, notes, plot.name if plot else None, own),
                        stamp)
    print()
    rows = trial_rows(results, job.space, own)
    shown = [i for i, name in enumerate(rows[0]) if name in CONSOLE_COLUMNS or name == job.space.metric]
    print(table([[row[i] for i in shown] for row in rows]))
    print()
    for reason in choice.reasons:
        print(f"hf-gpu-train tune: {reason}")
    for line in lines:
        print(f"hf-gpu-train tune: {line}")
    now = [r for r in results if r.ran and not r.from_cache]
    print(f"hf-gpu-train tune: {time.perf_counter() - started:.1f} s in all: {len(now)} trial(s) run now in "
          f"{sum(r.seconds for r in now):.1f} s" + (f", model and data loaded in {startup_s:.1f} s" if startup_s is not None else "")
          + f"; {len(results) - len(now)} result(s) saved or skipped; {spent:.1f} s of the {opts.budget_s:.0f} s budget counted")
    print("Wrote " + ", ".join(paths + [str(report_path)] + ([str(plot)] if plot else []))
          + (f" (your earlier {report_path.name} kept as {kept.name})" if kept else ""))
    if choice.winner is None:
        return 1
    _say_how_to_use(job, written.keys if other is None else theirs.keys, other.config if other is not None else job.config_file,
                    entry)
    return 0


CONSOLE_COLUMNS = ("#", "strategy", "micro-batch", "accum.", "checkpointing", "workers", "precision", "compile", "samples/s",
                   "peak GiB", "peak GiB per rank", "data wait %", "result")


def _winning_config(choice, configs: list[StrategyConfig]) -> StrategyConfig | None:
    """The config of the winner's strategy when it is not the config's own (None: the config's own won, or nothing)."""
    if choice.winner is None or choice.winner.candidate.strategy is None:
        return None
    return next(sc for sc in configs if sc.config is not None and sc.strategy == choice.winner.candidate.strategy)


def _round_lines(job, choice, other: StrategyConfig | None) -> list[str]:
    """What the strategy round decided, for the console and both configs' headers."""
    if not job.strategies or choice.winner is None:
        return []
    if other is None:
        return [f"strategy round: {job.own_strategy}, {job.config_file.name}'s own strategy, is the fastest that fits"]
    make_own = command_text(strategy_config_argv(job.plan.command, other.asked, job.config_file.with_suffix(""), force=True))
    return [f"strategy round: {other.strategy} is the fastest that fits, not {job.config_file.name}'s own {job.own_strategy}: "
            f"its config {other.config.parent.name}/{other.config.name} takes the winner's values and launches it; "
            f"{job.config_file.name} still launches {job.own_strategy}, with its own fastest values",
            f"to make {other.strategy} {job.config_file.name}'s own strategy: `{make_own}` (then tune it again)"]


def _say_how_to_use(job, keys, config_file: Path, entry: str = FINETUNE_ENTRY) -> None:
    """The launch line of the tuned config: the entry point tune was given (``-m hf_gpu_train.finetune`` or
    ``scripts/finetune.py``), a shipped recipe by its name (its file is inside the installed package)."""

    shadowed = recipe_wins(job, keys)
    recipe = Path(job.recipe).stem if job.recipe and is_shipped(job.recipe) else job.recipe
    script = entry + (f" --config {shlex.quote(str(recipe))}" if recipe else "")
    launch = f"hf-gpu-train launch --config-file {config_file} {script}"
    if shadowed:
        print(f"hf-gpu-train tune: {job.recipe} sets {', '.join(shadowed)} itself; at launch the tuned values win over the "
              "recipe's while its text stays as it is (edit it and its own values apply again; key=value on the command "
              "line always wins)")
    print(f"Next: {launch}{_overrides(job)}")


def _overrides(job) -> str:
    return "".join(f" {shlex.quote(o)}" for o in job.overrides)
