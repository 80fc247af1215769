"""A throwaway PostgreSQL server for the tests of Dagster's Postgres storage (deploy/dagster-postgres.yaml):
Debian's `postgresql` binaries, a cluster made by initdb in a temporary folder, listening on 127.0.0.1
on a free port (its unix socket in that folder too), with a password-authenticated superuser and one
database. Stopped and deleted at teardown.

Nothing of the machine's own PostgreSQL is read or changed: no service is started, no system
cluster is used. PostgreSQL refuses to run as root, so under root the server runs as the `postgres`
user that Debian's package creates (subprocess's `user=`), in a folder owned by it.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port

SUPERUSER = "ghostvis"
DATABASE = "dagster"


def bin_dir() -> Path:
    """The newest installed PostgreSQL's binaries (Debian keeps them off PATH, per major version)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if not found:
        pytest.skip("PostgreSQL is not installed; `make postgres` installs Debian's postgresql package")
    return found[-1].parent


def server_user() -> str | None:
    """Who runs initdb and postgres: this user, or `postgres` when this is root (postgres refuses root)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres").pw_name
    except KeyError:
        pytest.skip("running as root and there is no `postgres` user to run the server; `make postgres` creates it")


@dataclass
class PostgresServer:
    root: Path
    port: int
    password: str
    proc: subprocess.Popen | None = None
    host: str = "127.0.0.1"
    user: str = SUPERUSER
    database: str = DATABASE

    def dagster_env(self) -> dict[str, str]:
        """The variables deploy/dagster-postgres.yaml reads, pointing at this server's database."""
        return {
            "DAGSTER_PG_HOST": self.host,
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USER": self.user,
            "DAGSTER_PG_PASSWORD": self.password,
            "DAGSTER_PG_DB": self.database,
        }

    def url(self) -> str:
        return f"postgresql://{self.user}:{self.password}@{self.host}:{self.port}/{self.database}"

    def client(self, tool: str, *args: str) -> subprocess.CompletedProcess:
        """A PostgreSQL client (psql, createdb, pg_isready) against this server, checked."""
        env = {**os.environ, "PGPASSWORD": self.password}
        return subprocess.run(
            [str(bin_dir() / tool), "-h", self.host, "-p", str(self.port), "-U", self.user, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )

    def log(self) -> str:
        path = self.root / "postgres.log"
        return path.read_text()[-4000:] if path.exists() else ""

    def stop(self) -> None:
        """Fast shutdown (SIGINT: clients disconnected, then a clean checkpoint), then delete the cluster."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def as_server_user(args: list[str], log: Path | None = None, **popen) -> subprocess.Popen:
    """Start a PostgreSQL program as the server's user, its output in `log` (or discarded)."""
    out = log.open("w") if log else subprocess.DEVNULL
    return subprocess.Popen(args, user=server_user(), stdout=out, stderr=subprocess.STDOUT, **popen)


def init_cluster(server: PostgresServer) -> None:
    """initdb: a cluster with a scram-sha-256 password superuser, no trust login, in server.root/data."""
    user = server_user()
    if user:
        shutil.chown(server.root, user=user, group=user)
    pwfile = server.root / "pwfile"
    pwfile.write_text(server.password + "\n")
    if user:
        shutil.chown(pwfile, user=user, group=user)
    init = as_server_user(
        [
            str(bin_dir() / "initdb"),
            "-D",
            str(server.root / "data"),
            "-U",
            server.user,
            f"--pwfile={pwfile}",
            "--auth=scram-sha-256",
            "-E",
            "UTF8",
            "--no-sync",
        ],
        log=server.root / "initdb.log",
    )
    if init.wait(timeout=120) != 0:
        raise AssertionError(f"initdb failed:\n{(server.root / 'initdb.log').read_text()[-4000:]}")
    pwfile.unlink()


def wait_ready(server: PostgresServer, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"postgres exited {server.proc.returncode}:\n{server.log()}")
        ready = subprocess.run(
            [str(bin_dir() / "pg_isready"), "-h", server.host, "-p", str(server.port)], capture_output=True
        )
        if ready.returncode == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"postgres not accepting connections within {timeout} s:\n{server.log()}")


def start_server() -> PostgresServer:
    """A running server with the `dagster` database created, owned by the test."""
    server = PostgresServer(Path(tempfile.mkdtemp(prefix="gv-postgres-")), free_port(), secrets.token_hex(12))
    try:
        init_cluster(server)
        server.proc = as_server_user(
            [
                str(bin_dir() / "postgres"),
                "-D",
                str(server.root / "data"),
                "-h",
                server.host,
                "-p",
                str(server.port),
                "-k",
                str(server.root),
            ],
            log=server.root / "postgres.log",
            start_new_session=True,
        )
        wait_ready(server)
        server.client("createdb", server.database)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def postgres_server():
    server = start_server()
    try:
        yield server
    finally:
        server.stop()
