"""Separate hosts made by the test itself: a Dagster host and two nodes that share nothing but the
network the test gives them and the code (/work/main and its .venv, like software installed on every
node).

    root netns (pytest)     no address of the test's hosts is reachable from here, and nothing in the
                            hosts can reach the machine's network: they have no route to it
    gvhost  10.23.1.1       its own network, mount and UTS namespace: the Dagster CLI, the S3 server,
            10.23.2.1       the MLflow server, slurmctld; forwards between the two nodes
    gv1     10.23.1.2       a namespace of its own, joined to gvhost by a veth pair
    gv2     10.23.2.2       idem

Every node's mount namespace hides the Dagster host's folder (a tmpfs over it): its GHOSTVIS_HOMEs,
its HOME and its store cache; a node's store cache is its own. A node is entered the way ssh
would: `nodesh <host> '<command>'` starts a login
shell there with only the node's own environment (its profile: PATH, HOME, the S3 endpoint, its own
~/.aws/credentials), never the caller's. Namespaces are held by a `sleep` per host, entered with
nsenter; every process of the test is started and stopped by it.

As a module: `python -m tests.hosts upload|download|copy|keys|grep ENDPOINT BUCKET PREFIX FOLDER|NEW_PREFIX|-|TEXT`,
an S3 client the test runs on the Dagster host (the S3 server is reachable only there).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import MLFLOW_SERVER_ENV
from tests.slurm_cluster import stop_group

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
DAGSTER_HOST = "gvhost"
HOST_ADDR = "10.23.1.1"  # the Dagster host as every node reaches it (gv2 through gvhost's forwarding)
# node -> (the Dagster host's end of its veth pair, the node's end). Node names sort before
# "gvhost": torchrun ranks nodes by host name, so a node, not the Dagster host, gets rank 0.
NODES = {"gv1": ("10.23.1.1", "10.23.1.2"), "gv2": ("10.23.2.1", "10.23.2.2")}
S3_PORT, MLFLOW_PORT = 9000, 5000
BUCKET, PREFIX = "ghostvis", "team/store"  # the first home's store
DEMO_PREFIX = "demo/store"  # the demo's store as built, never run against: what every test's store copies


def fail_without_namespaces(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        pytest.fail(
            f"cannot make separate hosts: {what} failed ({proc.stderr.strip()}); these tests need "
            "CAP_NET_ADMIN and CAP_SYS_ADMIN (root, or a container started with --privileged)"
        )


@dataclass
class Hosts:
    """The running hosts: their namespace holders, and the services started in them."""

    root: Path
    secret: str  # AWS_SECRET_ACCESS_KEY of every host; S3 accepts any, the test looks for it everywhere
    holders: dict[str, subprocess.Popen] = field(default_factory=dict)
    services: list[subprocess.Popen] = field(default_factory=list)

    # -- entering a host ---------------------------------------------------------------------------
    def enter(self, host: str, cwd: Path = REPO) -> list[str]:
        """The argv prefix that runs a program in `host`'s namespaces, in folder `cwd`."""
        return ["nsenter", "-t", str(self.holders[host].pid), "-n", "-m", "-u", f"--wd={cwd}", "--"]

    def sh(self, host: str, command: str, check: bool = True) -> subprocess.CompletedProcess:
        """A root shell command in `host`'s namespaces (setting the host up)."""
        proc = subprocess.run(
            [*self.enter(host), "sh", "-c", command], capture_output=True, text=True, timeout=60, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{host}: `{command}` exited {proc.returncode}: {proc.stderr}")
        return proc

    @property
    def nodesh(self) -> Path:
        """The nodes' "ssh": `nodesh HOST COMMAND` runs COMMAND in a login shell on HOST."""
        return self.root / "bin" / "nodesh"

    def profile(self, host: str) -> Path:
        return self.root / host / "profile"

    def cache(self, host: str) -> Path:
        return self.root / host / "store-cache"

    @property
    def home(self) -> Path:
        """The Dagster host's first GHOSTVIS_HOME (the servers'); others are beside it, hidden alike."""
        return self.ghostvis_home("ghostvis")

    def ghostvis_home(self, name: str) -> Path:
        return self.root / DAGSTER_HOST / name

    # -- the Dagster host's environment ------------------------------------------------------------
    @property
    def store_uri(self) -> str:
        return f"s3://{BUCKET}/{PREFIX}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{HOST_ADDR}:{S3_PORT}"

    @property
    def mlflow_uri(self) -> str:
        return f"http://{HOST_ADDR}:{MLFLOW_PORT}"

    def dagster_env(self, home: Path | None = None, **extra: str) -> dict[str, str]:
        """What a user on the Dagster host has set: the home, the bucket, the servers, credentials."""
        from tests.conftest import cli_env

        env = {k: v for k, v in cli_env(home or self.home).items() if not k.startswith("AWS_")}
        env.update(
            GHOSTVIS_STORE=self.store_uri,
            GHOSTVIS_STORE_CACHE=str(self.cache(DAGSTER_HOST)),
            MLFLOW_TRACKING_URI=self.mlflow_uri,
            HOME=str(self.root / DAGSTER_HOST / "home"),
            LOGLEVEL="INFO",
            **s3_client_env(self.s3_endpoint, self.secret),
        )
        return {**env, **extra}

    def run(self, args: list[str], home: Path | None = None, timeout: float = 900, check: bool = True, **extra: str):
        """A console script of the venv (dagster, ghostvis) on the Dagster host, as its user runs it."""
        exe = str(BIN / args[0]) if (BIN / args[0]).exists() else args[0]
        proc = subprocess.run(
            [*self.enter(DAGSTER_HOST), exe, *args[1:]],
            env=self.dagster_env(home, **extra),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
            )
        return proc

    def start(self, args: list[str], log: Path, home: Path, **extra: str) -> subprocess.Popen:
        """`run` in the background, its output in `log`: for a test that acts while it runs."""
        with log.open("w") as out:
            return subprocess.Popen(
                [*self.enter(DAGSTER_HOST), str(BIN / args[0]), *args[1:]],
                env=self.dagster_env(home, **extra),
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def keys(self, prefix: str) -> list[str]:
        """The bucket's keys under `prefix`."""
        return self.s3("keys", prefix, "-")

    def keys_holding(self, text: str) -> list[str]:
        """The keys of the bucket's objects whose bytes contain `text`."""
        return self.s3("grep", "", text)

    def kill_node(self, node: str) -> list[int]:
        """SIGKILL every process on `node` (in its network namespace) but the namespace's holder: the
        node crashed. The pids killed."""
        holder = self.holders[node].pid
        netns = os.readlink(f"/proc/{holder}/ns/net")
        killed = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != holder:
                try:
                    if os.readlink(entry / "ns" / "net") == netns:
                        os.kill(int(entry.name), signal.SIGKILL)
                        killed.append(int(entry.name))
                except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
                    pass
                except PermissionError:  # not the test's (e.g. the container's init)
                    pass
        return killed

    def download(self, store_uri: str, dest: Path, *folders: str) -> Path:
        """`folders` of the store at `store_uri` (an S3 URI of this bucket) copied under `dest`: a
        folder store to read, its path."""
        prefix = store_uri.removeprefix(f"s3://{BUCKET}/")
        for folder in folders:
            self.s3("download", f"{prefix}/{folder}/", str(dest))
        return dest / prefix

    def store_copy(self, name: str) -> str:
        """A copy of the demo store (copied inside the S3 server) at prefix <name>/store, its URI: a
        test's own store, so that its run is not one an earlier test completed."""
        self.s3("copy", DEMO_PREFIX, f"{name}/store")
        return f"s3://{BUCKET}/{name}/store"

    def s3(self, action: str, prefix: str, target: str) -> list[str]:
        """This module's S3 client on the Dagster host: what it printed, a line each."""
        return self.run(
            [str(BIN / "python"), "-m", "tests.hosts", action, self.s3_endpoint, BUCKET, prefix, target]
        ).stdout.split()

    # -- starting and stopping ---------------------------------------------------------------------
    def service(self, host: str, name: str, argv: list[str], env: dict[str, str], ready_url: str = "") -> None:
        """A long-running process on `host` in its own process group, its output in logs/<name>.out."""
        log = (self.root / "logs" / f"{name}.out").open("w")
        self.services.append(
            subprocess.Popen(
                [*self.enter(host, cwd=self.root), *argv],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        if ready_url:
            self.wait_http(host, ready_url, name)

    def wait_http(self, host: str, url: str, name: str, timeout: float = 180) -> None:
        probe = f"import urllib.request; urllib.request.urlopen({url!r}, timeout=2)"
        deadline = time.time() + timeout
        while time.time() < deadline:
            if (
                subprocess.run(
                    [*self.enter(host), str(BIN / "python"), "-c", probe], capture_output=True, check=False
                ).returncode
                == 0
            ):
                return
            time.sleep(0.5)
        raise AssertionError(f"{name} did not answer {url} on {host} within {timeout} s:\n{self.log(name)}")

    def log(self, name: str) -> str:
        return (self.root / "logs" / f"{name}.out").read_text()[-4000:]

    def stop(self) -> None:
        """Every service (with its process group), then the namespace holders."""
        for proc in reversed(self.services):
            stop_group(proc)
        for proc in reversed(list(self.holders.values())):
            stop_group(proc)


def s3_client_env(endpoint: str, secret: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "gvtest",
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def hold(argv: list[str]) -> subprocess.Popen:
    """A `sleep` holding new namespaces (its pid is what nsenter enters), or the test fails saying why."""
    proc = subprocess.Popen(
        [*argv, "sleep", "infinity"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        text=True,
    )
    time.sleep(0.3)
    if proc.poll() is not None:
        fail_without_namespaces(
            subprocess.CompletedProcess(argv, proc.returncode, "", proc.stderr.read()), " ".join(argv)
        )
    return proc


def make_hosts(root: Path, secret: str) -> Hosts:
    """gvhost and the nodes gv1, gv2, networked, each with its own /etc/hosts, HOME and profile. The
    nodes do not see the Dagster host's folder under `root` (GHOSTVIS_HOMEs, HOME, store cache)."""
    for host in (DAGSTER_HOST, *NODES):
        (root / host / "home" / ".aws").mkdir(parents=True)
    (root / "logs").mkdir()
    (root / "bin").mkdir()
    hosts = Hosts(root, secret)
    unshare = ["unshare", "--net", "--mount", "--uts", "--propagation", "private", "--"]
    try:
        hosts.holders[DAGSTER_HOST] = hold(unshare)
        etc_hosts = root / "etc-hosts"
        etc_hosts.write_text(
            "127.0.0.1 localhost\n"
            + f"{HOST_ADDR} {DAGSTER_HOST}\n"
            + "".join(f"{node_addr} {node}\n" for node, (_, node_addr) in NODES.items())
        )
        hosts.sh(
            DAGSTER_HOST,
            f"hostname {DAGSTER_HOST} && ip link set lo up && mount --bind {etc_hosts} /etc/hosts"
            " && sysctl -qw net.ipv4.ip_forward=1",
        )
        for node, (host_addr, node_addr) in NODES.items():
            hosts.holders[node] = hold([*hosts.enter(DAGSTER_HOST), *unshare])
            pid = hosts.holders[node].pid
            hosts.sh(
                DAGSTER_HOST,
                f"ip link add v-{node} type veth peer name eth0 netns {pid} && "
                f"ip addr add {host_addr}/24 dev v-{node} && ip link set v-{node} up",
            )
            hosts.sh(
                node,
                f"hostname {node} && ip link set lo up && ip addr add {node_addr}/24 dev eth0 && "
                f"ip link set eth0 up && ip route add default via {host_addr} && "
                f"mount -t tmpfs -o size=1m hidden {root / DAGSTER_HOST}",
            )
            write_profile(hosts, node)
        write_nodesh(hosts)
    except BaseException:
        hosts.stop()
        raise
    return hosts


def write_profile(hosts: Hosts, node: str) -> None:
    """The node's login environment, and its own credentials file (nothing comes from the Dagster host)."""
    home = hosts.root / node / "home"
    (home / ".aws" / "credentials").write_text(
        f"[default]\naws_access_key_id = gvtest\naws_secret_access_key = {hosts.secret}\n"
    )
    env = {
        "PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "AWS_ENDPOINT_URL_S3": hosts.s3_endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "GHOSTVIS_STORE_CACHE": str(hosts.cache(node)),
        "MLFLOW_TRACKING_URI": hosts.mlflow_uri,
        "PYTHONUNBUFFERED": "1",
        "LOGLEVEL": "INFO",  # torchrun's: it logs the rendezvous (which host is the master)
        # the code under test, where the test's is not the venv's own checkout (a git worktree), as a cluster's
        # nodes run the code the Dagster host does
        **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}),
    }
    hosts.profile(node).write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))


def write_nodesh(hosts: Hosts) -> None:
    pids = " ".join(f"{node}={hosts.holders[node].pid}" for node in NODES)
    hosts.nodesh.write_text(f"""#!/bin/sh
# nodesh HOST COMMAND: COMMAND in a login shell on HOST (one of: {" ".join(NODES)}), like `ssh HOST COMMAND`
host=$1; shift
for pair in {pids}; do [ "${{pair%%=*}}" = "$host" ] && pid=${{pair#*=}}; done
[ -n "$pid" ] || {{ echo "nodesh: no host $host" >&2; exit 255; }}
exec nsenter -t "$pid" -n -m -u -- env -i /bin/sh -c '. "$0" && cd "$HOME" && exec /bin/sh -c "$1"' \\
    {hosts.root}/"$host"/profile "$*"
""")
    hosts.nodesh.chmod(0o755)


def slurm_placement(hosts: Hosts):
    """The test Slurm cluster on these hosts: slurmctld (and munged) on the Dagster host, a slurmd on
    each node. A TaskProlog gives the job's tasks their node's own environment (HOME with its
    credentials file, store cache, S3 endpoint), as a cluster's login set-up would."""
    from tests.slurm_cluster import Placement

    prolog = hosts.root / "bin" / "taskprolog"
    prolog.write_text(
        f"#!/bin/sh\n# export lines for the task: its node's profile\ncat {hosts.root}/$(hostname)/profile\n"
    )
    prolog.chmod(0o755)
    return Placement(
        controller=(DAGSTER_HOST, HOST_ADDR),
        nodes=tuple((node, addr) for node, (_, addr) in NODES.items()),
        on_host=hosts.enter,
        task_prolog=str(prolog),
    )


def start_servers(hosts: Hosts) -> None:
    """The S3 server and the MLflow tracking server (on the home's tracking store), on the Dagster host."""
    env = hosts.dagster_env()
    hosts.service(
        DAGSTER_HOST,
        "s3",
        [str(BIN / "moto_server"), "-H", "0.0.0.0", "-p", str(S3_PORT)],
        env,
        f"{hosts.s3_endpoint}/moto-api/",
    )
    hosts.service(
        DAGSTER_HOST,
        "mlflow",
        [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "0.0.0.0",
            "--port",
            str(MLFLOW_PORT),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{hosts.home / 'mlflow.db'}",
            "--artifacts-destination",
            str(hosts.home / "mlartifacts"),
        ],
        {**env, **MLFLOW_SERVER_ENV},
        f"{hosts.mlflow_uri}/health",
    )


def keep_pretrain_checkpoints_only(store: Path) -> None:
    """Delete every stage's checkpoints but pretrain's from a copy of the demo store bound for a bucket: the tests
    on S3 train and audit pretrain only, and the other seven stages' checkpoints (85% of the store's bytes) would
    only be uploaded, copied inside the S3 server and searched. Their records, ledger parts and models stay."""
    for stage in (store / "checkpoints").iterdir():
        if stage.name != "pretrain":
            shutil.rmtree(stage)


def move_store_to_bucket(hosts: Hosts) -> None:
    """The first home's store folder goes to the bucket (same keys under DEMO_PREFIX, copied to
    PREFIX for the first home), and is deleted: nothing can come from the folder any more."""
    store = hosts.home / "store"
    keep_pretrain_checkpoints_only(store)
    hosts.s3("upload", DEMO_PREFIX, str(store))
    shutil.rmtree(store)
    hosts.s3("copy", DEMO_PREFIX, PREFIX)


def another_home(hosts: Hosts, demo_home: Path, name: str) -> tuple[Path, str]:
    """A fresh GHOSTVIS_HOME on the Dagster host (its own Dagster instance: no earlier run is a cache
    hit) and its own store, a copy of the demo's in the bucket: (the home, the store's URI)."""
    from tests.conftest import copy_home

    home = copy_home(demo_home, hosts.ghostvis_home(name))
    shutil.rmtree(home / "store")
    return home, hosts.store_copy(name)


# -- the S3 client, run on the Dagster host ----------------------------------------------------------
def _client(endpoint: str):
    import boto3
    from botocore.config import Config

    # moto's GetObject of some objects made by CopyObject sends a checksum their body does not match
    # (botocore FlexibleChecksumError); the test compares bytes itself: validate only when asked to
    return boto3.client("s3", endpoint_url=endpoint, config=Config(response_checksum_validation="when_required"))


def upload(endpoint: str, bucket: str, prefix: str, folder: str) -> None:
    client = _client(endpoint)
    client.create_bucket(Bucket=bucket)
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")


def _keys(client, bucket: str, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def download(endpoint: str, bucket: str, prefix: str, folder: str) -> None:
    client = _client(endpoint)
    for key in _keys(client, bucket, prefix):
        dest = Path(folder) / key
        dest.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, key, str(dest))


def copy(endpoint: str, bucket: str, prefix: str, new_prefix: str) -> None:
    client = _client(endpoint)
    for key in _keys(client, bucket, f"{prefix}/"):
        client.copy_object(
            Bucket=bucket, Key=new_prefix + key[len(prefix) :], CopySource={"Bucket": bucket, "Key": key}
        )


def keys(endpoint: str, bucket: str, prefix: str, _: str) -> None:
    print("\n".join(_keys(_client(endpoint), bucket, prefix)))


def grep(endpoint: str, bucket: str, prefix: str, text: str) -> None:
    """The keys of the objects whose bytes contain `text`, read one at a time (nothing on disk)."""
    client = _client(endpoint)
    for key in _keys(client, bucket, prefix):
        if text.encode() in client.get_object(Bucket=bucket, Key=key)["Body"].read():
            print(key)


if __name__ == "__main__":
    action, endpoint, bucket, prefix, target = sys.argv[1:]
    {"upload": upload, "download": download, "copy": copy, "keys": keys, "grep": grep}[action](
        endpoint, bucket, prefix, target
    )
