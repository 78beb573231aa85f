"""`hf-gpu-train tune` on a real GPU, for ``scripts/gpu_check.py``: the text recipe and the causal-LM recipe, each
tuned on a config planned for this machine and the recipe's model; prints tune's table, the time it took, and the
memory planner's estimate against every measured peak (its error in percent)::

    from scripts.gpu_checks.tune_on_gpu import check_tune
    results["tune"] = check_tune(ROOT)        # in scripts/gpu_check.py's main(); True when every case found a winner

Each case runs `hf-gpu-train config --model MODEL --seq-len MAX_LENGTH --global-batch G` into a temporary folder,
then `hf-gpu-train tune --fresh` with the shipped budget, as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.tasks import task_for
from hf_gpu_train.textfmt import table
from hf_gpu_train.tune.job import load_job
from hf_gpu_train.tune.results import TrialResult
from hf_gpu_train.tune.tune_report import planner_error

GIB = 2**30


@dataclass(frozen=True)
class TuneCase:
    name: str
    recipe: str  # relative to the repository root
    overrides: tuple[str, ...]  # fixed on the command line (not tuned)
    global_batch: int


# The text recipe's own global batch is its micro-batch (32): on a GPU with room for far more, 256 lets the ladder climb.
CASES = (TuneCase("text", "recipes/minilm_text_demo.yaml", ("global_batch_size=256",), 256),
         TuneCase("causal-lm", "recipes/smollm2_lora_demo.yaml", ("global_batch_size=32",), 32))


def planner_model(root: Path, case: TuneCase) -> str:
    """The recipe's model as a directory (or timm name) for `hf-gpu-train config --model`."""

    cfg = load_config(root / case.recipe, list(case.overrides))
    return task_for(cfg.task).planner_model(cfg)


def planner_errors(config_file: Path, script_args: list[str], profile=None) -> list[list[str]]:
    """Per trial that ran: the measured peak, the planner's estimate for it, and the planner's error (``profile``: the
    machine the config is for, None: this one)."""

    job = load_job(str(config_file), "scripts/finetune.py", script_args, {}, profile=profile)
    tuned = json.loads(config_file.with_suffix(".plan.json").read_text()).get("tuned") or {}
    rows = [["trial", "peak GiB", "planner GiB", "planner error %"]]
    for t in tuned.get("trials", []):
        result = TrialResult.from_dict(t)
        if not result.ran:
            continue
        estimate, error = planner_error(result, job.space)
        rows.append([result.candidate.describe(), "-" if result.peak_memory_bytes is None else f"{result.peak_memory_bytes / GIB:.2f}",
                     "-" if estimate is None else f"{estimate / GIB:.2f}", "-" if error is None else f"{error:+.1f}"])
    return rows


def _hf(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_gpu_train", *args], cwd=root, text=True, capture_output=True)


def check_case(root: Path, case: TuneCase, budget_s: float | None = None) -> bool:

    print(f"\n--- tune: {case.name} ({case.recipe}) ---", flush=True)
    if not (root / case.recipe).is_file():
        print(f"{case.recipe} is not in this tree: skipped")
        return True
    model = planner_model(root, case)
    with tempfile.TemporaryDirectory(prefix="tune_gpu_check_") as tmp:
        out = Path(tmp) / "gpu"

        max_length = load_config(root / case.recipe, list(case.overrides)).max_length
        made = _hf(root, "config", "--model", model, "--seq-len", str(max_length), "--global-batch", str(case.global_batch),
                   "--output", str(out))
        if made.returncode != 0:
            print(made.stdout[-2000:], made.stderr[-2000:])
            return False
        script_args = ["--config", str(root / case.recipe), *case.overrides]
        budget = ["--budget-s", str(budget_s)] if budget_s else []
        start = time.perf_counter()
        run = _hf(root, "tune", "--fresh", *budget, "--config-file", f"{out}.yaml", "scripts/finetune.py", *script_args)
        wall = time.perf_counter() - start
        print(run.stdout[-6000:])
        if run.returncode != 0:
            print(run.stderr[-3000:])
        print(f"tune for {case.name}: {wall:.1f} s in all (exit {run.returncode})")
        print(table(planner_errors(Path(f"{out}.yaml"), script_args)))
        return run.returncode == 0


def check_tune(root: Path, cases: tuple[TuneCase, ...] = CASES, budget_s: float | None = None) -> bool:
    """Every case; True when each one that ran found a winner (exit 0)."""
    return all([check_case(root, case, budget_s) for case in cases])
