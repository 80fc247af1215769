"""Shard downloads: file://, http(s):// (a local server that fails on demand) and s3:// (moto server).

Every server binds 127.0.0.1 on a port the OS picks and is stopped by its fixture; retries back off by
milliseconds here (RETRY_BASE_DELAY_S is patched), so the whole module runs in a few seconds.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import threading
import time
import traceback
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import Stubber

from ghostvis_core.data import shard_manifest
from ghostvis_core.data.shard_manifest import (
    FetchResult,
    Manifest,
    ShardEntry,
    fetch_shard,
    list_remote,
    manifest_for_files,
    manifest_from_pattern,
)
from ghostvis_core.errors import GhostvisError
from tests.conftest import free_port

KEY_ID = "testing-key-id-AKIAGHOSTVIS0001"
SECRET = "testing-secret-Zq8wX2vN5pL0kR7t"
SHARD = "src/00001"


def blob(n: int, seed: int = 0) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (n // 32) + b"x" * (n % 32)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def files_in(folder: Path) -> list[str]:
    return sorted(os.listdir(folder)) if folder.exists() else []


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(shard_manifest, "RETRY_BASE_DELAY_S", 0.01)
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture
def count_attempts(monkeypatch):
    """How many times a download (or listing) was started: one per attempt."""
    calls: list[str] = []
    real = shard_manifest._open_stream

    def counted(what, url):
        calls.append(url)
        return real(what, url)

    monkeypatch.setattr(shard_manifest, "_open_stream", counted)
    return calls


# --- a local HTTP server that fails on demand -----------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        srv: FileServer = self.server.owner
        path = self.path.split("?", 1)[0]
        with srv.lock:
            srv.hits[path] += 1
            n = srv.hits[path]
            srv.auth.append(self.headers.get("Authorization"))
        rule = srv.rules.get(path, {})
        active = n <= rule.get("times", 10**9)  # the rule applies to the first `times` requests
        if active and "status" in rule:
            self.send_error(rule["status"])
            return
        body = srv.files.get(path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        if not (active and rule.get("no_length")):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if active and "stall" in rule:
            self.wfile.flush()
            time.sleep(rule["stall"])
        if active and "drop_after" in rule:
            self.wfile.write(body[: rule["drop_after"]])
            self.wfile.flush()
            self.close_connection = True  # closes the socket before the promised bytes arrived
            return
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class FileServer:
    """Serves `files` {path: bytes}; `rules` {path: {status|drop_after|no_length|stall, times}} make it fail."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.rules: dict[str, dict] = {}
        self.hits: Counter = Counter()
        self.auth: list[str | None] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.owner = self
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def add(self, path: str, data: bytes, **rule) -> str:
        self.files[path] = data
        if rule:
            self.rules[path] = rule
        return self.url(path)


@pytest.fixture
def http():
    server = FileServer()
    server.thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()
    server.thread.join(5)


def entry_for(url: str, data: bytes | None = None, **kw) -> ShardEntry:
    if data is not None:
        kw = {"bytes": len(data), "sha256": sha(data), **kw}
    return ShardEntry("00001", url, **kw)


# --- http(s) --------------------------------------------------------------------------------------


def test_http_fetch_verifies_and_skips_a_present_shard(http, tmp_path):
    data = blob(300_000)
    url = http.add("/data/00001.parquet", data)
    dest = tmp_path / "raw" / "00001.parquet"

    r = fetch_shard(SHARD, entry_for(url, data), dest)
    assert r == FetchResult(dest, len(data), sha(data), downloaded=True)
    assert dest.read_bytes() == data
    assert files_in(dest.parent) == ["00001.parquet"]  # no temp file left behind

    again = fetch_shard(SHARD, entry_for(url, data), dest)
    assert again == FetchResult(dest, len(data), sha(data), downloaded=False)
    assert http.hits["/data/00001.parquet"] == 1  # not downloaded again


def test_http_fetch_without_known_size_or_checksum(http, tmp_path):
    data = blob(5_000)
    r = fetch_shard(SHARD, entry_for(http.add("/a.parquet", data)), tmp_path / "a.parquet")
    assert (r.bytes, r.sha256, r.downloaded) == (len(data), sha(data), True)


def test_http_404_is_permanent_and_names_shard_url_and_fix(http, tmp_path, count_attempts):
    url = http.url("/data/00012.parquet")
    with pytest.raises(GhostvisError) as exc:
        fetch_shard("fineweb/00012", entry_for(url), tmp_path / "00012.parquet")
    msg = str(exc.value)
    assert msg.startswith(f"shard fineweb/00012: {url} not found (HTTP 404)")
    assert "check the source's URL pattern and shard range in the manifest" in msg
    assert len(count_attempts) == 1 and http.hits["/data/00012.parquet"] == 1
    assert files_in(tmp_path) == []


def test_http_dropped_connection_is_retried_then_succeeds(http, tmp_path):
    data = blob(200_000)
    url = http.add("/s.parquet", data, drop_after=50_000, times=2)
    dest = tmp_path / "s.parquet"
    r = fetch_shard(SHARD, entry_for(url, data), dest)
    assert r.downloaded and r.sha256 == sha(data) and dest.read_bytes() == data
    assert http.hits["/s.parquet"] == 3
    assert files_in(tmp_path) == ["s.parquet"]  # each attempt's temp file is gone


def test_http_always_dropping_fails_cleanly_after_the_retries(http, tmp_path):
    data = blob(200_000)
    url = http.add("/s.parquet", data, drop_after=150_000)
    with pytest.raises(GhostvisError) as exc:
        fetch_shard(SHARD, entry_for(url, data), tmp_path / "s.parquet")
    msg = str(exc.value)
    assert msg.startswith(f"shard {SHARD}: {url} failed after 4 attempts (last error: ")
    got = re.search(r"connection lost \(ChunkedEncodingError\) after ([\d,]+) of 200,000 bytes\)", msg)
    assert got and 0 < int(got[1].replace(",", "")) <= 150_000  # bytes kept before the drop
    assert f"check the network or the server and re-materialize raw_shards partition {SHARD}" in msg
    assert http.hits["/s.parquet"] == shard_manifest.RETRY_ATTEMPTS == 4
    assert files_in(tmp_path) == []


def test_http_503_twice_then_success(http, tmp_path):
    data = blob(10_000)
    url = http.add("/s.parquet", data, status=503, times=2)
    r = fetch_shard(SHARD, entry_for(url, data), tmp_path / "s.parquet")
    assert r.sha256 == sha(data)
    assert http.hits["/s.parquet"] == 3


@pytest.mark.parametrize(
    ("status", "error", "attempts"),
    [
        *[pytest.param(s, rf"refused \(HTTP {s}\).*HF_TOKEN", 1, id=f"auth-{s}") for s in (401, 403)],
        *[
            pytest.param(s, rf"failed after 4 attempts \(last error: HTTP {s}\)", 4, id=f"transient-{s}")
            for s in (429, 500, 502, 504)
        ],
    ],
)
def test_http_auth_errors_are_permanent_and_transient_statuses_exhaust_the_retries(
    http, tmp_path, status, error, attempts
):
    url = http.add("/s.parquet", b"x", status=status)
    with pytest.raises(GhostvisError, match=error):
        fetch_shard(SHARD, entry_for(url), tmp_path / "s.parquet")
    assert http.hits["/s.parquet"] == attempts
    assert files_in(tmp_path) == []


def test_cut_transfer_without_content_length_is_retried_when_the_size_is_known(http, tmp_path):
    data = blob(100_000)
    url = http.add("/s.parquet", data, no_length=True, drop_after=30_000, times=1)
    r = fetch_shard(SHARD, entry_for(url, bytes=len(data)), tmp_path / "s.parquet")
    assert r.bytes == len(data)
    assert http.hits["/s.parquet"] == 2


def test_stalled_server_times_out_and_is_retried(http, tmp_path, monkeypatch):
    monkeypatch.setattr(shard_manifest, "HTTP_TIMEOUT_S", (2.0, 0.2))
    data = blob(10_000)
    url = http.add("/s.parquet", data, stall=1.0, times=1)
    r = fetch_shard(SHARD, entry_for(url, data), tmp_path / "s.parquet")
    assert r.sha256 == sha(data)
    assert http.hits["/s.parquet"] == 2


def test_stalled_server_error_says_timed_out(http, tmp_path, monkeypatch):
    monkeypatch.setattr(shard_manifest, "HTTP_TIMEOUT_S", (2.0, 0.1))
    monkeypatch.setattr(shard_manifest, "RETRY_ATTEMPTS", 2)
    url = http.add("/s.parquet", blob(1_000), stall=0.5)
    with pytest.raises(GhostvisError, match=r"failed after 2 attempts \(last error: timed out"):
        fetch_shard(SHARD, entry_for(url), tmp_path / "s.parquet")
    assert files_in(tmp_path) == []


def test_connection_refused_is_retried_then_reported(tmp_path, count_attempts):
    url = f"http://127.0.0.1:{free_port()}/s.parquet"
    with pytest.raises(GhostvisError) as exc:
        fetch_shard(SHARD, entry_for(url), tmp_path / "s.parquet")
    assert f"shard {SHARD}: {url} failed after 4 attempts (last error: connection refused" in str(exc.value)
    assert len(count_attempts) == 4
    assert files_in(tmp_path) == []


def test_checksum_mismatch_names_both_digests_and_keeps_nothing(http, tmp_path):
    data = blob(20_000)
    wrong = sha(b"something else")
    url = http.add("/s.parquet", data)
    with pytest.raises(GhostvisError) as exc:
        fetch_shard(SHARD, entry_for(url, sha256=wrong), tmp_path / "s.parquet")
    msg = str(exc.value)
    assert f"shard {SHARD}: {url}: checksum mismatch" in msg
    assert f"expected sha256 {wrong}, got {sha(data)}" in msg
    assert http.hits["/s.parquet"] == 1  # a complete transfer with the wrong content is not retried
    assert files_in(tmp_path) == []


@pytest.mark.parametrize("delta", [+7, -7])
def test_size_mismatch_names_both_sizes_and_keeps_nothing(http, tmp_path, delta):
    data = blob(20_000)
    url = http.add("/s.parquet", data)
    with pytest.raises(GhostvisError) as exc:
        fetch_shard(SHARD, entry_for(url, bytes=len(data) + delta), tmp_path / "s.parquet")
    assert f"size mismatch (expected {len(data) + delta} bytes, got {len(data)})" in str(exc.value)
    assert http.hits["/s.parquet"] == 1
    assert files_in(tmp_path) == []


def test_a_bad_existing_file_is_replaced(http, tmp_path):
    data = blob(1_000)
    dest = tmp_path / "s.parquet"
    dest.write_bytes(b"stale")
    r = fetch_shard(SHARD, entry_for(http.add("/s.parquet", data), data), dest)
    assert r.downloaded and dest.read_bytes() == data


def test_a_local_disk_error_is_reported_not_retried(http, tmp_path, monkeypatch, count_attempts):
    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shard_manifest.os, "fsync", disk_full)
    url = http.add("/s.parquet", blob(1_000))
    with pytest.raises(GhostvisError, match=rf"^shard {SHARD}: {url}: No space left on device .*check free space"):
        fetch_shard(SHARD, entry_for(url), tmp_path / "s.parquet")
    assert len(count_attempts) == 1
    assert files_in(tmp_path) == []


def test_hf_token_goes_only_to_huggingface_over_https(http, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token")
    hub = "https://huggingface.co/datasets/org/ds/resolve/main/data/00001.parquet"
    assert shard_manifest._http_headers(hub)["Authorization"] == "Bearer hf_secret_token"
    assert "Authorization" not in shard_manifest._http_headers("https://huggingface.co.evil.example/x.parquet")
    assert "Authorization" not in shard_manifest._http_headers("http://huggingface.co/x.parquet")
    assert "Authorization" not in shard_manifest._http_headers("https://example.com/x.parquet")

    fetch_shard(SHARD, entry_for(http.add("/s.parquet", b"abc")), tmp_path / "s.parquet")
    assert http.auth == [None]
    monkeypatch.delenv("HF_TOKEN")
    assert "Authorization" not in shard_manifest._http_headers(hub)


def test_credentials_in_a_url_stay_out_of_messages(http, tmp_path):
    url = http.url("/missing.parquet").replace("http://", "http://user:pa55word@") + "?X-Amz-Signature=s1gnature"
    with pytest.raises(GhostvisError) as exc:
        fetch_shard(SHARD, entry_for(url), tmp_path / "m.parquet")
    msg = str(exc.value)
    assert "not found (HTTP 404)" in msg and "/missing.parquet" in msg
    assert "pa55word" not in msg and "s1gnature" not in msg and "user" not in msg


# --- file:// (unchanged behaviour) ------------------------------------------------------------------


def test_file_fetch_and_skip(tmp_path):
    src = tmp_path / "src" / "00001.parquet"
    src.parent.mkdir()
    src.write_bytes(blob(4_000))
    manifest = manifest_for_files("demo", "text", [(src, "train")])
    entry = manifest.shards[0]
    assert entry.url.startswith("file://") and entry.bytes == 4_000
    dest = tmp_path / "raw" / "00001.parquet"
    r = fetch_shard(manifest.shard_id(entry), entry, dest)
    assert r == FetchResult(dest, 4_000, sha(blob(4_000)), downloaded=True)
    assert fetch_shard(manifest.shard_id(entry), entry, dest).downloaded is False
    assert files_in(dest.parent) == ["00001.parquet"]


def test_file_missing_and_bad_scheme(tmp_path, count_attempts):
    url = (tmp_path / "nope.parquet").as_uri()
    with pytest.raises(
        GhostvisError, match=r"^shard demo/nope: file://.*nope\.parquet does not exist; check the source's manifest"
    ):
        fetch_shard("demo/nope", ShardEntry("nope", url), tmp_path / "out" / "nope.parquet")
    assert len(count_attempts) == 1
    with pytest.raises(GhostvisError, match=r"unsupported URL scheme 'ftp'"):
        fetch_shard("demo/x", ShardEntry("x", "ftp://host/x.parquet"), tmp_path / "out" / "x.parquet")
    assert files_in(tmp_path / "out") == []


def test_file_size_mismatch_is_not_retried(tmp_path, count_attempts):
    src = tmp_path / "a.parquet"
    src.write_bytes(b"12345")
    with pytest.raises(GhostvisError, match=r"size mismatch \(expected 9 bytes, got 5\)"):
        fetch_shard("demo/a", ShardEntry("a", src.as_uri(), bytes=9), tmp_path / "out" / "a.parquet")
    assert len(count_attempts) == 1
    assert files_in(tmp_path / "out") == []


# --- s3:// against moto in server mode --------------------------------------------------------------


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Fake credentials in the environment, and nothing from the machine's own AWS config."""
    for var in (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        shard_manifest.S3_ENDPOINT_ENV,
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def s3(aws_env, moto_s3, monkeypatch, request):
    """(client, bucket): a fresh bucket on the suite's moto server (conftest), which GHOSTVIS_S3_ENDPOINT_URL
    points at."""
    monkeypatch.setenv(shard_manifest.S3_ENDPOINT_ENV, moto_s3)
    client = boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1")
    bucket = f"b-{request.node.name.lower().replace('_', '-')[:40].strip('-')}-{os.getpid()}"
    client.create_bucket(Bucket=bucket)
    return client, bucket


def assert_no_credentials(exc: BaseException):
    text = str(exc) + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    assert SECRET not in text and KEY_ID not in text


def test_s3_fetch_verifies_and_skips(s3, tmp_path):
    client, bucket = s3
    data = blob(250_000, seed=3)
    client.put_object(Bucket=bucket, Key="raw/00001.parquet", Body=data)
    dest = tmp_path / "00001.parquet"
    url = f"s3://{bucket}/raw/00001.parquet"
    r = fetch_shard(SHARD, entry_for(url, data), dest)
    assert r == FetchResult(dest, len(data), sha(data), downloaded=True)
    assert dest.read_bytes() == data
    assert fetch_shard(SHARD, entry_for(url, data), dest).downloaded is False
    assert files_in(tmp_path) == ["00001.parquet"]


def test_s3_checksum_mismatch(s3, tmp_path):
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="k.parquet", Body=b"abc")
    with pytest.raises(
        GhostvisError, match=rf"s3://{bucket}/k.parquet: checksum mismatch \(expected sha256 0+, got {sha(b'abc')}\)"
    ):
        fetch_shard(SHARD, entry_for(f"s3://{bucket}/k.parquet", sha256="0" * 64), tmp_path / "k.parquet")
    assert files_in(tmp_path) == []


def test_s3_missing_object_or_bucket_is_not_retried(s3, tmp_path, monkeypatch, count_attempts):
    _, bucket = s3
    monkeypatch.setattr(shard_manifest, "RETRY_BASE_DELAY_S", 30.0)  # a retry would show in the elapsed time
    for url, code in [
        (f"s3://{bucket}/raw/00099.parquet", "NoSuchKey"),
        (f"s3://no-such-bucket-{os.getpid()}/x.parquet", "NoSuchBucket"),
    ]:
        count_attempts.clear()
        t0 = time.monotonic()
        with pytest.raises(GhostvisError) as exc:
            fetch_shard(SHARD, entry_for(url), tmp_path / "x.parquet")
        assert time.monotonic() - t0 < 20  # far below one back-off, with room for a loaded machine
        assert len(count_attempts) == 1
        assert str(exc.value).startswith(f"shard {SHARD}: {url} not found (S3 {code}); check the bucket, the key")
        assert_no_credentials(exc.value)
    assert files_in(tmp_path) == []


def test_s3_unreachable_endpoint_is_retried_and_hides_credentials(aws_env, tmp_path, monkeypatch, count_attempts):
    monkeypatch.setattr(shard_manifest, "HTTP_TIMEOUT_S", (1.0, 1.0))
    monkeypatch.setenv(shard_manifest.S3_ENDPOINT_ENV, f"http://127.0.0.1:{free_port()}")
    with pytest.raises(GhostvisError) as exc:
        fetch_shard(SHARD, entry_for("s3://bucket/raw/00001.parquet"), tmp_path / "x.parquet")
    assert (
        "s3://bucket/raw/00001.parquet failed after 4 attempts "
        "(last error: S3 transfer error (EndpointConnectionError))" in str(exc.value)
    )
    assert len(count_attempts) == 4
    assert_no_credentials(exc.value)
    assert files_in(tmp_path) == []


def test_s3_listing_paginates(s3, monkeypatch):
    client, bucket = s3
    for i in range(5):
        client.put_object(Bucket=bucket, Key=f"fineweb/{i:05d}.parquet", Body=b"x" * (i + 1))
    client.put_object(Bucket=bucket, Key="fineweb/README.md", Body=b"readme")
    client.put_object(Bucket=bucket, Key="other/00000.parquet", Body=b"other")

    pages = []
    real = shard_manifest._s3_client

    def counting_client():
        c = real()
        c.meta.events.register("before-call.s3.ListObjectsV2", lambda **kw: pages.append(1))
        return c

    monkeypatch.setattr(shard_manifest, "_s3_client", counting_client)
    listed = list_remote(f"s3://{bucket}/fineweb/", page_size=2)
    assert listed == [(f"s3://{bucket}/fineweb/{i:05d}.parquet", i + 1) for i in range(5)]
    assert len(pages) == 3  # 6 keys under the prefix, 2 a page
    assert list_remote(f"s3://{bucket}/fineweb/", suffix=".md") == [(f"s3://{bucket}/fineweb/README.md", 6)]

    with pytest.raises(GhostvisError, match=r"listing s3://no-such-bucket-.* not found \(S3 NoSuchBucket\)") as exc:
        list_remote(f"s3://no-such-bucket-{os.getpid()}/fineweb/")
    assert_no_credentials(exc.value)


@pytest.fixture
def stubbed_s3(aws_env, monkeypatch):
    """A botocore Stubber behind shard_manifest._s3_client, for S3 answers moto does not give on demand."""
    client = boto3.client("s3", region_name="us-east-1")
    stub = Stubber(client)
    stub.activate()
    monkeypatch.setattr(shard_manifest, "_s3_client", lambda: client)
    yield stub
    stub.deactivate()


def _get_object(stub: Stubber, body: bytes, length: int):
    stub.add_response(
        "get_object",
        {"Body": StreamingBody(io.BytesIO(body), length), "ContentLength": length},
        {"Bucket": "bucket", "Key": "k.parquet"},
    )


def test_s3_throttling_and_cut_bodies_are_retried(stubbed_s3, tmp_path):
    data = blob(3_000)
    stubbed_s3.add_client_error("get_object", service_error_code="SlowDown", http_status_code=503)
    stubbed_s3.add_client_error("get_object", service_error_code="InternalError", http_status_code=500)
    _get_object(stubbed_s3, data[:1_000], len(data))  # the connection ends early
    _get_object(stubbed_s3, data, len(data))
    r = fetch_shard(SHARD, entry_for("s3://bucket/k.parquet", data), tmp_path / "k.parquet")
    assert r.sha256 == sha(data)
    stubbed_s3.assert_no_pending_responses()

    for _ in range(4):
        _get_object(stubbed_s3, data[:1_000], len(data))
    with pytest.raises(
        GhostvisError,
        match=r"failed after 4 attempts \(last error: S3 transfer error \(IncompleteReadError\) "
        r"after 1,000 of 3,000 bytes\)",
    ):
        fetch_shard(SHARD, entry_for("s3://bucket/k.parquet", data), tmp_path / "again.parquet")
    stubbed_s3.assert_no_pending_responses()
    assert files_in(tmp_path) == ["k.parquet"]  # only the earlier, verified download


def test_s3_access_denied_is_permanent(stubbed_s3, tmp_path, count_attempts):
    stubbed_s3.add_client_error(
        "get_object", service_error_code="AccessDenied", http_status_code=403, service_message=f"denied for {KEY_ID}"
    )
    with pytest.raises(GhostvisError) as exc:
        fetch_shard(SHARD, entry_for("s3://bucket/k.parquet"), tmp_path / "k.parquet")
    assert "s3://bucket/k.parquet failed (S3 AccessDenied, HTTP 403); check the AWS credentials" in str(exc.value)
    assert len(count_attempts) == 1
    assert_no_credentials(exc.value)  # S3's own message text is not echoed
    assert files_in(tmp_path) == []


# --- listings and manifests -------------------------------------------------------------------------


def test_list_file_directory(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "00001.parquet").write_bytes(b"abc")
    (tmp_path / "00000.parquet").write_bytes(b"a")
    (tmp_path / ".00002.parquet.part-1234").write_bytes(b"partial")
    (tmp_path / ".hidden.parquet").write_bytes(b"tmp")
    (tmp_path / "notes.txt").write_text("x")
    assert list_remote(tmp_path.as_uri()) == [
        ((tmp_path / "00000.parquet").as_uri(), 1),
        ((tmp_path / "train" / "00001.parquet").as_uri(), 3),
    ]
    with pytest.raises(GhostvisError, match="not a directory"):
        list_remote((tmp_path / "missing").as_uri())


def test_list_http_json_listing(http):
    http.add(
        "/ds/listing.json",
        json.dumps(
            [
                "data/00001.parquet",
                "README.md",
                {"path": "data/00000.parquet", "size": 12},
                {"url": "https://cdn.example/x.parquet", "bytes": 5},
            ]
        ).encode(),
    )
    http.add(
        "/ds/manifest.json",
        json.dumps({"source": "s", "shards": [{"name": "a", "url": "a.parquet", "bytes": 3}]}).encode(),
    )
    assert list_remote(http.url("/ds/listing.json")) == [
        (http.url("/ds/data/00000.parquet"), 12),
        (http.url("/ds/data/00001.parquet"), None),
        ("https://cdn.example/x.parquet", 5),
    ]
    assert list_remote(http.url("/ds/manifest.json")) == [(http.url("/ds/a.parquet"), 3)]
    http.add("/ds/flaky.json", b"[]", status=503, times=1)
    assert list_remote(http.url("/ds/flaky.json")) == [] and http.hits["/ds/flaky.json"] == 2
    with pytest.raises(GhostvisError, match=r"not found \(HTTP 404\)"):
        list_remote(http.url("/ds/missing.json"))
    with pytest.raises(GhostvisError, match="cannot list this URL.*manifest_from_pattern"):
        list_remote(http.url("/ds/data/"))


def test_manifest_from_pattern(http, tmp_path):
    data = blob(1_000)
    for i in range(3):
        http.add(f"/data/{i:05d}.parquet", data)
    pattern = http.url("/data/{shard:05d}.parquet")
    m = manifest_from_pattern("web", pattern, range(3), validation=["00002"], sha256={"00001": sha(data)})
    assert (m.source, m.kind) == ("web", "text")
    assert [(e.name, e.split, e.sha256) for e in m.shards] == [
        ("00000", "train", None),
        ("00001", "train", sha(data)),
        ("00002", "validation", None),
    ]
    assert m.shards[1].url == http.url("/data/00001.parquet")
    assert Manifest.load(m.save(tmp_path / "web.json")) == m

    entry = m.entry("web/00001")
    assert fetch_shard("web/00001", entry, tmp_path / "raw" / "00001.parquet").sha256 == sha(data)

    with pytest.raises(
        GhostvisError,
        match=r"pinned shards \['12'\] .*match no shard of .* over range\(0, 3\); pins name shards by file stem",
    ):
        manifest_from_pattern("web", pattern, range(3), validation=["12"])
    with pytest.raises(GhostvisError, match=r"must contain \{shard\} and no other field"):
        manifest_from_pattern("web", "https://host/data/shard.parquet", range(3))
    with pytest.raises(GhostvisError, match=r"must contain \{shard\} and no other field"):
        manifest_from_pattern("web", "https://host/{split}/{shard:05d}.parquet", range(3))
    assert manifest_from_pattern("img", "s3://b/{shard}.tar", range(2), kind="image_caption").shards[1].name == "1"
