"""DeepSpeed ZeRO-2 and ZeRO-3 on a real GPU, for ``scripts/gpu_check.py --only zero`` (issue 31): each ZeRO run against
a plain one-process run of the same recipe, and each rank's measured memory against the planner's figure::

    from scripts.gpu_checks.zero_against_one_process import check_zero    # in scripts/gpu_check.py
    results["zero"] = check_zero(ROOT)      # True when skipped (no GPU) or every comparison is within its tolerance

Every run takes the toolkit's own path: ``hf-gpu-train config --strategy deepspeed-zero2`` / ``deepspeed-zero3`` (the
plain run: no --strategy, one GPU: distributed_type NO) with ``--model`` and ``--seq-len``, so that the run records the
planner's figure for the values it used (run_summary.json, ``plan.memory.estimate_bytes``); then ``hf-gpu-train launch
--config-file NAME.yaml scripts/gpu_checks/zero_against_one_process.py --config RECIPE key=value ...``. Run as a script, this file is
the fine-tuning entry point itself (``finetune.run.main``) and one measurement after it: the process's
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``, written to
``$HF_GPU_TRAIN_ZERO_CHECK_PEAKS/peak_rank{RANK}.json`` by every rank (the telemetry summary holds rank 0's only).

- One GPU: every run is one process (two NCCL ranks cannot share a GPU), and all six runs go at once: the GPU has room
  for all of them, each process's allocator peak is its own, and the section stays within its minute and a half (each
  run is mostly start-up: imports, DeepSpeed's engine, the model's load). Two GPUs or more: the ZeRO runs take 2
  processes with half the micro-batch each, so that every optimizer step sees the plain run's rows.
- The cases (``CASES``): the text recipe and SmolLM2 full fine-tuning (ZeRO-3 is where the memory per rank matters).
  The text runs start from one saved copy of MiniLM with its new head, without dropout (``prepare_start``): under
  ZeRO-3 the head would be drawn on the GPU inside ``zero.Init`` from another random stream than the plain run's, and
  two ranks' dropout masks are not one process's. Every key a plan could set is fixed on the command line (``COMMON``),
  so the plans of the three runs differ in the strategy only.
- Equality (``compare_runs``): the logged loss and gradient norm at every step, and the saved weights: the max abs
  difference, and the norm of the difference as a fraction of how far training moved the weights from the start.
  Tolerances by precision (``TOLERANCES``): in fp32 the runs differ by summation order only; in bf16 the ZeRO run
  computes with bf16 weights (DeepSpeed casts the model) where the plain run keeps fp32 weights under autocast, and it
  saves bf16 weights: one rounding of each master is allowed for before the fraction is taken.
- Memory (``memory_lines``): each rank's allocated peak against the planner's figure for the run's values (the CUDA
  context included, as ``peft_memory`` compares); the planner must cover it: an estimate below a measured peak is an
  out-of-memory the planner would not predict.

The deciding code (reading a run's files, the comparisons, the verdict lines) is plain functions of files and numbers,
tested on the CPU with recorded inputs (tests/gpu_checks/test_zero_against_one_process.py); ``rehearse_on_cpu`` runs the whole section
on CPU processes (DeepSpeed's CPU accelerator, gloo, 2 processes: ZeRO refuses one on a CPU machine), without peaks.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hf_gpu_train.finetune.checkpoints import write_label_map
from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.recipe_names import resolve_recipe
from hf_gpu_train.finetune.run_record import RECORD
from hf_gpu_train.finetune.tasks import task_for
from hf_gpu_train.finetune.tasks.text_classification.model import load_text_model
from hf_gpu_train.plan.strategies import DEEPSPEED, strategy_names
from hf_gpu_train.process_group import exit_process
from hf_gpu_train.textfmt import gib

PEAKS_ENV = "HF_GPU_TRAIN_ZERO_CHECK_PEAKS"
PROBE_SCRIPT = str(Path(__file__).resolve())  # launched as the training script of every run
ZERO_STRATEGIES = strategy_names(lambda s: s.family == DEEPSPEED and not s.offload)  # each ZeRO stage, optimizer on the GPU
PLAIN = "single"


@dataclass(frozen=True)
class Tolerance:
    """How far a ZeRO run may be from the plain one: relative, at each logged step (loss, gradient norm), and the
    weights' difference as a fraction of the plain run's movement from the starting weights (norms over all tensors).
    A wrong update (none, doubled, the initial weights saved) is a fraction near 1 or above."""

    loss_rtol: float
    grad_norm_rtol: float
    weights_fraction: float
    why: str


TOLERANCES = {
    # the same arithmetic grouped otherwise (flat partitions, DeepSpeed's own norm over them, 2 ranks' sums): on 2 CPU
    # processes the losses agree to 3e-7 and the weights to 3e-5 of their movement; SmolLM2's gradient norm (a sum over
    # 135M squares) to 4.5e-5, so 1e-3 for it, still a tenth of a 1% error (tests/scaling/equivalence.py: tiny models)
    "fp32": Tolerance(1e-4, 1e-3, 0.01, "fp32: the same sums in another order"),
    # ZeRO computes with bf16 weights (norms and activations in bf16 too), the plain run with fp32 weights under autocast:
    # the losses part by ~1e-3 and the gap grows with the steps (gpu_check's `deepspeed` section allows 2%); the
    # gradient norm is summed over bf16 gradients
    "bf16": Tolerance(0.02, 0.05, 0.25, "bf16: ZeRO computes with bf16 weights, the plain run with fp32 weights under autocast"),
    "fp16": Tolerance(0.02, 0.05, 0.25, "fp16: ZeRO computes with fp16 weights, the plain run with fp32 weights under autocast"),
}


@dataclass(frozen=True)
class ZeroCase:
    """One recipe, run plain and under each ZeRO stage with the same rows at every optimizer step."""

    name: str
    recipe: str  # a shipped recipe's name, or a recipe file
    overrides: tuple[str, ...]  # the same for every run of the case
    global_batch: int
    steps: int


# Every key a plan could set (run_plan_file.APPLIED_KEYS) but the precision and the lever choices a strategy makes for
# itself (packing, the chunked head: exact either way), so that each run's plan changes the strategy only; no loader
# processes (six runs share the machine's cores at once), no evaluation or checkpoint on the way, and a short final one
# in small batches (the peak a process writes covers its whole life: the training's must be the largest part of it).
COMMON = ("logging_steps=1", "eval_strategy=no", "save_strategy=no", "evaluate_before=false", "telemetry=false",
          "gradient_checkpointing=false", "torch_compile=false", "dataloader_num_workers=0", "checkpoint_layers=all",
          "offload_activations=false", "optimizer_in_backward=false", "max_eval_samples=16", "per_device_eval_batch_size=4",
          "report_to=none")
CASES = (
    ZeroCase("text", "minilm_text_demo", (), global_batch=32, steps=8),
    # at a full fine-tune's learning rate (the recipe's 1e-3 is LoRA's): every bf16 difference between the runs grows
    # with the step size
    ZeroCase("smollm2-full", "smollm2_lora_demo", ("method=full", "learning_rate=1e-4", "warmup_ratio=0", "generation_samples=0"),
             global_batch=8, steps=6),
)


# --- the training process -------------------------------------------------------------------------------------------


def write_peak(folder: str | Path, environ: Mapping[str, str] = os.environ) -> Path:
    """This process's allocator peaks on its GPU since it started (the model's load, the training, the final evaluation
    and save) to FOLDER/peak_rank{RANK}.json; null on the CPU."""
    import torch  # lazy: the checking process reads these files without torch

    rank = int(environ.get("RANK", "0"))
    record: dict = {"rank": rank, "device": "cpu", "max_memory_allocated_bytes": None, "max_memory_reserved_bytes": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        record.update(device=f"cuda:{device} ({torch.cuda.get_device_name(device)})",
                      max_memory_allocated_bytes=torch.cuda.max_memory_allocated(device),
                      max_memory_reserved_bytes=torch.cuda.max_memory_reserved(device))
    path = Path(folder) / f"peak_rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def probe_main(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> int:
    """``python scripts/gpu_checks/zero_against_one_process.py ARGS``: scripts/finetune.py's run with ARGS, then, after a finished run,
    this process's peaks where ``HF_GPU_TRAIN_ZERO_CHECK_PEAKS`` says."""
    from hf_gpu_train.finetune.run import main  # lazy: the checking process needs none of the run's imports

    code = main(list(argv))
    if code == 0 and environ.get(PEAKS_ENV):
        write_peak(environ[PEAKS_ENV], environ)
    return code


# --- what a run left ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peak:
    allocated_bytes: int | None
    reserved_bytes: int | None


@dataclass(frozen=True)
class RunRecord:
    """A finished run's figures, from its output directory and its peak files."""

    name: str
    losses: tuple[float, ...]
    grad_norms: tuple[float, ...]
    precision: str | None
    planner_bytes: int | None  # the planner's figure for the values the run used, per process (None: no memory plan)
    planned_for: str  # what the figure is for, in words
    peaks: dict[int, Peak] = field(default_factory=dict)  # by rank
    weights: Path | None = None


def read_log_history(state: Mapping) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(losses, gradient norms) of trainer_state.json's training log, one per logged step (NaN: no norm logged)."""
    rows = [h for h in state.get("log_history", []) if "loss" in h and "step" in h]
    return tuple(float(h["loss"]) for h in rows), tuple(float(h.get("grad_norm", math.nan)) for h in rows)


def read_peaks(folder: Path) -> dict[int, Peak]:
    peaks = {}
    for path in sorted(folder.glob("peak_rank*.json")):
        record = json.loads(path.read_text())
        peaks[int(record["rank"])] = Peak(record.get("max_memory_allocated_bytes"), record.get("max_memory_reserved_bytes"))
    return peaks


def planned_for(plan: Mapping) -> str:
    """The values the planner's figure is for, in words (the plan record of run_summary.json)."""
    values = plan.get("values") or {}
    memory = plan.get("memory") or {}
    micro = (values.get("per_device_train_batch_size") or {}).get("used")
    seq = (memory.get("planned_for") or {}).get("seq_len")
    processes = plan.get("num_processes")
    parts = (plan.get("strategy"), micro and f"micro-batch {micro}", seq and f"seq {seq}",
             (values.get("precision") or {}).get("used"), processes and f"{processes} process(es)")
    return ", ".join(str(p) for p in parts if p)


def read_run(name: str, out: Path, peaks_dir: Path | None = None) -> RunRecord:
    """The run in ``out`` (trainer_state.json, run_summary.json, hf_gpu_train_run.json, model.safetensors) and its peak
    files."""
    losses, norms = read_log_history(json.loads((out / "trainer_state.json").read_text()))
    summary = json.loads((out / "run_summary.json").read_text()) if (out / "run_summary.json").is_file() else {}
    plan = summary.get("plan") or {}
    record = json.loads((out / RECORD).read_text()) if (out / RECORD).is_file() else {}
    # the precision the run decided and trained in (the plan's value is only what was planned)
    precision = record.get("precision") or ((plan.get("values") or {}).get("precision") or {}).get("used")
    weights = out / "model.safetensors"
    return RunRecord(name, losses, norms, precision, (plan.get("memory") or {}).get("estimate_bytes"), planned_for(plan),
                     read_peaks(peaks_dir) if peaks_dir else {}, weights if weights.is_file() else None)


# --- the comparisons ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeriesDiff:
    steps: int  # compared
    max_abs: float
    max_rel: float  # relative to the plain run's value
    worst_step: int  # 1-based, where max_rel is
    same_length: bool


def series_diff(got: Sequence[float], expected: Sequence[float]) -> SeriesDiff:
    """The largest difference between two per-step series; a NaN on either side is infinitely far."""
    worst_abs, worst_rel, at = 0.0, 0.0, 0
    for step, (a, b) in enumerate(zip(got, expected), 1):
        d = abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
        rel = d / max(abs(b), 1e-12) if math.isfinite(d) else math.inf
        if at == 0 or rel > worst_rel:
            worst_rel, at = rel, step
        worst_abs = max(worst_abs, d)
    return SeriesDiff(min(len(got), len(expected)), worst_abs, worst_rel, at, len(got) == len(expected) and bool(got))


LEGACY_NAMES = ((".gamma", ".weight"), (".beta", ".bias"))


def canonical_names(tensors: Mapping[str, object]) -> dict[str, object]:
    """The tensors by their modern names: under ZeRO-3 transformers writes BERT's LayerNorm weights by their legacy names
    (gamma, beta) and maps them back when it loads them; here the same map on a file's keys."""
    renamed = {}
    for key, value in tensors.items():
        for old, new in LEGACY_NAMES:
            if key.endswith(old) and "LayerNorm" in key:
                key = key[: -len(old)] + new
        renamed[key] = value
    return renamed


@dataclass(frozen=True)
class WeightsDiff:
    max_abs: float  # the raw difference, the rounding to 16 bits included
    worst: str  # the tensor of max_abs
    fraction_of_movement: float | None  # ||difference beyond the rounding|| / ||expected - initial||; None: no initial
    compared: int  # tensors
    missing: tuple[str, ...]  # in one file only, or of another shape
    rounding: str | None  # the 16-bit dtype whose rounding is allowed for, if the ZeRO run saved one


def compare_weights(got: Mapping, expected: Mapping, initial: Mapping | None = None) -> WeightsDiff:
    """The ZeRO run's saved weights (``got``) against the plain run's (``expected``), and how far the plain run moved
    them from ``initial``. Where ZeRO saved 16-bit weights (its module's copy of the fp32 masters) against fp32 ones,
    each element may differ by one rounding to that dtype (eps/2 of its size) before it counts: the rounding is not a
    difference of training."""
    import torch  # lazy: the checking process imports torch to compare weights only

    got, expected = canonical_names(got), canonical_names(expected)
    initial = canonical_names(initial) if initial is not None else None
    # a tied output head is one tensor, saved once: a file with the head and another without it hold the same weights
    missing = sorted(k for k in set(got) ^ set(expected) if not k.endswith("lm_head.weight"))
    worst, worst_key, beyond_sq, move_sq, rounding, compared = 0.0, "", 0.0, 0.0, None, 0
    for key, b in expected.items():
        a = got.get(key)
        if a is None or not torch.is_floating_point(b):
            continue
        if a.shape != b.shape:
            missing.append(f"{key} (shape {tuple(a.shape)} against {tuple(b.shape)})")
            continue
        compared += 1
        diff = (a.double() - b.double()).abs()
        top = diff.max().item() if diff.numel() else 0.0
        if not worst_key or top > worst:
            worst, worst_key = top, key
        if a.dtype in (torch.bfloat16, torch.float16) and b.dtype == torch.float32:
            rounding = str(a.dtype).removeprefix("torch.")
            diff = (diff - torch.finfo(a.dtype).eps / 2 * b.double().abs()).clamp_min(0)
        beyond_sq += float((diff ** 2).sum())
        if initial is not None and key in initial:
            move_sq += float(((b.double() - initial[key].double()) ** 2).sum())
    fraction = None
    if initial is not None:
        fraction = math.sqrt(beyond_sq) / math.sqrt(move_sq) if move_sq > 0 else math.inf
    return WeightsDiff(worst, worst_key, fraction, compared, tuple(missing), rounding)


@dataclass(frozen=True)
class Comparison:
    name: str
    loss: SeriesDiff
    grad_norm: SeriesDiff
    weights: WeightsDiff | None
    tolerance: Tolerance
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def tolerance_for(precision: str | None) -> Tolerance:
    """The run's precision's tolerance (None: an fp32 run without a plan record)."""
    return TOLERANCES.get(precision or "fp32", TOLERANCES["bf16"])


def compare_runs(zero: RunRecord, plain: RunRecord, weights: WeightsDiff | None) -> Comparison:
    """One ZeRO run against the plain run: as many logged steps, each loss and gradient norm within the precision's
    tolerance, the same tensors, and the weights within their fraction of the movement."""
    tol = tolerance_for(zero.precision or plain.precision)
    loss, norm = series_diff(zero.losses, plain.losses), series_diff(zero.grad_norms, plain.grad_norms)
    problems = []
    if not loss.same_length:
        problems.append(f"{len(zero.losses)} logged step(s) against the plain run's {len(plain.losses)}")
    if loss.max_rel > tol.loss_rtol:
        problems.append(f"loss {_rel(loss.max_rel)} apart at step {loss.worst_step} (tolerance {_rel(tol.loss_rtol)})")
    if norm.max_rel > tol.grad_norm_rtol:
        problems.append(f"gradient norm {_rel(norm.max_rel)} apart at step {norm.worst_step} (tolerance "
                        f"{_rel(tol.grad_norm_rtol)})")
    if weights is None:
        problems.append("no saved weights to compare")
    else:
        if weights.missing:
            problems.append(f"tensors in one model only: {', '.join(weights.missing[:5])}")
        if weights.fraction_of_movement is not None and not weights.fraction_of_movement <= tol.weights_fraction:
            problems.append(f"weights apart by {_rel(weights.fraction_of_movement)} of the training's movement (tolerance "
                            f"{_rel(tol.weights_fraction)})")
    return Comparison(zero.name, loss, norm, weights, tol, tuple(problems))


def _rel(x: float) -> str:
    """A relative difference: percent where it reads (1e-4 and above), else in powers of ten."""
    return f"{x:.2%}" if x >= 1e-4 or x == 0 else f"{x:.1e}"


def equality_line(c: Comparison) -> str:
    """One line: the largest differences of each kind, and the verdict."""
    w = c.weights
    if w is None:
        weights = "no weights"
    else:
        beyond = "" if w.fraction_of_movement is None else (
            f"; {_rel(w.fraction_of_movement)} of the training's movement"
            + (f" beyond one {w.rounding} rounding" if w.rounding else ""))
        weights = f"weights max |diff| {w.max_abs:.2e} ({w.worst or '-'}{beyond})"
    verdict = "OK" if c.ok else "FAILED: " + "; ".join(c.problems)
    return (f"{c.name} vs {PLAIN} ({c.loss.steps} steps): loss max |diff| {c.loss.max_abs:.2e} ({_rel(c.loss.max_rel)}), "
            f"grad norm max |diff| {c.grad_norm.max_abs:.2e} ({_rel(c.grad_norm.max_rel)}), {weights}: {verdict}")


def memory_verdict(measured: int | None, planned: int | None) -> tuple[str, bool]:
    """(words, ok): the planner covers a measured peak when its figure is at least the peak."""
    if measured is None:
        return "no CUDA peak (a CPU run)", True
    if planned is None:
        return "no planner figure (the run had no memory plan)", False
    error = 100.0 * (measured - planned) / planned
    if measured <= planned:
        return f"covered (measured {error:+.1f}% against the planner)", True
    return f"UNDER-COUNTED: measured {error:+.1f}% over the planner", False


def memory_lines(run: RunRecord) -> tuple[list[str], bool]:
    """Each rank's allocated peak (its reserved peak beside it) against the planner's figure for the run's values."""
    planner = f"planner {gib(run.planner_bytes, 2)}" + (f" ({run.planned_for})" if run.planned_for else "")
    if not run.peaks:
        return [f"{run.name}: no peak file (the run did not finish); {planner}"], False
    lines, ok = [], True
    for rank, peak in sorted(run.peaks.items()):
        words, fine = memory_verdict(peak.allocated_bytes, run.planner_bytes)
        ok = ok and fine
        measured = ("-" if peak.allocated_bytes is None else
                    f"{gib(peak.allocated_bytes, 2)} (reserved {gib(peak.reserved_bytes, 2)})")
        lines.append(f"{run.name} rank {rank}: max_memory_allocated {measured}; {planner}: {words}")
    return lines, ok


def world_size_for(gpu_count: int) -> tuple[int, str]:
    """(processes of each ZeRO run, why): 2 where two GPUs are visible, else 1."""
    if gpu_count >= 2:
        return 2, f"{gpu_count} GPUs visible: each ZeRO run on 2 processes (NCCL), the plain run on one"
    return 1, ("one GPU: world size 1 (two NCCL ranks cannot share a GPU); ZeRO partitions over one rank, its memory is "
               "the planner's figure for N = 1")


def skip_reason(cuda_available: bool, deepspeed_installed: bool) -> str | None:
    """Why the section cannot run here (None: it can)."""
    if not cuda_available:
        return ("no CUDA device: skipped (the memory per rank needs a GPU; the equality on CPU processes is "
                "tests/scaling/test_deepspeed_equivalence.py)")
    if not deepspeed_installed:
        return "deepspeed is not installed: skipped (pip install deepspeed, or pip install -e '.[dev]')"
    return None


# --- running the cases ----------------------------------------------------------------------------------------------


@dataclass
class Launched:
    """One run: its `hf-gpu-train config` and `launch` command lines, where it writes, and how it went."""

    name: str
    out: Path
    peaks: Path
    log: Path
    config_cmd: list[str]
    cmd: list[str]
    env: dict
    proc: subprocess.Popen | None = None
    started: float = 0.0
    wall_s: float | None = None
    returncode: int | None = None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.is_file() else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_dropout(config) -> list[str]:
    """Every dropout probability of a transformers config set to 0, in place; the names set. A dropout mask is drawn per
    process: two processes drawing for half the batch each are not one process drawing for all of it, so a run on 2
    GPUs could not equal the plain run with dropout on (tests/scaling/finetune_cases.py has none either)."""
    changed = []
    for name, value in sorted(vars(config).items()):
        if "dropout" in name and isinstance(value, float) and value > 0:
            setattr(config, name, 0.0)
            changed.append(name)
    return changed


@dataclass(frozen=True)
class Start:
    """Where every run of a case starts: the model directory (the planner's --model, and the initial weights the
    movement is measured from), and the ``model=`` the runs get (None: the recipe's own)."""

    model_dir: str
    run_model: str | None


def prepare_start(case: ZeroCase, folder: Path) -> Start:
    """Text classification: the recipe's model with the head for this data's labels, initialised once here and saved
    without dropout (under ZeRO-3 the head would be drawn on the GPU inside zero.Init, from another random stream than
    the plain run's; ``without_dropout``: why). A causal LM: the recipe's own model (SmolLM2: converted once), every
    weight pretrained."""

    cfg = load_config(resolve_recipe(case.recipe), list(case.overrides))
    if cfg.task != "text-classification":
        return Start(task_for(cfg.task).planner_model(cfg), None)
    from transformers import set_seed  # lazy: torch

    set_seed(cfg.seed)
    names = task_for(cfg.task).open(cfg).label_names
    model, tokenizer = load_text_model(cfg.model, names)
    without_dropout(model.config)
    start = folder / "start"
    model.save_pretrained(start)
    tokenizer.save_pretrained(start)
    write_label_map(start, names)
    return Start(str(start), str(start))


def plan_runs(root: Path, case: ZeroCase, folder: Path, processes: int,
              machine_for: Callable[[int], list[str]]) -> tuple[list[Launched], str]:
    """The plain run and one per ZeRO stage, ready to configure and start (``machine_for(n)``: the config options for n
    processes); the starting model directory."""

    start = prepare_start(case, folder)
    seq_len = load_config(resolve_recipe(case.recipe), list(case.overrides)).max_length
    pythonpath = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    runs = []
    for strategy in (PLAIN, *ZERO_STRATEGIES):
        n = 1 if strategy == PLAIN else processes
        config = folder / strategy
        config_cmd = [sys.executable, "-m", "hf_gpu_train", "config", *machine_for(n),
                      *([] if strategy == PLAIN else ["--strategy", strategy]), "--model", start.model_dir, "--seq-len",
                      str(seq_len), "--global-batch", str(case.global_batch), "--output", str(config)]
        out = folder / f"{strategy}-out"
        args = ["--config", case.recipe, *case.overrides, *COMMON, *([f"model={start.run_model}"] if start.run_model else []),
                f"max_steps={case.steps}", f"per_device_train_batch_size={case.global_batch // n}",
                f"global_batch_size={case.global_batch}", f"output_dir={out}"]
        cmd = [sys.executable, "-m", "hf_gpu_train", "launch", "--main_process_port", str(_free_port()), "--config-file",
               f"{config}.yaml", PROBE_SCRIPT, *args]
        peaks = folder / f"{strategy}-peaks"
        runs.append(Launched(strategy, out, peaks, folder / f"{strategy}.log", config_cmd, cmd,
                             {**os.environ, PEAKS_ENV: str(peaks), "PYTHONPATH": pythonpath}))
    return runs, start.model_dir


def configure_all(runs: Sequence[Launched], root: Path) -> None:
    """Every run's `hf-gpu-train config`, at once (seconds each: the model's config is read)."""
    procs = [(r, subprocess.Popen(r.config_cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
             for r in runs]
    failed = []
    for r, p in procs:
        _, err = p.communicate(timeout=300)
        if p.returncode != 0:
            failed.append(f"hf-gpu-train config for {r.name} ({' '.join(r.config_cmd[3:])}): {err[-1500:]}")
    if failed:
        raise RuntimeError("\n".join(failed))


def run_all(runs: Sequence[Launched], root: Path, together: bool, timeout_s: float) -> None:
    """Start the runs (all at once, or one after another), each writing to its log file, and wait for them until
    ``timeout_s`` after the first start; a run still going then is ended with its workers (its own process group)."""
    deadline = time.monotonic() + timeout_s

    def start(r: Launched) -> None:
        r.started = time.monotonic()
        with open(r.log, "w") as log:
            r.proc = subprocess.Popen(r.cmd, cwd=root, env=r.env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def finish(r: Launched) -> None:
        try:
            r.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait()
            with open(r.log, "a") as log:
                log.write(f"\n(ended: still running {timeout_s:.0f} s after the section's first start)\n")
        r.returncode = r.proc.returncode
        r.wall_s = time.monotonic() - r.started

    if together:
        for r in runs:
            start(r)
        for r in runs:
            finish(r)
    else:
        for r in runs:
            start(r)
            finish(r)


def load_weights(path: Path | str) -> dict:
    """Every tensor of a safetensors file, or of each safetensors file in a directory (a sharded model)."""
    from safetensors.torch import load_file  # lazy: torch

    path = Path(path)
    tensors: dict = {}
    for f in [path] if path.is_file() else sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def report_case(runs: Sequence[Launched], start_model: str) -> bool:
    """Read the finished runs and print a line per run, the equality lines and the memory lines; True when all are OK."""
    ok = True
    records = {}
    for r in runs:
        if r.returncode != 0:
            print(f"{r.name}: FAILED (exit {r.returncode})\n{r.log_tail()}")
            ok = False
            continue
        rec = records[r.name] = read_run(r.name, r.out, r.peaks)
        losses = f"loss {rec.losses[0]:.4f} -> {rec.losses[-1]:.4f}" if rec.losses else "no loss logged"
        print(f"{r.name}: {len(rec.losses)} steps, {losses}, {rec.precision or 'fp32'}, {r.wall_s:.0f} s with start-up")
    plain = records.get(PLAIN)
    if plain is not None and plain.weights is not None:
        expected, initial = load_weights(plain.weights), load_weights(start_model)
        for name in ZERO_STRATEGIES:
            if name in records:
                zero = records[name]
                weights = compare_weights(load_weights(zero.weights), expected, initial) if zero.weights else None
                comparison = compare_runs(zero, plain, weights)
                print(equality_line(comparison))
                ok = ok and comparison.ok
    for rec in records.values():
        lines, fine = memory_lines(rec)
        print("\n".join(lines))
        ok = ok and fine
    return ok


def run_cases(root: Path, cases: Sequence[ZeroCase], processes: int, machine_for: Callable[[int], list[str]], together: bool,
              timeout_s: float) -> bool:
    """Configure every case's runs, run them (``together``: all at once), then print each case's lines."""
    with tempfile.TemporaryDirectory(prefix="zero_check_") as tmp:
        prepared = []
        for case in cases:
            folder = Path(tmp) / case.name
            folder.mkdir()
            prepared.append((case, *plan_runs(root, case, folder, processes, machine_for)))
        every = [r for _, runs, _ in prepared for r in runs]
        configure_all(every, root)
        run_all(every, root, together, timeout_s)
        ok = True
        for case, runs, model in prepared:
            print(f"\n--- zero: {case.name} ({' '.join((case.recipe, *case.overrides))}; {case.steps} steps of "
                  f"{case.global_batch} rows) ---")
            ok = report_case(runs, model) and ok
    return ok


def check_zero(root: Path, cases: Sequence[ZeroCase] = CASES, timeout_s: float = 180.0) -> bool:
    """The section: skipped (True, with the reason) without a GPU or DeepSpeed; else every case's runs at once on the
    GPU(s), then the lines. A run still going ``timeout_s`` after the start is ended (a hang must not eat the rest of
    gpu_check's time) and fails the section."""
    import torch  # lazy: heavy, and only the GPU check calls this

    reason = skip_reason(torch.cuda.is_available(), importlib.util.find_spec("deepspeed") is not None)
    if reason:
        print(reason)
        return True
    processes, why = world_size_for(torch.cuda.device_count())
    print(why)
    start = time.perf_counter()
    ok = run_cases(root, cases, processes, lambda n: ["--gpus", str(n)], together=True, timeout_s=timeout_s)
    print(f"zero: {time.perf_counter() - start:.0f} s in all (configs, runs at once, comparisons)")
    return ok


def rehearse_on_cpu(root: Path, cases: Sequence[ZeroCase], processes: int = 2, timeout_s: float = 1800.0) -> bool:
    """The section's runs on CPU processes (DeepSpeed's CPU accelerator, gloo), one after another: the GPU's path but
    the device; the memory lines say there is no peak."""
    return run_cases(root, cases, processes, lambda n: ["--machine", "cpu-only", "--num-processes", str(n)], together=False,
                     timeout_s=timeout_s)


if __name__ == "__main__":
    exit_process(probe_main(sys.argv[1:]))
