"""A check at the start of every launch of several processes: every rank joins, and the collectives work, in seconds.

A rank that cannot join (a wrong ``MASTER_ADDR`` or port, a firewall, a machine whose launch never started) leaves
the others inside ``init_process_group`` until its timeout (30 minutes by default), with no word of which rank.
A transport that cannot connect between machines (NCCL picking the wrong network interface, InfiniBand that is not
up) lets the group form, then hangs the first all-reduce. Both are found here, before the model or the data load:

1. **Join** (under torchrun / ``accelerate launch``, whose agent hosts the rendezvous store): each rank connects to
   the store with a short timeout and posts its host; a rank that cannot connect says so itself, and the others
   name every rank that did not post within the timeout.
2. **Collectives**: an all-reduce whose result is checked and a broadcast, each waited on with the short timeout;
   on GPUs also a tensor sent between each pair of ranks on this machine (the P2P path ``doctor`` checks), in an
   order every rank follows, so the pairs cannot deadlock.

Each failure is a ``PreflightError`` (a usage error: exit 2) naming the ranks and hosts, and the variables that fix
it, with the values this process has (the plan's). ``HF_GPU_TRAIN_PREFLIGHT_TIMEOUT`` sets the timeout (seconds,
default 60; ``0`` turns the check off).

Under a launcher that is not torchelastic (``srun`` or ``mpirun`` starting the script itself) the join check is
skipped (rank 0 hosts the store, once the group forms); the group's forming and the collectives are still bounded.
Under torchrun's ``c10d`` rendezvous the agents meet before any worker starts, so the join check re-tests a path
already proven; under the ``static`` one (accelerate's multi-machine launches) it is what names a missing machine.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

from ..collectives.cpu_votes import CPU_GROUP, cpu_group
from ..errors import UsageError
from ..process_group import launch_attempt

DEFAULT_TIMEOUT_S = 60.0
_KEY = "hf_gpu_train/preflight"


class PreflightError(UsageError):
    """A rank that cannot join, or collectives that do not complete: named, with the fix."""


def timeout_s() -> float:
    raw = os.environ.get("HF_GPU_TRAIN_PREFLIGHT_TIMEOUT", "")
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise PreflightError(f"HF_GPU_TRAIN_PREFLIGHT_TIMEOUT={raw!r} is not a number of seconds (0 turns the check off)") from None


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def network_fix() -> str:
    """What to set, with the values this process has (the plan put them there, or the shell did)."""
    values = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME",
                                                       "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE")}
    now = ", ".join(f"{k}={v}" for k, v in values.items() if v is not None) or "none of them set"
    return ("check that every machine reaches MASTER_ADDR:MASTER_PORT (the address of the machine running rank 0, a "
            "port its firewall lets in), that NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name the interface of that "
            "network on every machine (`ip addr`), and NCCL_IB_DISABLE=1 where InfiniBand is not up "
            f"(this process has {now}); hf-gpu-train config --machines writes them per machine")


def check_ranks_join(seconds: float) -> None:
    """Every rank posts itself to the launcher's rendezvous store within ``seconds``, or the ranks that did not are
    named. Only under torchelastic (its agent hosts the store; without it rank 0 would, once the group forms)."""
    rank, world = _rank_world()
    if world < 2 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    # a rank that cannot connect says so before the others give up on it and end the run: our own connect, bounded
    # by us (the store client's retries add a random back-off of about its timeout again: 3.3 s for a 1 s timeout)
    connect_s = seconds / 3
    unreachable = _unreachable(host, port, connect_s)
    try:
        if unreachable:
            raise RuntimeError(unreachable)
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=connect_s), wait_for_workers=False)
    except (RuntimeError, TimeoutError) as error:  # DistNetworkError / DistStoreError are RuntimeErrors
        raise PreflightError(f"rank {rank} on {socket.gethostname()} cannot reach the rendezvous at {host}:{port} within "
                             f"{connect_s:.0f} s ({str(error).splitlines()[0]}): {network_fix()}") from None

    prefix = f"{_KEY}/{launch_attempt()}/joined"
    store.set(f"{prefix}/{rank}", socket.gethostname())
    deadline, waiting = time.monotonic() + seconds, set(range(world)) - {rank}
    while waiting:
        waiting = {r for r in waiting if not store.check([f"{prefix}/{r}"])}
        if waiting and time.monotonic() > deadline:
            joined = sorted(set(range(world)) - waiting)
            hosts = sorted({store.get(f"{prefix}/{r}").decode() for r in joined})
            raise PreflightError(f"rank(s) {_ranges(sorted(waiting))} of {world} did not join within {seconds:.0f} s "
                                 f"(joined: {_ranges(joined)} on {', '.join(hosts)}): the machine running them did not "
                                 f"start its launch, started late (slow imports: HF_GPU_TRAIN_PREFLIGHT_TIMEOUT=300), or "
                                 f"cannot reach this one; {network_fix()}")
        if waiting:
            time.sleep(0.1)


def _unreachable(host: str, port: int, seconds: float) -> str:
    """Why ``host:port`` took no TCP connection within ``seconds`` (each of its addresses tried, again while refused),
    or "" once one did. The name is resolved once (a bracketed IPv6 address as written in MASTER_ADDR too)."""
    deadline = time.monotonic() + seconds
    try:
        addresses = [a[4] for a in socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)]
    except OSError as error:
        return f"resolving {host}: {error.strerror or error}"
    why = ""
    while True:
        for address in addresses:
            left = deadline - time.monotonic()
            if left <= 0:
                return f"connecting: {why}"
            family = socket.AF_INET6 if len(address) == 4 else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.settimeout(max(left, 0.05))
                try:
                    probe.connect(address)
                    return ""
                except OSError as error:
                    why = error.strerror or str(error) or type(error).__name__
        if deadline - time.monotonic() <= 0.1:
            return f"connecting: {why}"
        time.sleep(0.1)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def _wait(work, what: str, seconds: float) -> None:
    try:
        finished = work.wait(timedelta(seconds=seconds))
    except RuntimeError as error:
        raise PreflightError(f"{what} did not complete within {seconds:.0f} s ({str(error).splitlines()[0]}): the ranks "
                             f"joined but cannot exchange data; {network_fix()}") from None
    if finished is False:
        raise PreflightError(f"{what} did not complete within {seconds:.0f} s: the ranks joined but cannot exchange data; "
                             f"{network_fix()}")


def check_collectives(seconds: float, device) -> None:
    """An all-reduce (its sum checked), a broadcast and, on CUDA, a copy between each pair of local ranks."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.full((4,), float(rank + 1), device=device)
    _wait(dist.all_reduce(value, async_op=True), "the preflight all-reduce", seconds)
    expected = world * (world + 1) / 2
    if not torch.all(value == expected):
        raise PreflightError(f"the preflight all-reduce summed to {value.tolist()} instead of {expected:g} on rank {rank}: "
                             "the transport corrupts data (a faulty link or a driver bug); run hf-gpu-train doctor")
    sent = torch.arange(4, dtype=torch.float32, device=device) if rank == 0 else torch.zeros(4, device=device)
    _wait(dist.broadcast(sent, src=0, async_op=True), "the preflight broadcast", seconds)
    if not torch.equal(sent.cpu(), torch.arange(4, dtype=torch.float32)):
        raise PreflightError(f"the preflight broadcast arrived as {sent.tolist()} on rank {rank}: run hf-gpu-train doctor")
    if dist.get_backend() != "gloo":  # the gloo group the Trainer's flags are agreed on (collectives/cpu_votes.py), made now

        _wait(dist.all_reduce(torch.ones(1), group=cpu_group(dist, timedelta(seconds=seconds)), async_op=True),
              "the preflight all-reduce on the gloo group (GLOO_SOCKET_IFNAME)", seconds)
    if device is not None and torch.device(device).type == "cuda":
        _check_local_pairs(seconds, device)


def local_pairs(local_ranks: list[int]) -> list[tuple[int, int]]:
    """Every pair of this machine's global ranks, in one order all ranks follow (deadlock-free one pair at a time)."""
    return [(a, b) for i, a in enumerate(local_ranks) for b in local_ranks[i + 1:]]


def _check_local_pairs(seconds: float, device) -> None:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    first = rank - int(os.environ.get("LOCAL_RANK", "0"))
    for a, b in local_pairs(list(range(first, first + local))):
        if rank not in (a, b):
            continue
        tensor = torch.full((1 << 16,), float(a), device=device)
        peer = b if rank == a else a
        op = dist.P2POp(dist.isend if rank == a else dist.irecv, tensor, peer)
        for work in dist.batch_isend_irecv([op]):
            _wait(work, f"the preflight copy between GPUs of ranks {a} and {b} (P2P)", seconds)
        if rank == b and not torch.all(tensor == float(a)):
            raise PreflightError(f"a copy from rank {a}'s GPU to rank {b}'s arrived corrupted: peer-to-peer between "
                                 "these GPUs is broken; NCCL_P2P_DISABLE=1 works around it (run hf-gpu-train doctor)")


def preflight(cpu: bool = False, timeout: float = 1800.0, backend: str | None = None) -> None:
    """Both checks, in a training process of several (nothing with one, or with the timeout 0). Makes the process
    group between them through accelerate, as the Trainer would: ``cpu``, ``backend`` and ``timeout`` (the collective
    timeout the run keeps) as ``TrainingArguments(use_cpu=, ddp_backend=, ddp_timeout=)``. The group is made with the
    short timeout, so that gloo's connections between the ranks (made while the group forms) and NCCL's (made in the
    first collective) are bounded too, and gets the run's own afterwards."""
    seconds = timeout_s()
    if seconds <= 0 or _rank_world()[1] < 2:
        make_process_group(cpu, timeout, backend)
        return
    start = time.monotonic()
    check_ranks_join(seconds)
    try:
        state = make_process_group(cpu, seconds, backend)
        check_collectives(seconds, state.device)
    except PreflightError:
        raise
    except RuntimeError as error:  # the group could not form in time (gloo connects every pair while it forms)
        raise PreflightError(f"rank {_rank_world()[0]} on {socket.gethostname()}: the process group did not form within "
                             f"{seconds:.0f} s ({str(error).splitlines()[0]}): the ranks joined but cannot connect to each "
                             f"other; {network_fix()}") from None
    keeps = _run_timeout(timeout, state.device)
    if state.is_main_process:
        print(f"hf_gpu_train: preflight: {state.num_processes} processes joined, all-reduce and broadcast "
              f"{'and the copies between local GPUs ' if state.device.type == 'cuda' else ''}work "
              f"({time.monotonic() - start:.1f} s); collective timeout {keeps}", flush=True)


def _run_timeout(seconds: float, device) -> str:
    """Give the default group the run's collective timeout (it was made with the preflight's); what it now holds, as
    read back from its backend ("?" where the backend does not say)."""
    import torch
    import torch.distributed as dist


    setter = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    setter(timedelta(seconds=seconds))
    for group in CPU_GROUP:  # the flags' gloo group, made with the preflight's timeout
        setter(timedelta(seconds=seconds), group)
    try:  # the rendezvous store too: later groups (FSDP's, TRL's, DeepSpeed's) exchange their ids through it
        store = dist.distributed_c10d._get_default_store()
        getattr(store, "underlying_store", store).set_timeout(timedelta(seconds=seconds))
    except Exception:  # noqa: BLE001 (private API: the store keeps the short timeout)
        pass
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device(device))
        return f"{backend.options._timeout.total_seconds():.0f} s"
    except Exception:  # noqa: BLE001 (private API: only the report of it is lost)
        return "?"


def make_process_group(cpu: bool, timeout: float, backend: str | None):
    """accelerate's ``PartialState`` with what ``TrainingArguments`` would give it (a group made here is the one the
    Trainer uses: it does not make another)."""
    from accelerate.state import PartialState

    options = {"timeout": timedelta(seconds=timeout), **({"backend": backend} if backend else {})}
    return PartialState(cpu=cpu, **options)
