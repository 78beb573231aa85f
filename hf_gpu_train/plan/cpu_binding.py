"""The CPUs of each training process: where it is pinned, and how many threads and dataloader workers it gets.

CPU threads and dataloader workers per training process, from the cores each process is bound to.

Dividing every physical core of the host by the processes is wrong as soon as a CPU binding pins them:
on a 40-core DGX-1, four processes pinned to one socket's 20 cores each get 5 cores, not 10, and
``OMP_NUM_THREADS=10`` oversubscribes that socket two to one. So the count starts from the CPU set each
process is bound to (its GPU's NVML CPU affinity), shared by the processes bound to the same set, in
physical cores: a CPU set lists logical CPUs, and SMT siblings do not add matrix-multiply throughput.
Linux on x86 numbers the first hardware thread of every core first and the siblings after them (CPU c and
c + physical cores share a core, as ``lscpu -e`` shows), so "0-19,40-59" on a 40-core, 80-thread host is
20 cores, and "0-55" on a 112-core host is 56.

Pin each training process (and its dataloader workers) to the CPUs next to its GPU.

On a box with several NUMA nodes, a process the scheduler puts on the far socket copies every batch
across the CPU interconnect. The GPU's CPU affinity (NVML ``GetCpuAffinity``, the "CPU Affinity" column
of ``nvidia-smi topo -m``) says where it belongs; it is known even where NVML gives no NUMA node id
(older drivers, most VMs), so the decision is made from it, with the NUMA ids only as a fallback.

How it is applied, from accelerate 1.15 (``utils/environment.py``): ``enable_cpu_affinity: true`` makes
each process call ``set_numa_affinity(local_process_index)``, which reads
``nvmlDeviceGetHandleByIndex(local_process_index)``'s CPU affinity. NVML ignores CUDA_VISIBLE_DEVICES, so
that is right only when the selected GPUs are NVML 0..n-1 in order; for any other subset it pins
process i to the CPUs of NVML GPU i, often the other socket. Then, if every selected GPU has the same
CPU set, the whole launch runs under ``taskset -c CPUS`` (children inherit it); otherwise nothing
safe can be set and the reason says how to get a binding.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..hardware.profile import GpuInfo, HardwareProfile, parse_cpulist

MAX_DATALOADER_WORKERS = 8  # beyond this, workers fight the main process for memory bandwidth and /dev/shm


@dataclass(frozen=True)
class ThreadBudget:
    """Physical cores each local process may use, and why (the OMP_NUM_THREADS and workers reasons cite it)."""

    cores_per_process: int
    reason: str


def physical_cores_in(profile: HardwareProfile, cpus: tuple[int, ...]) -> int:
    """Physical cores behind a set of logical CPUs (siblings numbered ``c + physical cores``, see above)."""
    cores = profile.host.physical_cores
    if cores and profile.host.logical_cores and profile.host.logical_cores > cores:
        return max(1, len({c % cores for c in cpus}))
    return max(1, len(cpus))


def thread_budget(profile: HardwareProfile, processes_per_machine: int, binding: CpuBinding | None) -> ThreadBudget:
    """Cores per process: the bound CPU set's physical cores over the processes sharing it (the tightest
    set decides), else all physical cores over all processes."""
    processes = max(1, processes_per_machine)
    sets = binding.cpus_by_process if binding is not None and binding.method != NONE else ()
    if sets and all(sets):
        sharing = Counter(sets)
        physical = {cpus: physical_cores_in(profile, parse_cpulist(cpus)) for cpus in sharing}
        tightest = min(sharing, key=lambda cpus: physical[cpus] // sharing[cpus])
        cores = max(1, physical[tightest] // sharing[tightest])
        return ThreadBudget(cores, f"{sharing[tightest]} process(es) bound to CPUs {tightest} ({physical[tightest]} physical "
                            f"cores): {cores} each")
    total = profile.host.physical_cores or profile.host.logical_cores or 1
    return ThreadBudget(max(1, total // processes), f"{total} physical core(s) / {processes} process(es)")


def dataloader_workers(budget: ThreadBudget, on_gpu: bool) -> tuple[int, str]:
    """(workers per process, reason). On a GPU the cores feed it: one stays with the main process. On the
    CPU the cores compute, and workers would take them from the matrix multiplies."""
    if not on_gpu:
        return 0, "CPU training: the cores compute; loading in the main process"
    workers = min(MAX_DATALOADER_WORKERS, max(1, budget.cores_per_process - 1))
    return workers, (f"{budget.reason}; one core for the main process, the rest load data"
                     + (f" (at most {MAX_DATALOADER_WORKERS})" if workers == MAX_DATALOADER_WORKERS else ""))


ACCELERATE, TASKSET, NONE = "accelerate", "taskset", "none"


@dataclass(frozen=True)
class CpuBinding:
    """``method``: accelerate (enable_cpu_affinity), taskset (a launch prefix) or none (no safe way)."""

    method: str
    cpus_by_process: tuple[str | None, ...]  # CPU list of each local process's GPU, in gpu_ids order
    reason: str

    @property
    def command_prefix(self) -> str | None:
        """What to put before the launch command (``taskset -c 20-39,60-79``), when that is the method."""
        return f"taskset -c {self.cpus_by_process[0]}" if self.method == TASKSET else None

    @property
    def setting(self) -> tuple[str, object]:
        """(key, value) of the plan line that carries this binding."""
        if self.method == ACCELERATE:
            return "enable_cpu_affinity", True
        return "cpu_binding", self.command_prefix or "none"


def _where(profile: HardwareProfile, gpus: tuple[GpuInfo, ...]) -> str:
    nodes = sorted({g.numa_node for g in gpus if g.numa_node is not None})
    masks = list(dict.fromkeys(g.cpu_affinity for g in gpus if g.cpu_affinity))
    host = f"{profile.host.numa_nodes} NUMA nodes on this host; " if (profile.host.numa_nodes or 1) > 1 else ""
    if nodes and len(nodes) == len({g.numa_node for g in gpus}):
        return f"{host}the GPUs sit on NUMA node{'s' if len(nodes) > 1 else ''} {','.join(map(str, nodes))}"
    if masks:
        return f"{host}GPU CPU affinity {' / '.join(masks)} (NVML gives no NUMA node id)"
    return f"{host}GPU CPU affinity unknown"


def decide_cpu_binding(profile: HardwareProfile, gpus: tuple[GpuInfo, ...]) -> CpuBinding | None:
    """None when binding buys nothing (one NUMA node and one CPU set for all GPUs)."""
    if not gpus:
        return None
    masks = {g.cpu_affinity for g in gpus if g.cpu_affinity}
    nodes = {g.numa_node for g in gpus if g.numa_node is not None}
    if (profile.host.numa_nodes or 1) <= 1 and len(masks) <= 1 and len(nodes) <= 1:
        return None
    cpus = tuple(g.cpu_affinity for g in gpus)
    where = _where(profile, gpus)
    indices = [g.index for g in gpus]
    if indices == list(range(len(gpus))):
        return CpuBinding(ACCELERATE, cpus, f"{where}: accelerate pins process i to GPU i's CPU affinity (NVML "
                          "GetCpuAffinity), keeping each process and its dataloader workers next to its GPU")
    ids = ",".join(map(str, indices))
    why_not_accelerate = (f"gpu_ids {ids} are not NVML GPUs 0..{len(gpus) - 1}, and accelerate's enable_cpu_affinity pins "
                          "process i to NVML GPU i (it ignores CUDA_VISIBLE_DEVICES)")
    if len(set(cpus)) == 1 and cpus[0]:
        return CpuBinding(TASKSET, cpus, f"{where}; {why_not_accelerate}: every selected GPU has CPU affinity {cpus[0]}, "
                          f"so launch under `taskset -c {cpus[0]}` (the processes inherit it)")
    return CpuBinding(NONE, cpus, f"{where}; {why_not_accelerate}, and these GPUs need different CPU sets per process: "
                      "no binding is set. Pick GPUs 0..n-1 or GPUs of one socket to get one")
