"""What the browser tests share: the Dagster UI and the MLflow server started on a home (each in its
own process group, killed after), headless Chromium (Debian's, driven by Playwright) and its pages,
screenshots into test-artifacts/ui/, and reading numbers as the UI prints them."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from ghostvis_core.home import Home
from tests.conftest import ARTIFACTS, BIN, MLFLOW_SERVER_ENV, cli_env, free_port

ROOT = Path(__file__).resolve().parent.parent

# Debian's chromium under Playwright (Playwright's own browser download is not used). Without the
# background-networking flags chromium dials out at start-up, which a closed network refuses.
CHROMIUM = os.environ.get("GHOSTVIS_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVICE_START_S = 180  # a loaded 2-core CI machine imports dagster/mlflow slowly
UI_TIMEOUT_MS = 60_000


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except Exception:
        return 0


@contextmanager
def service(name: str, cmd: list[str], env: dict[str, str], ready_url: str, cwd: Path):
    """Start `cmd` in its own process group, wait until `ready_url` answers 200, kill the group after."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log_path = ARTIFACTS / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + SERVICE_START_S
            while _get(ready_url) != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"{name} did not come up at {ready_url} (exit code {proc.poll()}):\n"
                        + log_path.read_text()[-4000:]
                    )
                time.sleep(0.5)
            yield proc
        finally:
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue


@contextmanager
def dagster_ui(home: Path, log_name: str, daemon: bool = False, **env: str):
    """The Dagster UI on `home`'s instance, its URL: dagster-webserver alone (browsing), or `dagster dev`
    (webserver and daemon: runs launched from the UI leave the queue and run)."""
    port = free_port()
    serve = ["dev"] if daemon else []
    exe = BIN / ("dagster" if daemon else "dagster-webserver")
    cmd = [str(exe), *serve, "-m", "ghostvis_pipeline.definitions", "-h", "127.0.0.1", "-p", str(port)]
    url = f"http://127.0.0.1:{port}"
    with service(log_name, cmd, cli_env(home, **env), f"{url}/server_info", cwd=ROOT):
        yield url


@contextmanager
def mlflow_server(home: Path, log_name: str, cwd: Path):
    """`mlflow server` on `home`'s tracking store, its URL; `cwd` a scratch folder, so the server's
    default ./mlartifacts never lands in the project."""
    port = free_port()
    cmd = mlflow_server_command(port, Home(home).mlflow_tracking_uri)
    url = f"http://127.0.0.1:{port}"
    with service(log_name, cmd, cli_env(home, **MLFLOW_SERVER_ENV), f"{url}/health", cwd=cwd):
        yield url


def mlflow_server_command(port: int, backend_store_uri: str, *options: str) -> list[str]:
    """The `mlflow server` command line every test's server runs: 127.0.0.1:`port`, one worker."""
    return [
        str(BIN / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        backend_store_uri,
        *options,
    ]


@contextmanager
def chromium():
    """Debian's Chromium, headless, under Playwright."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        raise AssertionError(
            f"chromium not found at {CHROMIUM}: `apt-get install -y chromium` (make test does "
            "it), or point GHOSTVIS_CHROMIUM at a Chromium binary"
        )
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@contextmanager
def captured_page(browser, request, width: int, height: int, name: str = ""):
    """A page in a fresh browser context (no stored UI choices); if the test (or the block using it)
    fails, the page as it was is saved as FAILED-<name or test>.png with its URL and visible text."""
    ctx = browser.new_context(viewport={"width": width, "height": height})
    # Dagster's "Join the Dagster community" modal (shown after 1 s on 127.0.0.1) would cover the page;
    # this is what its Skip button stores, so no mutation reaches the demo's instance.
    ctx.add_init_script("window.localStorage.setItem('communityNux', '1')")
    ctx.set_default_timeout(UI_TIMEOUT_MS)
    pg = ctx.new_page()
    failed_before = request.session.testsfailed
    try:
        yield pg
    except BaseException:
        _save_failure(pg, name or request.node.name)
        raise
    else:
        if request.session.testsfailed > failed_before:  # this test's call phase failed
            _save_failure(pg, name or request.node.name)
    finally:
        ctx.close()


def _save_failure(pg, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        pg.screenshot(path=str(ARTIFACTS / f"FAILED-{name}.png"), full_page=True)
        (ARTIFACTS / f"FAILED-{name}.txt").write_text(f"{pg.url}\n\n{pg.inner_text('body')}")
    except Exception:
        pass


def shot(pg, name: str, full_page: bool = True) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=full_page)


def eventually(read, ok, timeout_s: float = UI_TIMEOUT_MS / 1000, every_s: float = 0.5):
    """read() until ok(value) or the timeout (an SPA renders in steps); returns the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if ok(value) or time.monotonic() > deadline:
            return value
        time.sleep(every_s)


def as_int(text: str) -> int:
    text = text.strip()
    assert re.fullmatch(r"-?[\d,]+", text), f"not an integer as displayed: {text!r}"
    return int(text.replace(",", ""))
