"""The fine-tune on Ray Train: ``python -m hf_gpu_train.finetune.ray_train --num-workers N [--address auto] --config
NAME_OR_PATH key=value...`` runs the run spine (``run.FinetuneRun``: setup -> train -> finish, as ``scripts/finetune.py``
runs it) as each worker's ``train_func`` inside ``ray.train.torch.TorchTrainer``. Ray starts the workers and makes the
process group (gloo on CPU workers, NCCL on GPU ones); the run finds it made and uses it as it would torchrun's.

What Ray adds, and what it changes:

- ``RayTrainReportCallback`` reports every checkpoint the Trainer saves to Ray (a copy under ``--storage-path``), and
  ``prepare_trainer`` lets the Trainer read Ray Data iterables; the final metrics are reported last.
- A worker that dies (``--max-failures N``: Ray's ``FailureConfig``) is restarted with the whole group; the run resumes
  as the same command again would (``resume=auto``: the newest complete checkpoint in ``output_dir``). Ray's newest
  checkpoint is compared with it first (``agree_on_resume``): the same step, said; one Ray holds that ``output_dir`` does
  not (another node's disk) is copied back into ``output_dir`` first.
- The pieces (in-place OOM recovery, the watchdog, telemetry, preemption) come through ``attach_pieces`` as in every run.
  Ray runs ``train_func`` on a thread of the worker: what needs the main thread (signal handlers: preemption) steps
  aside with its one line; the watchdog's word between ranks goes through the c10d store of the group Ray made.
- Relative paths in the config are read from the directory the driver was started in (Ray's workers start in a
  directory of their own), when that directory is on the worker's node (the same machine, a shared file system, or the
  working directory ``ray job submit --working-dir`` uploads); else from the worker's own, said in one line.

A usage error (a bad key, a dataset path that is not there) is one line and exit 2, as ``scripts/finetune.py``'s: found
on the driver before a worker starts where it can be, else by the workers (the driver prints their line).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError, report_usage_error
from ..faults.checkpoint_marker import COMPLETE_MARKER, SAVING, last_complete_checkpoint, set_aside
from ..launch.rank_report import HANG_EXIT_CODE
from ..launch.ray_job import QUIET_PRINT
from ..process_group import rendezvous_store
from .config import FinetuneConfig
from .launch_plan import apply_launch_plan
from .loading import load_config_and_keys, read_config_values
from .run import FinetuneRun, parse_args

RAY_MISSING = "Ray Train is not installed here: pip install 'hf-gpu-train[ray]' (ray[train] 2.x)"
RAY_CHECKPOINT = "checkpoint"  # RayTrainReportCallback.CHECKPOINT_NAME: the Trainer's checkpoint inside Ray's
PROG = "python -m hf_gpu_train.finetune.ray_train"


class WorkerUsageError(Exception):
    """A usage error met by a worker, carried to the driver by its message alone (the driver prints it, exit 2)."""


@dataclass(frozen=True)
class RayOptions:
    """How many workers and what each holds: ``ray.train.ScalingConfig``, ``FailureConfig`` and ``RunConfig``."""

    num_workers: int = 2
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 1.0  # with use_gpu
    address: str | None = None  # None: RAY_ADDRESS, else a local cluster started for this run
    max_failures: int = 0
    storage_path: str | None = None  # None: output_dir/ray
    name: str = "finetune"

    def resources_per_worker(self) -> dict:
        return {"CPU": self.cpus_per_worker, **({"GPU": self.gpus_per_worker} if self.use_gpu else {})}


def parse_ray_args(argv: list[str] | None) -> tuple[RayOptions, str | None, list[str]]:
    """(Ray's options, recipe, key=value overrides): the Ray options here, the rest as ``scripts/finetune.py`` reads it."""
    parser = argparse.ArgumentParser(
        prog=PROG, add_help=False,
        description="Fine-tune on a Ray cluster: each Ray Train worker runs the fine-tune (--config and key=value as "
        "for scripts/finetune.py).")
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--num-workers", type=int, default=2, help="training processes (Ray Train workers)")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker (NCCL); without it: CPU workers, gloo")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--gpus-per-worker", type=float, default=1.0)
    parser.add_argument("--address", help="the Ray cluster (auto: the one on this machine; default: RAY_ADDRESS, else a "
                        "local cluster for this run)")
    parser.add_argument("--max-failures", type=int, default=0,
                        help="restarts of the worker group after a worker fails; each resumes from the newest complete checkpoint")
    parser.add_argument("--storage-path", help="where Ray keeps the reported checkpoints (default: output_dir/ray; on "
                        "several nodes a shared path)")
    parser.add_argument("--name", default="finetune", help="the Ray Train run's name under --storage-path")
    known, rest = parser.parse_known_args(argv)
    if known.help:
        parser.print_help()
        parse_args(["--help"], PROG)  # the fine-tune's own arguments; exits
    if known.num_workers < 1:
        raise UsageError(f"--num-workers {known.num_workers}: at least 1")
    for flag, value in (("--cpus-per-worker", known.cpus_per_worker), ("--gpus-per-worker", known.gpus_per_worker)):
        if value <= 0:
            raise UsageError(f"{flag} {value:g}: must be above 0 (a fraction shares a CPU or GPU between workers)")
    options = RayOptions(num_workers=known.num_workers, use_gpu=known.use_gpu, cpus_per_worker=known.cpus_per_worker,
                         gpus_per_worker=known.gpus_per_worker, address=known.address, max_failures=known.max_failures,
                         storage_path=known.storage_path, name=known.name)
    recipe, overrides = parse_args(rest, PROG)
    return options, recipe, overrides


# ---- in each worker


def _step(checkpoint: Path) -> int | None:
    try:
        return int(json.loads((checkpoint / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError):
        return None


def agree_on_resume(cfg: FinetuneConfig, ray_checkpoint: Path | None, copies: bool) -> tuple[int | None, str | None]:
    """Ray's newest reported checkpoint (``ray_checkpoint``: the Trainer's folder inside it) against what ``resume=auto``
    takes from ``output_dir`` after a restart: (the step the run resumes from as far as the files tell, None: from the
    start; a line saying how they compare, or None). A Ray checkpoint newer than every complete one in ``output_dir``
    (the worker's node cannot see the disk it was saved on) is copied into ``output_dir/checkpoint-N`` when ``copies``
    (one process per node): the run's own resume then takes it. With ``resume`` named or ``never`` Ray's is not used."""
    ours = last_complete_checkpoint(cfg.output_dir, set_aside_incomplete=False)
    ours_step = _step(ours) if ours is not None else None
    theirs = _step(ray_checkpoint) if ray_checkpoint is not None else None
    if theirs is None:
        return ours_step, None
    if cfg.resume != "auto":
        return None, f"ray: Ray's newest checkpoint is step {theirs}; resume={cfg.resume} decides where this run starts"
    if ours_step is not None and ours_step >= theirs:
        if ours_step == theirs:
            return ours_step, f"ray: Ray's newest checkpoint and output_dir's newest complete one are the same, step {theirs}"
        return ours_step, (f"ray: resuming from {ours}, newer than Ray's newest checkpoint (step {theirs}): saved and "
                           "marked complete before Ray heard of it")
    if not (ray_checkpoint / COMPLETE_MARKER).is_file():
        return ours_step, f"ray: Ray's newest checkpoint (step {theirs}) has no completion marker: not taken"
    target = Path(cfg.output_dir) / f"checkpoint-{theirs}"
    if copies:
        # a rank's copy may hold the note of the save in progress, taken before the main process marked it complete
        staging = target.with_name(f".{target.name}.from-ray")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(ray_checkpoint, staging, ignore=shutil.ignore_patterns(SAVING))
        if target.exists():  # a half-written one of the same step on this node: set aside, never deleted
            set_aside(target)
        os.replace(staging, target)
    return theirs, (f"ray: output_dir held {'no complete checkpoint' if ours is None else f'step {ours_step}'}, Ray's newest "
                    f"is step {theirs}: copied to {target} to resume from")


def _ray_checkpoint_then(cfg: FinetuneConfig, work):
    """``work(the Trainer's folder inside Ray's newest checkpoint, or None)``, with that folder on this node."""
    import ray.train  # lazy: optional dependency (the [ray] extra), imported only inside a Ray worker

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return work(None)
    with checkpoint.as_directory() as folder:
        return work(Path(folder) / RAY_CHECKPOINT)


def report_after_marker(report, wait_s: float = 120.0):
    """``RayTrainReportCallback`` that, on a rank other than the main one, waits (bounded) for the main process to mark a
    checkpoint complete before copying it: on a shared folder the copy would otherwise race the marker, and Ray would
    hold a checkpoint with the ``SAVING`` note of a save that finished. On a node that sees no note, nothing waits."""
    copy = report.on_save

    def on_save(args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        deadline = time.monotonic() + wait_s
        while (folder / SAVING).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return copy(args, state, control, **kwargs)

    report.on_save = on_save  # the Trainer's callback handler calls the instance's on_save
    return report


def train_func(config: dict) -> None:
    """Each Ray Train worker's loop: the fine-tune of ``config["recipe"]`` with ``config["overrides"]`` through the run
    spine, checkpoints and final metrics reported to Ray. ``config["callbacks"]``: more Trainer callbacks (tests)."""
    import ray.train  # lazy: optional dependency, in the worker only
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer  # lazy: optional dependency

    try:
        _work_where_the_driver_did(config.get("cwd"))
        recipe, overrides = config["recipe"], list(config["overrides"])
        cfg, explicit = load_config_and_keys(recipe, overrides)
        cfg, plan = apply_launch_plan(cfg, explicit, recipe=recipe, overrides=tuple(overrides),
                                      command_line_keys=frozenset(read_config_values(None, overrides)))
        context = ray.train.get_context()
        resumed, line = _ray_checkpoint_then(cfg, lambda folder: agree_on_resume(cfg, folder, copies=context.get_local_rank() == 0))
        _barrier()  # a checkpoint copied back into output_dir is there for every rank of the node before any looks
        if line and context.get_world_rank() == 0:
            print(f"hf_gpu_train: {line}", flush=True)
        callbacks = [*config.get("callbacks", ()), report_after_marker(RayTrainReportCallback())]
        run = FinetuneRun(cfg, extra_callbacks=callbacks, launch_plan=plan)
        finished = run.setup()
        if finished is None:
            _say_store(context.get_world_size())
            prepare_trainer(run.trainer)
            run.train()
            finished = run.finish()
            resumed = run.first_step or None
    except UsageError as error:
        raise WorkerUsageError(str(error)) from None
    ray.train.report(metrics={**{k: v for k, v in finished.items() if isinstance(v, (int, float))},
                              "resumed_from_step": resumed or 0})


def _work_where_the_driver_did(cwd: str | None) -> None:
    if cwd is None or Path.cwd() == Path(cwd):
        return
    if Path(cwd).is_dir():
        os.chdir(cwd)
    elif os.environ.get("RANK", "0") == "0":
        print(f"hf_gpu_train: ray: the driver's directory {cwd} is not on this node: relative paths in the config are read "
              f"from {Path.cwd()} (give absolute paths, or ray job submit --working-dir)", flush=True)


def _barrier() -> None:
    import torch.distributed as dist  # lazy: the driver imports no torch

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _say_store(world_size: int) -> None:
    """The watchdog tells the other ranks of a hang through the group's c10d store: say so when Ray's group has none."""
    if world_size > 1 and rendezvous_store() is None and os.environ.get("RANK", "0") == "0":
        print("hf_gpu_train: ray: the process group has no c10d store the watchdog can use: each rank watches alone "
              "(a hang ends the run without the other ranks' stacks)", flush=True)


# ---- the driver

def worker_runtime_env(environ=os.environ) -> dict:
    """The job's runtime_env for a cluster this driver starts or joins (``ray job submit`` brings NAME.ray.yaml's):
    ``QUIET_PRINT`` (launch/ray_job.py: why), unless set here already."""
    return {"env_vars": {k: environ.get(k, v) for k, v in QUIET_PRINT.items()}}


def fit(recipe: str | None, overrides: list[str], options: RayOptions, callbacks=()):
    """Run the fine-tune on ``options.num_workers`` Ray Train workers; Ray's ``Result``. The config is read here first:
    a usage error is said before a worker starts."""
    cfg, _ = load_config_and_keys(recipe, overrides)
    try:
        import ray  # lazy: optional dependency (the [ray] extra)
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        raise UsageError(RAY_MISSING) from None

    if not ray.is_initialized():
        if options.address is None and not os.environ.get("RAY_ADDRESS"):
            ray.init(include_dashboard=False, runtime_env=worker_runtime_env())  # a local cluster for this run
        elif os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):  # inside `ray job submit`: the job's runtime_env holds
            ray.init(address=options.address)
        else:
            ray.init(address=options.address, runtime_env=worker_runtime_env())
    storage = Path(options.storage_path or Path(cfg.output_dir) / "ray").absolute()
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"recipe": recipe, "overrides": list(overrides), "cwd": os.getcwd(), "callbacks": list(callbacks)},
        scaling_config=ScalingConfig(num_workers=options.num_workers, use_gpu=options.use_gpu,
                                     resources_per_worker=options.resources_per_worker()),
        torch_config=TorchConfig(backend="nccl" if options.use_gpu else "gloo",
                                 timeout_s=int(cfg.extra.get("ddp_timeout", 1800))),
        run_config=RunConfig(name=options.name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=options.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.save_total_limit)),
    )
    return trainer.fit()


def worker_usage_error(error: BaseException) -> str | None:
    """The usage error a worker met, from the error ``TorchTrainer.fit`` raised; None for any other failure."""
    seen, stack = set(), [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, WorkerUsageError):
            return str(current)
        stack += [getattr(current, "cause", None), current.__cause__, current.__context__,
                  *getattr(current, "worker_failures", {}).values()]
    return None


def hang_line(output_dir: str | Path, since: float) -> str | None:
    """The watchdog's first line when it ended this run (a ``hang-*`` folder in ``output_dir`` written after ``since``,
    where the driver can see it): Ray itself only says that a worker died."""
    found = [p for p in Path(output_dir).glob("hang-*/summary.txt") if p.stat().st_mtime >= since]
    if not found:
        return None
    newest = max(found, key=lambda p: p.stat().st_mtime)
    first = newest.read_text().splitlines()[:1]
    return f"the watchdog ended the run: {first[0] if first else ''} (summary: {newest})"


def main(argv: list[str] | None = None, callbacks=()) -> int:
    """The entry point; ``callbacks``: more Trainer callbacks for every worker (picklable; the tests' probes)."""
    started = time.time()
    try:
        options, recipe, overrides = parse_ray_args(argv)
        result = fit(recipe, overrides, options, callbacks)
    except UsageError as error:
        report_usage_error(f"ray_train: error: {error}")
        return 2
    except Exception as error:  # noqa: BLE001 - a worker's usage error is one line; anything else keeps its traceback
        message = worker_usage_error(error)
        if message is None:
            hang = hang_line(load_config_and_keys(recipe, overrides)[0].output_dir, started)
            if hang is None:
                raise
            print(f"ray_train: {hang}", file=sys.stderr, flush=True)
            return HANG_EXIT_CODE
        report_usage_error(f"ray_train: error: {message}")
        return 2
    where = f"; Ray's newest checkpoint: {result.checkpoint.path}" if result.checkpoint is not None else ""
    print(f"hf_gpu_train: ray: {options.num_workers} worker(s) finished{where}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
