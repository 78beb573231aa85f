"""Profile + options -> LaunchPlan: the accelerate config, the environment, each value with its reason."""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware.peaks import peak_flops
from ..hardware.profile import GpuInfo, HardwareProfile, MigInstance
from .cpu_binding import CpuBinding, dataloader_workers, decide_cpu_binding, thread_budget
from .decisions import DEFAULT_BUSY_THRESHOLD_BYTES, PlanError, check_homogeneous, decide_precision, nccl_environment
from .deepspeed_config import DEEPSPEED_FILE_PLACEHOLDER, deepspeed_file_for
from .gpus import select_devices
from .lever_plan import lever_settings, plan_with_levers
from .lever_table import pcie_bytes_per_second
from .memory import MemoryPlan, TrainingShape
from .model_spec import ModelSpec
from .scope import hardware_record
from .strategies import (
    ASKABLE,
    AUTO,
    AUTO_CANDIDATES,
    DEEPSPEED,
    EVERYTHING,
    FSDP,
    REPLICATED,
    Strategy,
    replica_strategy,
    strategy,
)

STRATEGY_CHOICES = (AUTO, *ASKABLE)  # --strategy: plan/strategies.py's rows that can be asked for by name
DEFAULT_PORT = 29500
DEFAULT_GLOBAL_BATCH = 32


@dataclass(frozen=True)
class PlanOptions:
    strategy: str = "auto"
    precision: str = "auto"
    gpus: str = "all"  # a count: "all" or N (the best-connected N)
    gpu_ids: str | None = None  # NVML indices "0,3" or one MIG UUID; exclusive with a count
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int = DEFAULT_PORT
    rdzv_backend: str = "static"
    cpu_processes: int | None = None
    include_busy: bool = False
    busy_threshold_bytes: int = DEFAULT_BUSY_THRESHOLD_BYTES
    debug_nccl: bool = False
    model: ModelSpec | None = None
    seq_len: int = 512
    image_size: int = 224
    optimizer: str = "adamw"
    method: str = "full"  # full | lora | qlora: what the run trains (LoRA's frozen base needs no gradients or optimizer states)
    lora_rank: int = 16
    global_batch: int = DEFAULT_GLOBAL_BATCH
    fp8_backend_installed: bool | None = None
    other_nodes: tuple[HardwareProfile, ...] = ()


@dataclass(frozen=True)
class Setting:
    key: str
    value: object
    reason: str


@dataclass(frozen=True)
class LaunchPlan:
    machine: str
    strategy: str
    accelerate: dict
    env: tuple[tuple[str, str, str], ...]
    settings: tuple[Setting, ...]
    gpus: tuple[GpuInfo, ...]
    memory: MemoryPlan | None = None
    mig_instance: MigInstance | None = None  # one process on this MIG instance of gpus[0]
    cpu_binding: CpuBinding | None = None
    options: PlanOptions = PlanOptions()  # what was asked: the model, shape and global batch the memory plan serves
    dataloader_workers: int = 0  # per process
    hardware: dict | None = None  # machine_match.hardware_record of the machine planned for
    # a DeepSpeed config file the accelerate config points to (deepspeed_config.py: ZeRO with CPU offload needs an
    # optimizer section); render_yaml writes its path, `config` writes it as NAME.deepspeed.json
    deepspeed_file: dict | None = None

    @property
    def env_dict(self) -> dict[str, str]:
        return {k: v for k, v, _ in self.env}

    @property
    def processes_per_machine(self) -> int:
        return self.accelerate["num_processes"] // self.accelerate["num_machines"]


def _validate(options: PlanOptions) -> None:
    if options.strategy not in STRATEGY_CHOICES:
        raise PlanError(f"--strategy {options.strategy!r} is not one of {', '.join(STRATEGY_CHOICES)}")
    if options.num_machines < 1:
        raise PlanError(f"--num-machines {options.num_machines}: at least 1")
    if not 0 <= options.machine_rank < options.num_machines:
        raise PlanError(f"--machine-rank {options.machine_rank}: must be in 0..{options.num_machines - 1} for {options.num_machines} machine(s)")
    if options.num_machines > 1 and not options.main_process_ip:
        raise PlanError("--num-machines > 1 needs --main-process-ip (the address of machine rank 0, reachable from every node)")
    if not 1024 <= options.main_process_port <= 65535:
        raise PlanError(f"--main-process-port {options.main_process_port}: use a port in 1024..65535 (default {DEFAULT_PORT})")
    if options.rdzv_backend not in ("static", "c10d"):
        raise PlanError(f"--rdzv-backend {options.rdzv_backend!r}: static or c10d")
    if options.global_batch < 1:
        raise PlanError(f"--global-batch {options.global_batch}: at least 1")
    if options.cpu_processes is not None and options.cpu_processes < 1:
        raise PlanError(f"--num-processes {options.cpu_processes}: at least 1")


def _cpu_processes(profile: HardwareProfile, options: PlanOptions) -> tuple[int, str]:
    if options.cpu_processes:
        return options.cpu_processes, "CPU processes as asked"
    cores = profile.host.physical_cores or profile.host.logical_cores or 1
    count = 2 if cores >= 2 else 1
    return count, f"{count} CPU process(es) on {cores} core(s); gloo DDP (raise with --num-processes)"


def _memory_plan(options, memory, precision, world_size, per_what="GPU", gpu: GpuInfo | None = None,
                 host_ram_bytes: int | None = None, per_machine: int = 1) -> tuple[MemoryPlan | None, str]:
    """(memory plan, strategy) for the GPU case; ``memory`` is what one process can use (a MIG instance's
    share when it runs on one, never the whole GPU's). The memory levers and the last resort: lever_plan.py."""
    multi = world_size > 1
    asked = _asked(options)
    if asked is not None:  # asked for by name: the row's choices (an -offload one: the optimizer in CPU memory only)
        candidates = asked.tries
    else:
        candidates = AUTO_CANDIDATES if multi else (replica_strategy(False),)
    # the last resort (ZeRO-3 with CPU offload) where the planner chooses, or one GPU has nothing else to choose from
    last_resort = asked is None or not asked.several_processes
    if options.method in ("lora", "qlora"):
        _check_adapters_strategy(options)
        if asked is None or asked.family != DEEPSPEED:
            candidates = (replica_strategy(multi),)
    if options.model is None:
        return None, candidates[0]

    shape = TrainingShape(seq_len=options.seq_len, image_size=options.image_size,
                          precision={"no": "fp32", "fp8": "bf16"}.get(precision, precision),
                          optimizer=options.optimizer, num_gpus=world_size, method=options.method, lora_rank=options.lora_rank)
    plan = plan_with_levers(
        options.model, memory, world_size, shape, options.global_batch, candidates,
        last_resort=last_resort and per_what == "GPU",
        peak_flops=peak_flops(gpu.name, shape.precision) if gpu is not None else None,
        pcie_bytes_per_s=pcie_bytes_per_second(gpu.pcie_link_gen, gpu.pcie_link_width) if gpu is not None else None,
        host_ram_bytes=host_ram_bytes, processes_per_machine=per_machine)
    if plan is None:
        raise PlanError(
            f"{options.model.name} ({options.model.params / 1e9:.2f}B parameters) does not fit in {memory / 2**30:.1f} GiB per {per_what} "
            f"with any of {', '.join(candidates)}, even at micro-batch 1 with gradient checkpointing and every memory lever"
            + (" (and ZeRO-3 with CPU offload)" if last_resort and options.method == "full" else "")
            + ": use "
            + ("a larger MIG instance or the whole GPU (disable MIG)" if per_what == "MIG instance" else "more GPUs (--num-machines)")
            + ", a lighter optimizer (--optimizer adafactor or adamw-8bit), a shorter --seq-len"
            + (", --method lora or qlora for a causal LM (`hf-gpu-train plan-memory --model M --method auto` compares them)"
               if options.method == "full" else "")
            + ("" if asked is None else f", or --strategy {AUTO}"))
    return plan, plan.strategy


def _asked(options: PlanOptions) -> Strategy | None:
    """The row of the strategy asked for by name; None for auto (the planner chooses)."""
    return None if options.strategy == AUTO else strategy(options.strategy)


def _check_adapters_strategy(options: PlanOptions) -> None:
    """Adapters train on one GPU or with DDP (the frozen base is small enough to copy), or under DeepSpeed ZeRO when a
    base is too large for that (PEFT's and DeepSpeed's documented LoRA + ZeRO-3): FSDP of a PEFT model is not planned
    here, and QLoRA's 4-bit base needs bitsandbytes' CUDA layers and a storage dtype ZeRO-3 can partition."""
    asked = _asked(options)
    if asked is None or options.method in asked.adapters:
        return
    raise PlanError(f"--method {options.method} with --strategy {options.strategy}: adapters train on one GPU, with DDP"
                    + (" or under DeepSpeed ZeRO (--strategy deepspeed-zero2 or deepspeed-zero3)" if options.method == "lora" else "")
                    + "; use --strategy auto, or --method full to shard")


def make_plan(profile: HardwareProfile, options: PlanOptions = PlanOptions()) -> LaunchPlan:
    _validate(options)
    settings: list[Setting] = []
    selection = select_devices(profile, options.gpus, options.gpu_ids, options.include_busy, options.busy_threshold_bytes)
    gpus, mig = selection.gpus, selection.mig_instance
    if mig is not None and options.num_machines > 1:
        raise PlanError(f"multi-node over MIG is refused: NCCL cannot join MIG instances ({mig.uuid} on GPU {gpus[0].index}); "
                        "use whole GPUs (disable MIG) for multi-node training")
    if options.other_nodes:
        check_homogeneous(profile, gpus, options.other_nodes, options.gpus, options.include_busy, options.busy_threshold_bytes,
                          options.gpu_ids)
    precision, precision_reason = decide_precision(gpus, options.precision, options.fp8_backend_installed)
    env = list(nccl_environment(profile, gpus, options.num_machines, options.debug_nccl, device_order=mig is None))
    binding = None
    acc: dict = {"compute_environment": "LOCAL_MACHINE", "debug": False}

    deepspeed_file = None
    if not gpus:
        per_machine, why = _cpu_processes(profile, options)
        processes = per_machine * options.num_machines
        name = strategy(replica_strategy(processes > 1)).cpu_variant  # cpu, cpu-ddp
        asked = _asked(options)
        if asked is not None and not asked.replicated:
            if processes < 2:
                raise PlanError(f"--strategy {options.strategy} shards over several processes; on this machine, which has no "
                                f"GPU, pass --num-processes 2 or more (gloo on the CPU), or use --strategy auto")
            name = asked.cpu_variant
        if options.method in ("lora", "qlora"):
            _check_adapters_strategy(options)
        if strategy(name).family == DEEPSPEED:
            deepspeed_file = _cpu_deepspeed_settings(acc, settings, env, name, options, per_machine)
        else:
            _cpu_settings(acc, settings, env, name, options)
        budget = thread_budget(profile, per_machine, None)
        env.append(("OMP_NUM_THREADS", str(budget.cores_per_process), budget.reason))
        workers = dataloader_workers(budget, on_gpu=False)
        memory = None
        settings.append(Setting("num_processes", per_machine * options.num_machines, why))
        gpu_ids = None
    else:
        per_machine = len(gpus)
        world = per_machine * options.num_machines
        memory, name = _memory_plan(options, selection.memory_free_bytes, precision, world,
                                        "GPU" if mig is None else "MIG instance", gpus[0], profile.host.ram_total_bytes, per_machine)
        gpu_ids = selection.visible_devices
        acc["use_cpu"] = False
        settings.append(Setting("gpu_ids", gpu_ids, selection.reason))
        settings.append(Setting("num_processes", world, f"{per_machine} GPU(s) x {options.num_machines} machine(s): the total over all machines"))
        deepspeed_file = _strategy_settings(acc, settings, name, memory, options, per_machine)
        binding = decide_cpu_binding(profile, gpus)
        if binding is not None:
            key, value = binding.setting
            if key == "enable_cpu_affinity":
                acc["enable_cpu_affinity"] = True
            settings.append(Setting(key, value, binding.reason))
        budget = thread_budget(profile, per_machine, binding)
        env.append(("OMP_NUM_THREADS", str(budget.cores_per_process), f"{budget.reason}; torchrun would set 1"))
        workers = dataloader_workers(budget, on_gpu=True)

    acc.update(mixed_precision=precision, num_processes=per_machine * options.num_machines, num_machines=options.num_machines,
               machine_rank=options.machine_rank, main_training_function="main", rdzv_backend=options.rdzv_backend,
               same_network=True)
    acc.setdefault("distributed_type", "NO")
    if gpu_ids is not None:
        acc["gpu_ids"] = gpu_ids
    settings.insert(0, Setting("mixed_precision", precision, precision_reason))
    settings.append(Setting("dataloader_num_workers", workers[0], workers[1]))
    if options.num_machines > 1:
        acc.update(main_process_ip=options.main_process_ip, main_process_port=options.main_process_port)
        settings.append(Setting("num_machines", options.num_machines, f"this is machine_rank {options.machine_rank}; "
                                "every node gets its own file with its rank"))
        settings.append(Setting("main_process", f"{options.main_process_ip}:{options.main_process_port}",
                                "rank 0's address; static rendezvous on one network (same_network: true)"
                                if options.rdzv_backend == "static" else "c10d rendezvous endpoint"))
    elif options.main_process_port != DEFAULT_PORT:
        acc["main_process_port"] = options.main_process_port
    for key, value, reason in env:
        settings.append(Setting(key, value, reason))
    return LaunchPlan(machine=profile.display_name, strategy=name, accelerate=acc, env=tuple(env),
                      settings=tuple(settings), gpus=gpus, memory=memory, mig_instance=mig, cpu_binding=binding,
                      options=options, dataloader_workers=workers[0], hardware=hardware_record(profile, gpus),
                      deepspeed_file=deepspeed_file)


def _cpu_settings(acc, settings, env, name, options) -> None:
    """cpu, cpu-ddp, cpu-fsdp: accelerate's MULTI_CPU path starts one process without mpirun, and a MULTI_GPU config on
    a machine without CUDA starts N processes that each think they are alone. MULTI_GPU plus ACCELERATE_USE_CPU=1 in
    the environment gives real gloo DDP (ARCHITECTURE.md, CPU traps)."""
    row = strategy(name)
    acc.update(distributed_type=row.distributed_type, use_cpu=True)
    reasons = {
        "cpu-ddp": "gloo DDP on the CPU through the MULTI_GPU launcher + ACCELERATE_USE_CPU=1 "
                   "(accelerate's MULTI_CPU path would start one process without mpirun)",
        "cpu-fsdp": "FSDP2 over gloo on CPU processes (a rehearsal of the GPU run: accelerate itself turns FSDP on CPU "
                    "processes into DDP, scripts/finetune.py shards anyway; finetune/fsdp.py)",
        "cpu": "one CPU process"}
    settings.append(Setting("distributed_type", acc["distributed_type"], reasons[name]))
    if row.family == FSDP:
        layer = options.model.layer_class if options.model else None
        acc["fsdp_config"] = {"fsdp_version": 2, "fsdp_reshard_after_forward": True, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": False,
                              "fsdp_offload_params": False, "fsdp_activation_checkpointing": False,
                              **({"fsdp_transformer_layer_cls_to_wrap": layer} if layer else {})}
    env.append(("ACCELERATE_USE_CPU", "1", "without it a MULTI_GPU config on a CPU machine starts independent processes"))


def _cpu_deepspeed_settings(acc, settings, env, name, options, per_machine) -> dict | None:
    """DeepSpeed ZeRO on CPU processes: the config a GPU machine gets (the same ``deepspeed_config`` and file), on
    DeepSpeed's CPU accelerator, whose collectives are gloo's without oneCCL (deepspeed accelerator/cpu_accelerator.py).
    What differs is what the device decides: fp32, and no ACCELERATE_USE_CPU, with which accelerate skips DeepSpeed and
    trains DDP (state.py: ``ACCELERATE_USE_DEEPSPEED ... and not cpu``)."""
    deepspeed_file = _strategy_settings(
        acc, settings, name, None, options, per_machine,
        why="DeepSpeed's CPU accelerator with gloo collectives, the GPU config's ZeRO on CPU processes (a rehearsal of "
            "the GPU run). A Trainer of your own needs TrainingArguments(use_cpu=True) or ddp_backend='gloo' here: "
            "with neither accelerate gives the processes no backend and each one trains as process 0 of 1 "
            "(scripts/finetune.py sets use_cpu; the toolkit's callbacks refuse to start otherwise)")
    acc["use_cpu"] = False
    env.append(("DS_ACCELERATOR", "cpu", "DeepSpeed's CPU accelerator, said rather than guessed (DeepSpeed falls back to it, "
                "with a warning, when it finds no GPU)"))
    return deepspeed_file


def _strategy_settings(acc, settings, name, memory, options, per_machine, why: str | None = None) -> dict | None:
    """The strategy's accelerate keys and settings (its family's renderer: ``FAMILY_SETTINGS``); the DeepSpeed config
    file's contents when it needs one."""
    world = per_machine * options.num_machines
    why = why or ("; ".join(memory.reasons) if memory else ("one GPU: no distribution" if world == 1 else
                                                            "no --model given: DDP assumed to fit (pass --model for a memory check)"))
    row = strategy(name)
    acc["distributed_type"] = row.distributed_type
    deepspeed_file = FAMILY_SETTINGS[row.family](row, acc, settings, memory, options, why)
    if memory:
        settings.append(Setting("per_device_train_batch_size", memory.micro_batch,
                                f"largest micro-batch the planner fits is enough for the global batch {options.global_batch}"))
        settings.append(Setting("gradient_accumulation_steps", memory.gradient_accumulation,
                                f"{memory.micro_batch} x {memory.gradient_accumulation} x {world} GPU(s) = {memory.effective_batch}"))
        settings.append(Setting("gradient_checkpointing", memory.gradient_checkpointing,
                                "needed for a useful micro-batch" if memory.gradient_checkpointing else "not needed: activations fit"))

        settings.extend(Setting(key, value, reason) for key, value, reason in lever_settings(memory))
    return deepspeed_file


def _replicated_settings(row: Strategy, acc, settings, memory, options, why: str) -> None:
    """One GPU (no distribution) or DDP over NCCL."""
    settings.append(Setting("distributed_type", row.distributed_type, "DDP with NCCL: " + why if row.several_processes else why))


def _fsdp_settings(row: Strategy, acc, settings, memory, options, why: str) -> None:
    """FSDP2: resharding after the forward where the row shards everything, the parameters offloaded where it offloads."""
    layer = options.model.layer_class if options.model else None
    reshard = row.shards == EVERYTHING
    cfg = {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": reshard,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": row.offload,
        "fsdp_activation_checkpointing": bool(memory and memory.gradient_checkpointing),
    }
    if layer:
        cfg["fsdp_transformer_layer_cls_to_wrap"] = layer
    acc["fsdp_config"] = cfg
    mode = ("parameters resharded after forward (ZeRO-3-like)" if reshard
            else "parameters kept between forward and backward (ZeRO-2-like, less traffic)")
    offloaded = ", parameters offloaded to CPU (last resort)" if row.offload else ""
    settings.append(Setting("distributed_type", row.distributed_type, f"FSDP2, {mode}{offloaded}: {why}"))


def _deepspeed_settings(row: Strategy, acc, settings, memory, options, why: str) -> dict | None:
    """DeepSpeed ZeRO of the row's stage; with CPU offload, the config file whose optimizer section steps on the CPU."""
    stage, offload, deepspeed_file = row.zero_stage, row.offload, None
    if offload:  # the optimizer section DeepSpeed needs to step on the CPU can only come from a file
        deepspeed_file = deepspeed_file_for(stage, offload_params=stage == 3)
        acc["deepspeed_config"] = {"deepspeed_config_file": DEEPSPEED_FILE_PLACEHOLDER, "zero3_init_flag": stage == 3}
    acc["deepspeed_config"] = acc.get("deepspeed_config") or {
        "zero_stage": stage,
        "offload_optimizer_device": "cpu" if offload else "none",
        "offload_param_device": "cpu" if offload and stage == 3 else "none",
        # no gradient_accumulation_steps / gradient_clipping: left out, accelerate passes "auto" and transformers
        # fills them from the run's TrainingArguments; a fixed number here would be refused ("mismatches") by
        # any run that derives another accumulation (another global batch, --num_processes, a tune trial)
        "zero3_init_flag": stage == 3,
        **({"zero3_save_16bit_model": True} if stage == 3 else {}),
    }
    offloaded = " with CPU offload (last resort)" if offload else ""
    settings.append(Setting("distributed_type", row.distributed_type, f"ZeRO-{stage}{offloaded}: {why}"))
    if options.num_machines > 1:
        # each node runs its own launch (its machine_rank, the sbatch's srun task): accelerate must start that node's
        # processes with torchrun; its default multi-node launcher (pdsh) would start the whole job over ssh instead
        acc["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
        settings.append(Setting("deepspeed_multinode_launcher", "standard", "one launch per node (machine_rank, the "
                                "sbatch's srun task) starting that node's processes with torchrun; accelerate's "
                                "default, pdsh, would start every node's processes over ssh from a hostfile"))
    if offload:
        settings.append(Setting("deepspeed_config_file", "NAME.deepspeed.json", "ZeRO-Offload steps with DeepSpeed's CPU "
                                "Adam, named in the file's optimizer section (with the Trainer's own optimizer DeepSpeed "
                                "refuses offloading: zero_force_ds_cpu_optimizer); one parameter group, so weight decay "
                                "reaches norms and biases too, and the run's optim is refused"))
    return deepspeed_file


# Each family's renderer of the accelerate config: a new strategy of a family is a row in plan/strategies.py, a new
# family a row and its renderer here.
FAMILY_SETTINGS = {REPLICATED: _replicated_settings, FSDP: _fsdp_settings, DEEPSPEED: _deepspeed_settings}
