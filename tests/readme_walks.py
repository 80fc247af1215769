"""The README's copy-paste walks, run verbatim from an empty folder: its blocks between markers, a folder
served over HTTP or uploaded to the S3 server, and the commands run by bash as a user runs them."""

from __future__ import annotations

import contextlib
import functools
import re
import subprocess
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ghostvis_core.home import Home
from tests.conftest import BIN, cli_env, new_bucket

ROOT = Path(__file__).resolve().parent.parent


def readme_blocks(marker: str) -> tuple[list[str], list[str]]:
    """(yaml blocks, bash blocks) between the README's <!-- marker:begin --> and <!-- marker:end -->."""
    text = (ROOT / "README.md").read_text()
    block = re.search(rf"<!-- {marker}:begin -->(.*?)<!-- {marker}:end -->", text, re.S).group(1)
    return re.findall(r"```yaml\n(.*?)```", block, re.S), re.findall(r"```bash\n(.*?)```", block, re.S)


@contextlib.contextmanager
def served_folder(folder: Path) -> Iterator[str]:
    """An HTTP server of `folder` on 127.0.0.1: its host:port."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(SimpleHTTPRequestHandler, directory=str(folder)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def upload_folder(endpoint: str, bucket: str, folder: Path) -> None:
    """A new bucket holding every file under `folder`, keyed by its path in the folder."""
    import boto3

    new_bucket(endpoint, bucket)
    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test"
    )
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            client.upload_file(str(p), bucket, p.relative_to(folder).as_posix())


def walk(
    workdir: Path,
    files: dict[str, str],
    commands: str,
    endpoint: str | None = None,
    stop_before: str | None = None,
    **env: str,
) -> tuple[Home, str]:
    """The commands in `workdir` holding `files` (name -> text), with bash (`set -ex`: the log names the failing
    line), the S3 server's AWS variables when there is an `endpoint`, and `env`; no GHOSTVIS_PRESET unless `env`
    gives one. The walk's home is workdir/my-home."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (workdir / name).write_text(text)
    aws = {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    environ = cli_env(workdir / "unused", **(aws if endpoint else {}))
    for var in ("GHOSTVIS_HOME", "DAGSTER_HOME", "GHOSTVIS_PRESET"):
        environ.pop(var)
    environ.update(env, PATH=f"{BIN}:{environ['PATH']}")
    lines = [line for line in commands.splitlines() if line.strip() and not line.startswith("#")]
    if stop_before:
        lines = lines[: next(i for i, line in enumerate(lines) if line.startswith(stop_before))]
    script = "set -ex\n" + "\n".join(lines) + "\n"
    proc = subprocess.run(
        ["bash", "-c", script], cwd=workdir, env=environ, capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, f"README walk failed\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    return Home(workdir / "my-home"), proc.stdout
