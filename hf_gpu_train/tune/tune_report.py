"""NAME.tune_report.md: what `hf-gpu-train tune` tried, what each trial measured, what won and why, what it did
not try and why, and the planner's estimate beside every measured peak. Beside NAME.yaml, named after it, so a
folder of launch configs keeps one report per config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..plan.resolution import memory_error_pct
from .candidates import CandidateSpace
from .results import HEADROOM_FRACTION, Choice, TrialResult
from .writeback import backup

GIB = 2**30
MARK = "<!-- written by hf-gpu-train tune -->"


def report_paths(config_file: Path) -> tuple[Path, Path]:
    """(NAME.tune_report.md, NAME.tune.svg)."""
    return config_file.with_suffix(".tune_report.md"), config_file.with_suffix(".tune.svg")


@dataclass(frozen=True)
class RunFacts:
    """What the report says about the run around the trials."""

    config_file: str
    machine: str
    command: str
    when: str
    budget_s: float
    spent_s: float
    startup_s: float | None  # None: every measurement came from NAME.tune.json
    wall_s: float
    written: tuple[str, ...] = ()  # files changed, with their backups


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _num(value: float | None, fmt: str = ",.1f") -> str:
    return "-" if value is None else format(value, fmt)


def planner_error(result: TrialResult, space: CandidateSpace) -> tuple[int | None, float | None]:
    """(the planner's estimate in bytes, its error against the measured peak in percent) for this trial (the space's
    verdicts are the config's own strategy's: none for a trial of another)."""
    verdict = None if result.candidate.strategy else space.verdict(result.candidate)
    if verdict is None:
        return None, None
    if result.peak_memory_bytes is None or not result.ran:
        return verdict.estimate_bytes, None
    return verdict.estimate_bytes, memory_error_pct(verdict.estimate_bytes, result.peak_memory_bytes)


def checkpointing_text(c) -> str:
    """off, on (every layer), selective or every-N, and + offload."""
    return {"all": "on"}.get(c.checkpointing, c.checkpointing) + (" + offload" if c.offload_activations else "")


def _per_rank(result: TrialResult) -> str:
    return "/".join(_gib(peak) for peak in result.peak_by_rank_bytes) or "-"


def trial_rows(results: list[TrialResult], space: CandidateSpace, own_strategy: str | None = None) -> list[list[str]]:
    """The table of trials; ``own_strategy`` (the config's, when the strategy round ran): a strategy column and each
    process's peak."""
    header = ["#", "micro-batch", "accum.", "checkpointing", "workers", "precision", "compile", space.metric, "samples/s",
              "step spread %", "peak GiB", "planner GiB", "planner error %", "data wait %", "warm-up s", "compile s", "trial s", "result"]
    if own_strategy is not None:
        header[1:1] = ["strategy"]
        header[header.index("peak GiB") + 1:header.index("peak GiB") + 1] = ["peak GiB per rank"]
    rows = [header]
    for i, r in enumerate(results, 1):
        c = r.candidate
        estimate, error = planner_error(r, space)
        row = [str(i), str(c.micro_batch), str(c.accumulation), checkpointing_text(c),
               str(c.dataloader_num_workers), c.precision, "on" if c.torch_compile else "off", _num(r.throughput(space.metric)),
               _num(r.samples_per_s), _num(r.spread_pct), _gib(r.peak_memory_bytes), _gib(estimate),
               _num(error, "+.1f"), _num(r.data_wait_pct), _num(r.warmup_s), _num(r.compile_s),
               _num(r.seconds) + (" (saved)" if r.from_cache else ""), r.verdict()]
        if own_strategy is not None:
            row[1:1] = [c.strategy or own_strategy]
            row[header.index("peak GiB per rank"):header.index("peak GiB per rank")] = [_per_rank(r)]
        rows.append(row)
    return rows


def _table(rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return lines + ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows[1:]]


def render_report(facts: RunFacts, space: CandidateSpace, choice: Choice, results: list[TrialResult], notes: list[str],
                  plot_name: str | None, own_strategy: str | None = None) -> str:
    """``own_strategy``: the config's, when the strategy round ran (the table names each trial's strategy)."""
    ran = [r for r in results if r.ran and not r.from_cache]
    startup = "every measurement reused from the saved ones" if facts.startup_s is None else f"model and data loaded in {facts.startup_s:.1f} s"
    lines = [MARK, f"# hf-gpu-train tune: {facts.config_file}", "",
             f"- machine: {facts.machine}; {space.world_size} process(es); {'CUDA' if space.on_cuda else 'CPU'}",
             f"- command: `{facts.command}`",
             f"- {facts.when}; budget {facts.budget_s:.0f} s of trials, {facts.spent_s:.1f} s counted (saved trials count what they "
             f"cost when measured); {len(ran)} trial(s) run now in {sum(r.seconds for r in ran):.1f} s; {startup}; "
             f"{facts.wall_s:.1f} s in all",
             f"- effective batch {space.effective_batch} = micro-batch x accumulation x {space.world_size}, the same for every "
             f"candidate; compared by {space.metric} over the measured steps (warm-up steps not counted)",
             f"- fits: no out-of-memory at any point (one the OOM recovery rescued at a smaller micro-batch is not eligible) and "
             f"a measured peak within {HEADROOM_FRACTION:.0%} of the device's memory", "", "## Winner", ""]
    if choice.winner is None:
        lines.append("No candidate fits; nothing was written to the plan.")
    else:
        lines.append(f"**{choice.winner.candidate.describe()}**")
    lines += [""] + [f"- {reason}" for reason in choice.reasons]
    lines += ["", "## Trials", "", *_table(trial_rows(results, space, own_strategy)), ""]
    if plot_name:
        lines += [f"![{space.metric} and peak memory against the micro-batch]({plot_name})", ""]
    lines += ["## How the search went, and what it did not try", ""]
    lines += [f"- {note}" for note in (*notes, *space.notes)]
    for v in space.pruned():
        lines.append(f"- not tried, the planner says it does not fit: micro-batch {v.micro_batch}, checkpointing "
                     f"{v.checkpoint_layers if v.gradient_checkpointing else 'off'}{' + offload' if v.offload_activations else ''}, "
                     f"{v.precision}: {v.estimate_bytes / GIB:.2f} GiB against "
                     f"{v.usable_bytes / GIB:.2f} GiB usable")
    if facts.written:
        lines += ["", "## Written", ""] + [f"- {item}" for item in facts.written]
    return "\n".join(lines) + "\n"


def write_report(path: Path, text: str, stamp: str) -> Path | None:
    """Write the report; a file there that this command did not write is kept as NAME.bak-STAMP first."""

    kept = None
    if path.exists() and not path.read_text(errors="replace").startswith(MARK):
        kept = backup(path, stamp)
    path.write_text(text)
    return kept
