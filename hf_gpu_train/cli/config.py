"""``hf-gpu-train config``: detected hardware -> accelerate YAML + .env + launch command, each value with its reason."""

from __future__ import annotations

import argparse
import re
import shlex
import socket
import sys
from pathlib import Path

from ..errors import UsageError
from ..hardware.snapshot import load_machine
from ..launch.grace import grace_for
from ..launch.render import FINETUNE_ENTRY, accelerate_command, launch_command, render_env, render_yaml, torchrun_command
from ..launch.slurm import check_partition, slurm_time_limit
from ..launch.targets import OPTIONS, TargetSettings, get_target, job_name_for, target_names
from ..plan.deepspeed_config import deepspeed_path_for, render_deepspeed_file
from ..plan.document import no_memory_plan, render_plan_json
from ..plan.model_spec import ModelSpec, resolve_model
from ..plan.planner import STRATEGY_CHOICES, PlanOptions, make_plan
from ..textfmt import table
from .common import add_machine_argument, resolve_profile


def add_planner_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="NAME_OR_PATH", help="model to plan memory for: a local HF directory, a hub id, or a timm name")
    p.add_argument("--params", type=float, help="parameter count instead of --model (e.g. 7e9)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sample (text models)")
    p.add_argument("--image-size", type=int, default=224, help="image side in pixels (vision models)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw-8bit", "sgd", "adafactor"])
    p.add_argument("--global-batch", type=int, default=32, help="target samples per optimizer step over all GPUs")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("config", help="write an accelerate config + .env for this machine (or a snapshot)",
                              description="Plan a launch from detected hardware and write DIR/NAME.yaml (accelerate config), "
                              "DIR/NAME.env (environment for the training processes) and DIR/NAME.plan.json (every decided "
                              "value with its reason, read by the training processes).")
    add_machine_argument(p)
    p.add_argument("--output", required=True, metavar="DIR/NAME", help="writes DIR/NAME.yaml, DIR/NAME.env and DIR/NAME.plan.json")
    p.add_argument("--strategy", default="auto", choices=STRATEGY_CHOICES)
    p.add_argument("--method", default="full", choices=["full", "lora", "qlora"],
                   help="what the run trains, for the memory plan: full fine-tuning, or LoRA/QLoRA adapters on a frozen base "
                   "(task=causal-lm; `hf-gpu-train plan-memory --method auto` compares them)")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank r (with --method lora or qlora)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "fp32", "fp8"])
    p.add_argument("--gpus", default="all", metavar="all|N",
                   help="how many GPUs: all usable, or a count N (the best-connected N: NVLink, then one PCIe switch, "
                   "then one NUMA node). A count, never an index: --gpus 2 means two GPUs, not GPU 2")
    p.add_argument("--gpu-ids", metavar="0,3|MIG-UUID",
                   help="exactly these GPUs, by NVML index (PCI bus order, as nvidia-smi numbers them), or one MIG "
                   "instance by UUID (one process); replaces --gpus")
    p.add_argument("--num-processes", type=int, dest="cpu_processes", help="processes per machine on a machine without GPUs")
    p.add_argument("--num-machines", type=int, default=1)
    p.add_argument("--min-machines", type=int, metavar="N",
                   help="the SLURM job's fewest nodes: after a rank fails, the training starts again in the job's "
                   "allocation on the nodes still usable, if at least N (its global batch kept); fewer requeue the job "
                   "(default: --num-machines)")
    p.add_argument("--machine-rank", type=int, default=0)
    p.add_argument("--main-process-ip")
    p.add_argument("--main-process-port", type=int, default=29500)
    p.add_argument("--node-machines", default="", metavar="FILE_OR_NAME,...",
                   help="snapshots of the other nodes (multi-node): checked to bring the same GPUs as this one")
    p.add_argument("--rdzv-backend", default="static", choices=["static", "c10d"])
    p.add_argument("--include-busy", action="store_true", help="use GPUs where other processes hold memory")
    p.add_argument("--busy-threshold-gib", type=float, default=1.0, help="memory held by others that makes a GPU busy")
    p.add_argument("--debug-nccl", action="store_true", help="add NCCL_DEBUG=INFO and friends to the environment")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.add_argument("--script", default=FINETUNE_ENTRY, help="what the printed commands and the scheduler's files start: the "
                   "fine-tune of the installed package (default: -m hf_gpu_train.finetune, in a pip install and a clone "
                   "alike), or a training script of your own (--script train.py)")
    add_target_arguments(p)
    add_planner_arguments(p)
    p.add_argument("run_args", nargs="*", metavar="-- RUN_ARGS",
                   help="the run's own arguments, after --: they end every printed command and go into the scheduler's "
                   "files (e.g. -- --config minilm_text_demo learning_rate=3e-5); without them the run is the default one")
    return p


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="accelerate", choices=target_names(),
                   help="where the plan runs; each writes its files beside the YAML: accelerate (the YAML, .env and plan; "
                   "a SLURM sbatch for several machines), slurm (NAME.sbatch, also for one machine), kubeflow "
                   "(NAME.trainjob.yaml, Kubeflow Trainer v2), pytorchjob (NAME.pytorchjob.yaml, training-operator v1), "
                   "skypilot (NAME.sky.yaml), ray (NAME.ray.yaml and the ray job submit line: Ray Train)")
    p.add_argument("--image", metavar="IMAGE", help="container image for --target kubeflow and pytorchjob (required there; "
                   "it holds this project at --workdir and hf-gpu-train), or for skypilot to run in")
    p.add_argument("--workdir", metavar="DIR", help="where this project is where the job runs: its directory in the image "
                   "(kubeflow, pytorchjob; default /workspace), or the local directory SkyPilot syncs to every node "
                   "(skypilot; default .). --output must be inside the project")
    p.add_argument("--save-time-from", metavar="OUTPUT_DIR", help="a previous run's output_dir: its measured checkpoint "
                   "save time (preemption.json) sets the grace between the scheduler's stop signal and SIGKILL "
                   "(else estimated from the plan's checkpoint size)")
    p.add_argument("--time-limit", metavar="TIME", help="SLURM --time of the sbatch, e.g. 04:00:00 or 2-00:00:00")
    p.add_argument("--partition", metavar="NAME", help="SLURM partition of the sbatch")
    p.add_argument("--checkpoint-volume", metavar="CLAIM", help="for --target kubeflow and pytorchjob: a PersistentVolumeClaim "
                   "(yours, made beforehand; ReadWriteMany for several nodes) mounted at WORKDIR/outputs in every pod, "
                   "where every shipped recipe's output_dir is, so the checkpoints outlive the pod and a restarted "
                   "container resumes from them (without it they are lost with the pod, and config says so)")


CLAIM_NAME = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # a DNS subdomain


def target_settings(args: argparse.Namespace, target) -> dict:
    """The checked values of the target options (UsageError for one the target does not read, or a bad value)."""
    given = {key: getattr(args, key) for key in OPTIONS if getattr(args, key) is not None}
    unread = [key for key in given if key not in target.reads]
    if unread:
        key = unread[0]
        users = [name for name in target_names() if key in get_target(name).reads]
        raise UsageError(f"{OPTIONS[key]} {given[key]}: --target {target.name} has no use for it "
                         f"(it is for --target {' or '.join(users)})")
    if target.needs_image and not (args.image or "").strip():
        raise UsageError(f"--target {target.name} needs --image IMAGE: the container image every pod runs, holding "
                         f"hf-gpu-train and this project at --workdir (default /workspace), e.g. --image ghcr.io/you/train:1")
    if args.image is not None and (not args.image.strip() or any(c.isspace() for c in args.image)):
        raise UsageError(f"--image {args.image!r}: an image reference has no spaces (e.g. ghcr.io/you/train:1)")
    if args.time_limit is not None:
        slurm_time_limit(args.time_limit)
    if args.partition is not None:
        check_partition(args.partition)
    if args.checkpoint_volume is not None and not CLAIM_NAME.fullmatch(args.checkpoint_volume):
        raise UsageError(f"--checkpoint-volume {args.checkpoint_volume!r}: the name of a PersistentVolumeClaim (lower-case "
                         "letters, digits, '-' and '.', from and to a letter or digit, at most 253), e.g. "
                         "--checkpoint-volume train-checkpoints")
    if args.save_time_from is not None and not Path(args.save_time_from).is_dir():
        raise UsageError(f"--save-time-from {args.save_time_from}: no such directory: give a previous run's output_dir "
                         "(it holds preemption.json), or leave the option out to estimate the grace from the plan")
    return {key: getattr(args, key) for key in OPTIONS}


def model_spec_from_args(args: argparse.Namespace):

    if args.model and args.params:
        raise UsageError("give --model or --params, not both")
    if args.model:
        return resolve_model(args.model, args.image_size)
    if args.params:
        if args.params <= 0:
            raise UsageError(f"--params {args.params}: must be positive")
        return ModelSpec(name=f"{args.params:.3g} parameters", params=int(args.params))
    return None


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def run(args: argparse.Namespace) -> int:

    target = get_target(args.target)
    chosen = target_settings(args, target)
    if args.min_machines is not None and not (args.target == "slurm" or (args.target == "accelerate" and args.num_machines > 1)):
        raise UsageError(f"--min-machines {args.min_machines}: for the SLURM sbatch (--target slurm, or --num-machines above 1); "
                         f"--target {args.target} writes none. Elsewhere `hf-gpu-train launch --nnodes MIN:MAX` goes on "
                         "with fewer nodes")
    out = Path(args.output)
    job_name = job_name_for(out.name)
    main_process_ip = args.main_process_ip
    if args.num_machines > 1 and not main_process_ip and target.main_node is not None:
        main_process_ip = target.main_node(job_name)  # the scheduler's address of machine rank 0
    profile, live = resolve_profile(args)
    options = PlanOptions(
        strategy=args.strategy, precision=args.precision, gpus=args.gpus, gpu_ids=args.gpu_ids, num_machines=args.num_machines,
        machine_rank=args.machine_rank, main_process_ip=main_process_ip, main_process_port=args.main_process_port,
        rdzv_backend=args.rdzv_backend, cpu_processes=args.cpu_processes, include_busy=args.include_busy,
        busy_threshold_bytes=int(args.busy_threshold_gib * 2**30), debug_nccl=args.debug_nccl,
        model=model_spec_from_args(args), seq_len=args.seq_len, image_size=args.image_size, optimizer=args.optimizer,
        method=args.method, lora_rank=args.lora_rank, global_batch=args.global_batch,
        other_nodes=tuple(load_machine(n) for n in args.node_machines.split(",") if n.strip()),
    )
    plan = make_plan(profile, options)
    yaml_path, env_path, plan_path = (out.with_name(out.name + suffix) for suffix in (".yaml", ".env", ".plan.json"))
    run_args = tuple(args.run_args)
    settings = TargetSettings(output=out, job_name=job_name, grace=grace_for(plan, args.save_time_from), run_args=run_args,
                              min_machines=args.min_machines, **chosen)
    rendered = target.render(plan, yaml_path, args.script, settings)
    ours = (yaml_path, env_path, plan_path) + ((deepspeed_path_for(yaml_path),) if plan.deepspeed_file is not None else ())
    ours += tuple(path for path, _ in rendered.files)
    existing = [p for p in ours if p.exists()]
    if existing and not args.force:
        raise UsageError(f"{', '.join(map(str, existing))} already exist(s): pass --force to overwrite, or another --output")
    command = "hf-gpu-train " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["config"] else f"hf-gpu-train config --output {out}"
    yaml_path.parent.mkdir(parents=True, exist_ok=True)
    written = []
    deepspeed_path = None
    if plan.deepspeed_file is not None:  # ZeRO-Offload's optimizer section (plan/deepspeed_config.py)
        deepspeed_path = deepspeed_path_for(yaml_path)
        deepspeed_path.write_text(render_deepspeed_file(plan.deepspeed_file))
        written.append(deepspeed_path)
    yaml_path.write_text(render_yaml(plan, command, deepspeed_path))
    env_path.write_text(render_env(plan))
    plan_path.write_text(render_plan_json(plan, command, yaml_path))
    written = [yaml_path, env_path, plan_path, *written]
    for path, text in rendered.files:
        path.write_text(text)
        written.append(path)
    print(f"Plan for {plan.machine}: {plan.strategy}")
    print(table([["Setting", "Value", "Reason"]] + [[s.key, s.value, s.reason] for s in plan.settings]))
    if plan.memory:
        m = plan.memory
        print(f"\nMemory per GPU ({m.strategy}, micro-batch {m.micro_batch}): "
              + ", ".join(f"{name} {value / 2**30:.2f} GiB" for name, value in m.breakdown.rows() if value)
              + f"; total {m.breakdown.total / 2**30:.2f} of {m.gpu_memory_bytes / 2**30:.1f} GiB")
    else:
        print(f"\nNo memory plan: {no_memory_plan(plan)}.")
    if live and options.machine_rank == 0 and options.num_machines > 1 and port_in_use(options.main_process_port):
        print(f"\nwarning: port {options.main_process_port} is in use on this machine: pick another --main-process-port")
    print("\nWrote " + ", ".join(map(str, written)))
    # hf-gpu-train launch applies a taskset binding itself; the other commands carry it as a prefix.
    print(f"\nLaunch:\n  {launch_command(yaml_path, args.script, run_args)}")
    print(f"or with plain accelerate:\n  {accelerate_command(yaml_path, args.script, plan, run_args)}")
    print(f"or with torchrun:\n  {torchrun_command(plan, args.script, yaml_path, run_args)}")
    for line in rendered.lines:
        print(line)
    return 0
