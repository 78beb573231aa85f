"""CPU threads and dataloader workers per training process, from the cores each process is bound to.

Dividing every physical core of the host by the processes is wrong as soon as a CPU binding pins them:
on a 40-core DGX-1, four processes pinned to one socket's 20 cores each get 5 cores, not 10, and
``OMP_NUM_THREADS=10`` oversubscribes that socket two to one. So the count starts from the CPU set each
process is bound to (its GPU's NVML CPU affinity), shared by the processes bound to the same set, in
physical cores: a CPU set lists logical CPUs, and SMT siblings do not add matrix-multiply throughput.
Linux on x86 numbers the first hardware thread of every core first and the siblings after them (CPU c and
c + physical cores share a core, as ``lscpu -e`` shows), so "0-19,40-59" on a 40-core, 80-thread host is
20 cores, and "0-55" on a 112-core host is 56.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..hardware.profile import HardwareProfile, parse_cpulist
from .cpu_binding import NONE, CpuBinding

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
