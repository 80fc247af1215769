"""Shard manifests and the one download path every source uses.

A manifest lists a source's shards: name, URL, split, and the expected size and sha256 when known.
`fetch_shard` streams a URL (file://, http(s):// including Hugging Face Hub, s3://) to a temporary
name, verifies it, and renames it into place, so a partial or corrupt file is never left under the
final name. Transient failures (dropped connections, timeouts, 429/5xx, S3 throttling) are retried
with exponential backoff, each attempt from scratch; permanent ones (404, 403, NoSuchKey) are not.
Credentials come from the environment (HF_TOKEN; the boto3/AWS chain) and never appear in messages.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import string
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import requests

from ghostvis_core.errors import GhostvisError
from ghostvis_core.store.files import atomic_write, replacing, sha256_file

CHUNK = 1 << 20
RETRY_ATTEMPTS = 4  # per fetch or listing, the first try included
RETRY_BASE_DELAY_S = 1.0  # backoff: base x 2**k (+ up to 50% jitter so parallel partitions spread out)
HTTP_TIMEOUT_S = (10.0, 60.0)  # (connect, read between bytes): a stalled server counts as transient
S3_ENDPOINT_ENV = "GHOSTVIS_S3_ENDPOINT_URL"  # unset: boto3's own AWS_ENDPOINT_URL(_S3) handling
HF_HOST = "huggingface.co"


@dataclass
class ShardEntry:
    name: str  # the file stem of its URL (`shard_name`): the shard id is <source>/<name>
    url: str
    # "validation" when the shard is pinned by name. This is a pin, not the shard's split: the split is
    # `Manifest.split_of(entry, content_sha256)`, known once the content is (catalog.shard_split).
    split: str = "train"
    bytes: int | None = None
    sha256: str | None = None


@dataclass
class Manifest:
    source: str
    kind: str = "text"  # a key of schema.KIND_COLUMNS
    shards: list[ShardEntry] = field(default_factory=list)
    # Validation shards pinned by content: a shard whose sha256 is listed is validation whatever its
    # name or position, so a re-published, renumbered source cannot move it into training.
    validation_sha256: list[str] = field(default_factory=list)
    # kind field -> the column a source's files hold it in (records.normalize_shard reads it there)
    columns: dict[str, str] = field(default_factory=dict)
    reward: str = ""  # a problem source's reward rule (ghostvis_core/data/problems.py)

    def split_of(self, entry: ShardEntry, content_sha256: str | None) -> str | None:
        """THE split rule, for every source kind: a shard is validation if its name is pinned or its
        content sha256 is pinned, else train. None: not decidable yet (a content pin may match it
        and its content is unknown); catalog.shard_split resolves it from the downloaded shard."""
        if entry.split == "validation" or (content_sha256 is not None and content_sha256 in self.validation_sha256):
            return "validation"
        if content_sha256 is None and self.validation_sha256:
            return None
        return "train"

    def unmatched_sha256_pins(self, content_sha256s) -> list[str]:
        """The validation_sha256 pins that match none of these contents (all of the source's shards)."""
        have = set(content_sha256s)
        return [d for d in self.validation_sha256 if d not in have]

    def shard_id(self, entry: ShardEntry) -> str:
        return f"{self.source}/{entry.name}"

    @cached_property
    def entries_by_id(self) -> dict[str, ShardEntry]:
        """shard_id -> entry, built once: a backfill looks up each of N shards (N lookups, not N^2)."""
        return {self.shard_id(e): e for e in self.shards}

    def entry(self, shard_id: str) -> ShardEntry:
        if shard_id not in self.entries_by_id:
            raise GhostvisError(
                f"shard {shard_id} is not in the manifest of source {self.source}; re-materialize shard_manifest"
            )
        return self.entries_by_id[shard_id]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        return cls(
            data["source"],
            data.get("kind", "text"),
            [ShardEntry(**e) for e in data["shards"]],
            data.get("validation_sha256", []),
            data.get("columns", {}),
            data.get("reward", ""),
        )

    def save(self, path: Path) -> Path:
        return atomic_write(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> Manifest:
        if not path.exists():
            raise GhostvisError(f"manifest {path} is missing; materialize the shard_manifest asset first")
        return cls.from_dict(json.loads(path.read_text()))


def shard_name(url: str) -> str:
    """The one partition-key rule: a shard's name is its file's stem, whatever serves it
    (file://, s3://, http(s):// listing or URL pattern), so its key is <source>/<file stem>."""
    return Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).stem


def check_pins(source: str, names: list[str], pinned: set[str], where: str) -> None:
    """Shard names must be unique (they are partition keys) and every name pin (validation, sha256)
    must name one of them; otherwise fail with the unmatched names and the available ones."""
    dup = sorted(n for n, c in Counter(names).items() if c > 1)
    if dup:
        raise GhostvisError(
            f"source {source}: several shards {where} have the file stem(s) {dup[:10]}; a shard's key is "
            f"<source>/<file stem>, so file names must differ: list fewer files or split the source in two"
        )
    unknown = sorted(pinned - set(names))
    if unknown:
        shown = ", ".join(repr(n) for n in names[:10]) + (f" ... ({len(names)} in all)" if len(names) > 10 else "")
        raise GhostvisError(
            f"source {source}: pinned shards {unknown} (in validation/sha256) match no shard {where}; "
            f"pins name shards by file stem (the <file stem> of the partition key <source>/<file stem>), "
            f"available: {shown}; fix the names or the shard range"
        )


def manifest_for_files(source: str, kind: str, files: list[tuple[Path, str]]) -> Manifest:
    """A manifest of local files (file:// URLs) with their sizes and checksums."""
    uris = [(p.resolve().as_uri(), p, split) for p, split in files]
    check_pins(source, [shard_name(u) for u, _, _ in uris], set(), "among the files")
    return Manifest(
        source, kind, [ShardEntry(shard_name(u), u, split, p.stat().st_size, sha256_file(p)) for u, p, split in uris]
    )


def manifest_from_pattern(
    source: str,
    url_pattern: str,
    shard_range: range,
    validation: list[str] | None = None,
    sha256: dict[str, str] | None = None,
    kind: str = "text",
) -> Manifest:
    """A manifest of numbered remote shards, e.g. "https://host/data/{shard:05d}.parquet" over range(100).

    Shard names are the file stems of the URLs ("00012", or "013_00012" for ".../013_{shard:05d}.parquet"),
    as for a listing of the same files; sizes stay unknown, `sha256` maps name -> digest. `validation`
    names the held-out shards by file stem. Pinning by name is only safe while the publisher never
    renumbers; pin validation shards by content (Manifest.validation_sha256) so a re-published source
    cannot silently move a training shard into validation or back.
    """
    try:
        spec = next((s for _, f, s, _ in string.Formatter().parse(url_pattern) if f == "shard"), None)
        if spec is None:
            raise KeyError("shard")
        urls = [url_pattern.format(shard=i) for i in shard_range]
    except (KeyError, IndexError, ValueError):
        raise GhostvisError(
            f"source {source}: url_pattern {url_pattern!r} must contain {{shard}} and no other field "
            f"(e.g. 'https://host/data/{{shard:05d}}.parquet')"
        ) from None
    val, sums = set(validation or []), sha256 or {}
    check_pins(source, [shard_name(u) for u in urls], val | sums.keys(), f"of {url_pattern} over {shard_range}")
    return Manifest(
        source,
        kind,
        [
            ShardEntry(name, url, "validation" if name in val else "train", None, sums.get(name))
            for name, url in ((shard_name(u), u) for u in urls)
        ],
    )


@dataclass(frozen=True)
class FetchResult:
    path: Path
    bytes: int
    sha256: str
    downloaded: bool  # False: the file was already there with the expected checksum


class _Transient(Exception):
    """A failure worth another attempt. Its message is shown to users, so it never holds credentials."""


def fetch_shard(
    shard_id: str,
    entry: ShardEntry,
    dest: Path,
    check: Callable[[Path], bool] | None = None,
    admit: Callable[[str], None] | None = None,
) -> FetchResult:
    """Download entry.url to dest atomically; verify size and sha256 when the manifest has them, and
    the file by `check` (raw_shards: records.normalize_shard, every row of its kind, rewriting a user's
    format as the kind's Parquet and returning True when it did) before it takes the name `dest`.
    `admit` is called last with the sha256 of what takes the name, while `dest` still holds what was there
    (raw_shards keeps a previous content of the shard as a version of its own). The result's bytes and
    sha256 are of the file stored: the download's, or the rewritten file's.

    A transient failure restarts the download into a fresh temp file, up to RETRY_ATTEMPTS times.
    """
    if dest.exists() and entry.sha256 and sha256_file(dest) == entry.sha256:
        return FetchResult(dest, dest.stat().st_size, entry.sha256, downloaded=False)
    dest.parent.mkdir(parents=True, exist_ok=True)
    what = f"shard {shard_id}: {_safe_url(entry.url)}"
    fix = f"check the network or the server and re-materialize raw_shards partition {shard_id}"
    return _retrying(what, fix, lambda: _fetch_once(shard_id, entry, dest, what, check, admit))


IMAGE_FETCH_WORKERS = 16


def fetch_many(urls: list[str]) -> dict[str, bytes | GhostvisError]:
    """Small files read whole (the images a shard names by paths beside it), over the shard's transports with a
    shard's retries, IMAGE_FETCH_WORKERS at a time over one S3 client (a client and a request at a time make
    a shard of a few hundred images take minutes). A file that cannot be read
    maps to its error, for the row that names it to report."""
    client = _s3_client() if any(urllib.parse.urlsplit(u).scheme == "s3" for u in urls) else None

    def one(url: str) -> tuple[str, bytes | GhostvisError]:
        def once() -> bytes:
            with _open_stream(url, url, client) as (chunks, _):
                return b"".join(chunks)

        try:
            return url, _retrying(url, "check that the file exists beside the shard, or the network", once)
        except GhostvisError as exc:
            return url, exc

    with ThreadPoolExecutor(IMAGE_FETCH_WORKERS) as pool:
        return dict(pool.map(one, dict.fromkeys(urls)))


def fetch_file(what: str, url: str, dest: Path, fix: str) -> FetchResult:
    """One file that is not a shard (a tokenizer brought as a file) by the same path: atomic, retried."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    what = f"{what}: {_safe_url(url)}"
    return _retrying(what, fix, lambda: _fetch_once(what, ShardEntry(shard_name(url), url), dest, what, None, None))


def _retrying(what: str, fix: str, attempt):
    """Call attempt() until it stops raising _Transient; back off exponentially, with jitter, in between."""
    last = None
    for i in range(RETRY_ATTEMPTS):
        if i:
            time.sleep(RETRY_BASE_DELAY_S * 2 ** (i - 1) * (1 + random.random() / 2))
        try:
            return attempt()
        except _Transient as e:
            last = e
    raise GhostvisError(f"{what} failed after {RETRY_ATTEMPTS} attempts (last error: {last}); {fix}")


def _fetch_once(
    shard_id: str,
    entry: ShardEntry,
    dest: Path,
    what: str,
    check: Callable[[Path], bool] | None,
    admit: Callable[[str], None] | None,
) -> FetchResult:
    try:
        with replacing(dest) as tmp:
            size, digest = _download_to(tmp, entry, what)
            if entry.bytes is not None and size != entry.bytes:
                raise GhostvisError(
                    f"{what}: size mismatch (expected {entry.bytes} bytes, got {size}); {_changed_fix(shard_id)}"
                )
            if entry.sha256 and digest != entry.sha256:
                raise GhostvisError(
                    f"{what}: checksum mismatch (expected sha256 {entry.sha256}, got {digest}); "
                    f"{_changed_fix(shard_id)}"
                )
            if check is not None and check(tmp):
                size, digest = tmp.stat().st_size, sha256_file(tmp)
            if admit is not None:
                admit(digest)
        return FetchResult(dest, size, digest, downloaded=True)
    except OSError as e:  # local disk or file:// source, not the network: retrying would not help
        raise GhostvisError(
            f"{what}: {e.strerror or e} ({e.filename or dest}); check free space and permissions under {dest.parent}"
        ) from None


def _changed_fix(shard_id: str) -> str:
    """The fix for a file whose size or sha256 is not the manifest's: the manifest's figures are what the
    file was when shard_manifest listed it (or what its shard list declares), so a file changed since is
    re-listed, not re-downloaded; a cut transfer is downloaded again."""
    return (
        f"if the file changed since it was listed, re-materialize shard_manifest (it lists the file's new size "
        f"and sha256; the shard is then a new version) or fix the size and sha256 in the source's shard list, "
        f"then raw_shards partition {shard_id}; if the transfer was cut, re-materialize raw_shards partition "
        f"{shard_id}"
    )


def _download_to(tmp: Path, entry: ShardEntry, what: str) -> tuple[int, str]:
    """Stream entry.url into `tmp`, hashing as it goes: (bytes, sha256). A cut transfer is transient."""
    h = hashlib.sha256()
    size = 0
    with _open_stream(what, entry.url) as (chunks, length), open(tmp, "wb") as out:
        expected = length if length is not None else entry.bytes
        of = f" of {expected:,}" if expected is not None else ""
        try:
            for chunk in chunks:
                out.write(chunk)
                h.update(chunk)
                size += len(chunk)
        except _Transient as e:
            raise _Transient(f"{e} after {size:,}{of} bytes") from None
        if expected is not None and size < expected:  # the server promised more: a cut transfer
            raise _Transient(f"transfer ended after {size:,}{of} bytes")
        out.flush()
        os.fsync(out.fileno())
    return size, h.hexdigest()


def _safe_url(url: str) -> str:
    """The URL for messages: no user:password@, no query (a presigned URL's query is a credential)."""
    u = urllib.parse.urlsplit(url)
    if "@" not in u.netloc and not u.query:
        return url
    return urllib.parse.urlunsplit((u.scheme, u.netloc.rsplit("@", 1)[-1], u.path, "..." if u.query else "", ""))


def _open_stream(what: str, url: str, s3_client=None):
    """A context manager yielding (chunks, length or None) for any supported URL (`s3_client`: one to share,
    else a fresh one)."""
    scheme = urllib.parse.urlsplit(url).scheme
    opener = {"file": _open_file, "http": _open_http, "https": _open_http, "s3": _open_s3}.get(scheme)
    if opener is None:
        raise GhostvisError(f"{what}: unsupported URL scheme '{scheme}'; use file://, http(s):// or s3://")
    return _open_s3(what, url, s3_client) if scheme == "s3" else opener(what, url)


@contextmanager
def _open_file(what: str, url: str):
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    if not path.is_file():
        raise GhostvisError(f"{what} does not exist; check the source's manifest")
    with open(path, "rb") as f:
        yield iter(lambda: f.read(CHUNK), b""), os.fstat(f.fileno()).st_size


# --- http(s), including Hugging Face Hub resolve URLs (plain HTTPS + redirects) ---------------------

HTTP_CHUNK = 1 << 16  # bytes of a chunk cut by a broken connection are lost: keep the count precise
_HTTP_TRANSIENT = {408, 429, 500, 502, 503, 504}
_HTTP_NETWORK = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)


def _http_headers(url: str) -> dict[str, str]:
    """Identity encoding, so Content-Length counts the file's bytes; HF_TOKEN only to huggingface.co
    over https (requests drops the header when a redirect leaves the host, e.g. to the HF CDN)."""
    headers = {"Accept-Encoding": "identity"}
    u = urllib.parse.urlsplit(url)
    host = (u.hostname or "").lower()
    token = os.environ.get("HF_TOKEN")
    if token and u.scheme == "https" and (host == HF_HOST or host.endswith("." + HF_HOST)):
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _net_reason(e: BaseException) -> str:
    """'connection refused (ConnectionError)': the root OS error and the kind, never the exception text,
    which echoes URLs."""
    root, depth = e, 0
    while (nxt := root.__cause__ or root.__context__) is not None and depth < 10:
        root, depth = nxt, depth + 1
    if isinstance(e, requests.Timeout) or isinstance(root, TimeoutError):
        reason = "timed out"
    elif isinstance(root, OSError) and root.strerror:
        reason = root.strerror.lower()
    else:
        reason = "connection lost"
    return f"{reason} ({type(e).__name__})"


@contextmanager
def _open_http(what: str, url: str):
    try:
        resp = requests.get(url, headers=_http_headers(url), stream=True, timeout=HTTP_TIMEOUT_S)
    except _HTTP_NETWORK as e:
        raise _Transient(_net_reason(e)) from None
    except requests.RequestException as e:
        raise GhostvisError(f"{what}: cannot request it ({type(e).__name__}); check the URL") from None
    with resp:
        code = resp.status_code
        if code in (404, 410):
            raise GhostvisError(
                f"{what} not found (HTTP {code}); check the source's URL pattern and shard range in the manifest"
            )
        if code in (401, 403):
            raise GhostvisError(
                f"{what} refused (HTTP {code}); for a gated or private Hugging Face dataset set HF_TOKEN "
                f"and accept its terms on the Hub, otherwise check the server's access rules"
            )
        if code in _HTTP_TRANSIENT:
            raise _Transient(f"HTTP {code}")
        if code != 200:
            raise GhostvisError(f"{what} failed (HTTP {code}); check the URL")
        length = resp.headers.get("Content-Length", "")
        identity = resp.headers.get("Content-Encoding", "identity") in ("", "identity")
        yield _http_chunks(resp), int(length) if length.isdigit() and identity else None


def _http_chunks(resp) -> Iterator[bytes]:
    try:
        yield from resp.iter_content(HTTP_CHUNK)
    except _HTTP_NETWORK as e:
        raise _Transient(_net_reason(e)) from None


# --- s3:// (boto3, imported lazily: file:// and http users do not pay for it) -----------------------

_S3_MISSING = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_S3_TRANSIENT = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
}


def _s3_client():
    """A fresh client, so credentials are read from the AWS chain now; botocore does not retry (we do).

    GHOSTVIS_S3_ENDPOINT_URL selects an S3-compatible store (path-style addressing, which they all
    accept); unset, boto3 applies its own AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 handling.
    """
    import boto3
    from botocore.config import Config

    endpoint = os.environ.get(S3_ENDPOINT_ENV) or None
    config = Config(
        retries={"total_max_attempts": 1},
        connect_timeout=HTTP_TIMEOUT_S[0],
        read_timeout=HTTP_TIMEOUT_S[1],
        s3={"addressing_style": "path"} if endpoint else None,
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)


def _split_s3(url: str) -> tuple[str, str]:
    u = urllib.parse.urlsplit(url)
    return u.netloc, u.path.lstrip("/")


@contextmanager
def _s3_errors(what: str):
    """Sort botocore errors into permanent (GhostvisError) and transient ones. Messages use the error
    code only: S3's own texts and request details stay out (e.g. SignatureDoesNotMatch echoes the key id)."""
    from botocore import exceptions as bx

    try:
        yield
    except bx.ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in _S3_MISSING:
            raise GhostvisError(
                f"{what} not found (S3 {code}); check the bucket, the key and the shard range in the manifest"
            ) from None
        if code in _S3_TRANSIENT or status == 429 or status >= 500:
            raise _Transient(f"S3 {code or 'error'} (HTTP {status})") from None
        raise GhostvisError(
            f"{what} failed (S3 {code}, HTTP {status}); check the AWS credentials (environment, profile or role), "
            f"the bucket's permissions and {S3_ENDPOINT_ENV}"
        ) from None
    except (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError, bx.FlexibleChecksumError) as e:
        raise _Transient(f"S3 transfer error ({type(e).__name__})") from None
    except (bx.NoCredentialsError, bx.PartialCredentialsError) as e:
        raise GhostvisError(
            f"{what}: no usable AWS credentials ({type(e).__name__}); set AWS_ACCESS_KEY_ID and "
            f"AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
        ) from None
    except bx.BotoCoreError as e:
        raise GhostvisError(f"{what} failed ({type(e).__name__}); check the s3:// URL and {S3_ENDPOINT_ENV}") from None


@contextmanager
def _open_s3(what: str, url: str, client=None):
    bucket, key = _split_s3(url)
    with _s3_errors(what):
        obj = (client or _s3_client()).get_object(Bucket=bucket, Key=key)
    try:
        yield _s3_chunks(what, obj["Body"]), obj.get("ContentLength")
    finally:
        obj["Body"].close()


def _s3_chunks(what: str, body) -> Iterator[bytes]:
    with _s3_errors(what):
        yield from body.iter_chunks(CHUNK)


# --- listings -------------------------------------------------------------------------------------


SHARD_SUFFIXES = (".parquet", ".jsonl")  # the files a listing takes as shards: Parquet and JSON Lines


def list_remote(
    url_prefix: str, suffix: str | tuple[str, ...] = SHARD_SUFFIXES, page_size: int = 1000
) -> list[tuple[str, int | None]]:
    """(url, size) of the files ending in one of `suffix` under a prefix, sorted, to build a manifest from.

    Supports file:// directories (recursive), s3://bucket/prefix (list_objects_v2, `page_size` keys a
    page) and, over http(s), only a .json listing: a list of URLs/paths (relative ones resolve against
    the listing) or of objects with url|path and size|bytes, optionally under "shards" or "files" (so
    a saved Manifest works). HTML directory listings are not parsed: use manifest_from_pattern.
    """
    u = urllib.parse.urlsplit(url_prefix)
    what = f"listing {_safe_url(url_prefix)}"
    fix = "check the network or the server and list again"
    if u.scheme == "file":
        root = Path(urllib.parse.unquote(u.path))
        if not root.is_dir():
            raise GhostvisError(f"{what}: not a directory; check the source's URL")
        files = [p for p in root.rglob("*") if p.name.endswith(suffix) and p.is_file() and not p.name.startswith(".")]
        inside = root.resolve()
        outside = [p for p in files if not p.resolve().is_relative_to(inside)]
        if outside:
            raise GhostvisError(
                f"{what}: {outside[0]} resolves to {outside[0].resolve()}, outside the listed folder "
                f"({len(outside)} such file(s)); a listing reads only its own folder: copy the file into it "
                f"or remove the link"
            )
        return sorted((p.resolve().as_uri(), p.stat().st_size) for p in files)
    if u.scheme == "s3":
        return _retrying(what, fix, lambda: _list_s3(what, url_prefix, suffix, page_size))
    if u.scheme in ("http", "https") and u.path.endswith(".json"):
        return _retrying(what, fix, lambda: _list_json(what, url_prefix, suffix))
    raise GhostvisError(
        f"{what}: cannot list this URL; use a file:// directory, an s3:// prefix or an http(s) .json listing, "
        f"or build the manifest with manifest_from_pattern"
    )


def _list_s3(what: str, url: str, suffix: str | tuple[str, ...], page_size: int) -> list[tuple[str, int | None]]:
    bucket, prefix = _split_s3(url)
    out: list[tuple[str, int | None]] = []
    with _s3_errors(what):
        paginator = _s3_client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix, PaginationConfig={"PageSize": page_size}):
            out += [
                (f"s3://{bucket}/{o['Key']}", o["Size"]) for o in page.get("Contents", []) if o["Key"].endswith(suffix)
            ]
    return sorted(out)


def _list_json(what: str, url: str, suffix: str | tuple[str, ...]) -> list[tuple[str, int | None]]:
    with _open_http(what, url) as (chunks, _):
        raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except ValueError:
        raise GhostvisError(f"{what} is not valid JSON; fix the listing") from None
    if isinstance(data, dict):
        data = data.get("shards", data.get("files"))
    if not isinstance(data, list):
        raise GhostvisError(f"{what}: expected a JSON list, or an object with 'shards' or 'files'; fix the listing")
    out: list[tuple[str, int | None]] = []
    for item in data:
        item = {"url": item} if isinstance(item, str) else item if isinstance(item, dict) else {}
        ref, size = item.get("url") or item.get("path"), item.get("size", item.get("bytes"))
        if isinstance(ref, str) and ref.endswith(suffix):
            out.append((urllib.parse.urljoin(url, ref), size))
    return sorted(out)
