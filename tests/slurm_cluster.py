"""A real Slurm cluster on 127.0.0.1 for the Slurm launcher's tests: munged on its own socket and key,
slurmctld, and two slurmd (nodes gv1, gv2) on this host, configured in a temporary folder. With a
`Placement` the same cluster runs on separate hosts (tests/hosts.py): slurmctld on the controller's
host, each slurmd on its own node, at their own addresses; the one munged is reached by its socket's
path, which every host sees (a shared socket stands in for a munged per host with the same key).

Nothing of the machine's own Slurm or munge set-up is read or changed: every daemon gets its own
config, socket, ports, spool and state folders, and `SLURM_CONF` points the clients at them. Debian's
slurm-wlm runs two slurmd on one host with `slurmd -N <node>` when each node has its own Port and
the spool and pid files are per node (%n).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import free_ports

NODES = ("gv1", "gv2")
PARTITION = "gv"


def daemon(name: str) -> str:
    """A Slurm or munge daemon's path (they live in /usr/sbin, often not on a user's PATH)."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if not found:
        pytest.skip(f"{name} is not installed; `make slurm` installs slurm-wlm and munge")
    return found


def node_hardware(slurmd: str) -> str:
    """This host's CPUs, sockets, cores and memory as slurmd detects them (`slurmd -C`), so that a
    node's configuration matches what its slurmd registers with and the node is not drained."""
    line = subprocess.run([slurmd, "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    return " ".join(w for w in line.split() if not w.startswith(("NodeName=", "UpTime=")))


@dataclass(frozen=True)
class Placement:
    """Where the daemons run: the controller's host name and address, each node's (NODES order) host
    name and address, the argv prefix that starts a program on a host (e.g. nsenter into its
    namespaces), and an optional TaskProlog (a node's own environment for its tasks)."""

    controller: tuple[str, str]
    nodes: tuple[tuple[str, str], ...]
    on_host: Callable[[str], list[str]] = lambda host: []
    task_prolog: str = ""


def this_host() -> Placement:
    """Every daemon on this host, at 127.0.0.1 (the default)."""
    host = socket.gethostname()
    return Placement((host, "127.0.0.1"), tuple((host, "127.0.0.1") for _ in NODES))


def slurm_conf(root: Path, munge_socket: Path, slurmd: str, placement: Placement | None = None) -> str:
    placement = placement or this_host()
    (host, addr), prolog = placement.controller, placement.task_prolog
    ctld_port, *node_ports = free_ports(1 + len(NODES))
    nodes = [
        f"NodeName={name} NodeHostname={node_host} NodeAddr={node_addr} Port={port} {node_hardware(slurmd)} "
        "State=UNKNOWN"
        for name, (node_host, node_addr), port in zip(NODES, placement.nodes, node_ports)
    ]
    return "\n".join(
        [
            "ClusterName=ghostvis-test",
            f"SlurmctldHost={host}({addr})",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "MailProg=/bin/true",
            "MpiDefault=none",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            *([f"TaskProlog={prolog}"] if prolog else []),
            *nodes,
            f"PartitionName={PARTITION} Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE:4",
            "",
        ]
    )


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    placement: Placement = field(default_factory=this_host)

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (on the controller's host)."""
        return subprocess.run(
            [*self.placement.on_host(self.placement.controller[0]), *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def start(self, log_name: str, exe: str, *args: str, host: str = "") -> None:
        """A daemon in the foreground on `host` (default: the controller's), in its own process group,
        its output in log/<log_name>.out."""
        on_host = self.placement.on_host(host or self.placement.controller[0])
        with (self.root / "log" / f"{log_name}.out").open("w") as log:
            self.procs.append(
                subprocess.Popen(
                    [*on_host, daemon(exe), *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env(),
                    start_new_session=True,
                )
            )

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.root / "log").iterdir()))

    def wait_idle(self, timeout: float = 60) -> None:
        """Until sinfo shows every node idle (slurmd registered and the node schedulable)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")
            if sorted(line.split()[1] for line in states if line.strip()) == ["idle"] * len(NODES):
                return
            time.sleep(0.5)
        raise AssertionError(f"Slurm nodes not idle within {timeout} s: {states}\n{self.logs()}")

    def stop(self) -> None:
        """Cancel what still runs (a job's processes outlive slurmd), then stop the daemons."""
        self.run("scancel", f"--partition={PARTITION}")
        deadline = time.time() + 60
        while self.run("squeue", "-h").stdout.strip() and time.time() < deadline:
            time.sleep(0.5)
        for proc in reversed(self.procs):
            stop_group(proc)
        shutil.rmtree(self.root, ignore_errors=True)


def start_cluster(placement: Placement | None = None) -> SlurmCluster:
    """munged, slurmctld and the slurmd of gv1 and gv2, up and idle (on this host, or as `placement` says)."""
    root = Path(tempfile.mkdtemp(prefix="gv-slurm-"))
    root.chmod(0o755)  # munged wants its socket's folders searchable by all
    for sub in ("munge", "state", "log", *(f"spool/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True)
    (root / "munge").chmod(0o755)
    key_dir = root / "munge-key"
    key_dir.mkdir(mode=0o700)
    (key_dir / "munge.key").write_bytes(os.urandom(1024))
    (key_dir / "munge.key").chmod(0o400)
    sock = root / "munge" / "munge.socket"
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, sock, daemon("slurmd"), placement))
    cluster = SlurmCluster(root, conf, placement=placement or this_host())
    try:
        boot(cluster, sock, key_dir)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def boot(cluster: SlurmCluster, sock: Path, key_dir: Path) -> None:
    root, conf = cluster.root, cluster.conf
    cluster.start(
        "munged",
        "munged",
        "-F",
        f"--socket={sock}",
        f"--key-file={key_dir / 'munge.key'}",
        f"--pid-file={root}/munge/munged.pid",
        f"--seed-file={key_dir}/munged.seed",
        f"--log-file={root}/log/munged.log",
    )
    wait_for(lambda: sock.exists(), "munged's socket", cluster)
    cluster.start("slurmctld", "slurmctld", "-D", "-f", str(conf))
    wait_for(lambda: cluster.run("scontrol", "ping").returncode == 0, "slurmctld", cluster)
    for node, (node_host, _) in zip(NODES, cluster.placement.nodes):
        cluster.start(f"slurmd-{node}", "slurmd", "-D", "-N", node, "-f", str(conf), host=node_host)
    cluster.wait_idle()


def wait_for(ready, what: str, cluster: SlurmCluster, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not ready():
        if time.time() > deadline:
            raise AssertionError(f"{what} did not come up within {timeout} s:\n{cluster.logs()}")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The running cluster; SLURM_CONF points this process and its children (the dagster CLI) at it."""
    cluster = start_cluster()
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        cluster.stop()


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a daemon started in its own process group: SIGTERM, then SIGKILL after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
