"""A real SLURM cluster of two nodes on this machine, for tests (issue 30): ``munged``, ``slurmctld`` and one ``slurmd``
for each of the nodes ``n1`` and ``n2``, every file under one temporary folder, every daemon on a port chosen free.

Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them when it runs as root); without them, or not as root
(``SlurmUser=root``, /etc/hosts), the fixture skips with the reason. The node names must resolve: the sbatch that
``hf-gpu-train config`` writes uses the first node's name as the rendezvous host, so ``127.0.0.1 n1 n2`` goes into
/etc/hosts when it is not there. Traps met on the way, each handled below:

- munged refuses a socket whose folder is not searchable by everyone ("execute permissions for all required"), and a
  key file anyone else may read: the socket folder is 0755, the key 0400 in a 0700 folder.
- several slurmds on one host need their own spool folder, pid file and log (``%n`` in their paths) and their own port.
- slurmd compares the configured CPUs with the machine's; ``SlurmdParameters=config_overrides`` keeps ``CPUs=2`` on a
  machine with one core or sixteen.
- no slurmdbd, so no ``sacct``: a job's end is read with ``scontrol show job``, which forgets a finished job after
  ``MinJobAge`` (set to a day here).
- proctrack/linuxproc and task/none: no cgroups (a container has none to give).
- a requeued job waits for its old credential to expire before it may start again (``cred_expire``, 120 s by default;
  10 s here): started sooner, it is killed at once ("Job credential revoked").
- the daemons run in the foreground as this process's children; a job's processes are not (slurmstepd starts them):
  teardown cancels every job, stops the daemons, then ends any process left whose environment names this cluster's
  ``SLURM_CONF``. A cluster left by a killed pytest is ended by the next start (its owner pid is gone).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

NODES = ("n1", "n2")
CPUS_PER_NODE = 2
KILL_WAIT_S = 10  # SIGTERM to SIGKILL when a job is cancelled or reaches its time limit
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "sinfo", "srun")
INSTALL = "apt-get install -y slurm-wlm munge"
OWNER_ENV = "HF_GPU_TRAIN_TEST_SLURM_OWNER"  # the pytest pid that started a daemon: a leftover is one whose owner is gone
HOSTS_LINE = "127.0.0.1 n1 n2  # tests/slurm_cluster.py: the sbatch's rendezvous host is the first node's name\n"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE"}
START_TIMEOUT_S = 60

__all__ = ["SlurmCluster", "slurm_cluster"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def why_not_available() -> str | None:
    """The reason this machine cannot run the cluster, or None."""
    missing = [name for name in (*DAEMONS, *CLIENTS, "munge") if shutil.which(name) is None
               and not Path("/usr/sbin", name).exists()]
    if missing:
        return f"SLURM or munge not installed (missing {', '.join(missing)}): as root, {INSTALL}"
    if os.geteuid() != 0:
        return "the test SLURM cluster needs root (SlurmUser=root, and n1 n2 in /etc/hosts)"
    return None


def _ensure_hosts() -> str | None:
    """n1 and n2 resolve to 127.0.0.1 (added to /etc/hosts when missing); the reason they cannot, or None."""
    unresolved = []
    for node in NODES:
        try:
            address = socket.gethostbyname(node)
        except OSError:
            unresolved.append(node)
            continue
        if address != "127.0.0.1":
            return f"{node} resolves to {address}, not 127.0.0.1: the test cluster's nodes need that name"
    if unresolved:
        try:
            with open("/etc/hosts", "a") as f:
                f.write(HOSTS_LINE)
        except OSError as e:
            return f"{' '.join(unresolved)} do not resolve and /etc/hosts cannot be written ({e})"
        for node in unresolved:
            try:
                socket.gethostbyname(node)
            except OSError:
                return f"{node} does not resolve even after adding it to /etc/hosts (is /etc/hosts read by this resolver?)"
    return None


def _environ_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and int(p.name) != os.getpid()]


def _kill_where(matches) -> list[int]:
    """SIGKILL every process whose environment ``matches``; returns their pids."""
    killed = []
    for pid in _pids():
        if matches(_environ_of(pid)):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_leftovers() -> list[int]:
    """End the daemons and jobs of clusters whose pytest is gone (killed before its teardown ran): the daemons carry
    their owner's pid, a job's processes their cluster's SLURM_CONF."""
    def orphaned(env):
        owner = env.get(OWNER_ENV)
        return owner is not None and owner.isdigit() and not _alive(int(owner))
    confs = {env["SLURM_CONF"] for env in map(_environ_of, _pids()) if orphaned(env) and "SLURM_CONF" in env}
    return _kill_where(lambda env: orphaned(env) or env.get("SLURM_CONF") in confs)


def parse_job(text: str) -> dict[str, str]:
    """``scontrol show job -o``'s one line -> {key: value}. A value runs until the next `` Key=``; a value that itself
    holds `` word=`` (a script argument in ``Command``) is cut there, and the rest becomes keys nobody asks for."""
    fields = {}
    for part in re.split(r"\s+(?=[A-Za-z][A-Za-z0-9_:/]*=)", text.strip()):
        if "=" in part:
            key, value = part.split("=", 1)
            fields.setdefault(key, value)
    return fields


def exit_code_of(fields: dict[str, str]) -> int | None:
    """``ExitCode=RC:SIGNAL`` of the batch script -> RC, or -SIGNAL when a signal ended it (as subprocess says)."""
    raw = fields.get("ExitCode")
    if not raw or ":" not in raw:
        return None
    rc, sig = (int(x) for x in raw.split(":", 1))
    return -sig if sig and not rc else rc


@dataclass
class SlurmCluster:
    """Started by the ``slurm_cluster`` fixture; ``env`` is what a subprocess needs to talk to it (SLURM_CONF)."""

    root: Path
    conf: Path
    env: dict[str, str]
    nodes: tuple[str, ...] = NODES
    kill_wait_s: int = KILL_WAIT_S
    processes: list[subprocess.Popen] = field(default_factory=list)
    scratch: list[Path] = field(default_factory=list)  # folders outside ``root``, removed by stop()

    def _run(self, *command: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(list(command), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}\n{self.logs()}")
        return done

    def sbatch(self, script: str | Path, *args: str, cwd: str | Path, env: dict | None = None,
               options: tuple[str, ...] = ()) -> str:
        """``sbatch OPTIONS SCRIPT ARGS`` from ``cwd`` (where ``--output=%x-%j.out`` lands), in ``env`` (default
        ``self.env``; SLURM_CONF always this cluster's): with ``--export=ALL`` what the job sees. Returns the job id."""
        full = {**(self.env if env is None else env), "SLURM_CONF": str(self.conf)}
        done = subprocess.run(["sbatch", "--parsable", *options, str(script), *args], cwd=str(cwd), env=full,
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed ({done.returncode}): {done.stderr.strip()}\n{self.logs()}")
        return done.stdout.strip().split(";")[0]

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``, parsed ({} once the controller forgot it); keys as SLURM spells them: JobState,
        ExitCode, Restarts (also as RestartCnt), NodeList, BatchHost, StdOut, Reason, ..."""
        done = self._run("scontrol", "show", "job", "-o", str(job_id), check=False)
        fields = parse_job(done.stdout) if done.returncode == 0 and done.stdout.strip() else {}
        if "Restarts" in fields:
            fields.setdefault("RestartCnt", fields["Restarts"])  # SLURM_RESTART_COUNT in the job; scontrol says Restarts
        return fields

    def wait(self, job_id: str, timeout: float, states: set[str] | frozenset[str] = frozenset(TERMINAL),
             poll_s: float = 0.5) -> tuple[str, int | None]:
        """Until the job's state is one of ``states`` (the terminal ones by default): (state, exit code of its batch
        script: RC, or -SIGNAL). TimeoutError, with the job and the cluster's logs, when it takes longer."""
        deadline = time.monotonic() + timeout
        fields = {}
        while time.monotonic() < deadline:
            fields = self.job_info(job_id)
            state = fields.get("JobState")
            if state in states:
                return state, exit_code_of(fields)
            time.sleep(poll_s)
        raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout} s: {fields}\n{self.output(job_id)}")

    def scancel(self, job_id: str, *flags: str) -> None:
        self._run("scancel", *flags, str(job_id))

    def output(self, job_id: str, tail: int = 8000) -> str:
        """The last ``tail`` characters of the job's output file, for a failing test's message."""
        path = self.job_info(job_id).get("StdOut")
        try:
            return f"--- {path} ---\n" + Path(path).read_text(errors="replace")[-tail:]
        except (OSError, TypeError):
            return f"(no output file for job {job_id}: {path})"

    def logs(self, tail: int = 2000) -> str:
        texts = []
        for log in sorted(self.root.glob("*.log")):
            texts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-tail:]}")
        return "\n".join(texts)

    def sinfo(self) -> dict[str, str]:
        """{node: state} as sinfo reports it."""
        done = self._run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)

    def stop(self) -> None:
        """Cancel every job, stop the daemons, end what is left of the jobs; nothing of this cluster keeps running."""
        if any(p.poll() is None for p in self.processes):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True, timeout=15)
                deadline = time.monotonic() + self.kill_wait_s + 5
                while time.monotonic() < deadline:
                    queue = subprocess.run(["squeue", "-h", "-t", "RUNNING,COMPLETING,CONFIGURING"], env=self.env,
                                           capture_output=True, text=True, timeout=15)
                    if queue.returncode != 0 or not queue.stdout.strip():
                        break
                    time.sleep(0.5)
        for process in reversed(self.processes):  # the slurmds, the controller, then munged
            if process.poll() is None:
                process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        conf = str(self.conf)
        _kill_where(lambda env: env.get("SLURM_CONF") == conf)
        for folder in self.scratch:
            shutil.rmtree(folder, ignore_errors=True)


def _write_conf(root: Path, munge_socket: Path, hostname: str) -> Path:
    ctld_port = _free_port()
    node_ports = [_free_port() for _ in NODES]
    while len({ctld_port, *node_ports}) < 1 + len(NODES):
        node_ports = [_free_port() for _ in NODES]
    nodes = "\n".join(f"NodeName={name} NodeHostname={hostname} NodeAddr=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} "
                      "State=UNKNOWN" for name, port in zip(NODES, node_ports))
    conf = root / "slurm.conf"
    conf.write_text(f"""# a two-node test cluster on one machine (tests/slurm_cluster.py)
ClusterName=hfgtest
SlurmctldHost={hostname}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
ReturnToService=2
JobRequeue=1
MinJobAge=86400
KillWait={KILL_WAIT_S}
InactiveLimit=0
SlurmdTimeout=300
TmpFS={root}/tmp
{nodes}
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
""")
    for folder in ("state", "tmp", *(f"spool-{n}" for n in NODES)):
        (root / folder).mkdir()
    return conf


def start_cluster(root: Path) -> SlurmCluster:
    """munged, slurmctld and the slurmds under ``root``, until sinfo shows every node idle."""
    # munged wants every folder above its socket searchable by all (pytest's are 0700): a folder of its own in /tmp
    munge_dir = Path(tempfile.mkdtemp(prefix="hf-gpu-train-munge-"))
    munge_dir.chmod(0o755)
    key_dir = root / "munge-key"
    key_dir.mkdir(mode=0o700)
    key = key_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge_socket = munge_dir / "munge.socket"
    conf = _write_conf(root, munge_socket, socket.gethostname().split(".")[0])
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for key_name in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        env.pop(key_name)  # inside a SLURM job already: its variables are not this cluster's
    cluster = SlurmCluster(root=root, conf=conf, env=env, scratch=[munge_dir])
    daemon_env = {**env, OWNER_ENV: str(os.getpid())}

    def start(*command: str, log: str) -> None:
        with open(root / log, "ab") as out:
            cluster.processes.append(subprocess.Popen(list(command), env=daemon_env, stdout=out, stderr=subprocess.STDOUT,
                                                      stdin=subprocess.DEVNULL, start_new_session=True))

    try:
        start("munged", "-F", f"--socket={munge_socket}", f"--key-file={key}", f"--pid-file={munge_dir}/munged.pid",
              f"--seed-file={key_dir}/munged.seed", f"--log-file={root}/munged.log", log="munged.out.log")
        _until(lambda: munge_socket.exists(), 15, "munged made no socket", cluster)
        start("slurmctld", "-D", "-i", "-f", str(conf), log="slurmctld.out.log")
        _until(lambda: cluster._run("scontrol", "ping", check=False).stdout.count("UP") > 0, 30,
               "slurmctld does not answer scontrol ping", cluster)
        for node in NODES:
            start("slurmd", "-D", "-f", str(conf), "-N", node, log=f"slurmd-{node}.out.log")
        _until(lambda: [cluster.sinfo().get(n) for n in NODES] == ["idle"] * len(NODES), START_TIMEOUT_S,
               "the nodes are not idle", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _until(condition, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p.args[0] for p in cluster.processes if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited while starting the test cluster:\n{cluster.logs()}")
        if condition():
            return
        time.sleep(0.25)
    raise RuntimeError(f"{what} after {timeout} s; sinfo: {cluster.sinfo()}\n{cluster.logs()}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running two-node SLURM cluster (``SlurmCluster``), or a skip that says why not."""
    reason = why_not_available() or _ensure_hosts()
    if reason:
        pytest.skip(reason)
    reap_leftovers()
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()
