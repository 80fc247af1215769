"""Where a Hugging Face checkpoint comes from when a stage's `init_from` is not a stage name: a local
folder, s3://bucket/prefix (boto3, configured by the usual AWS variables) or hf://org/name[@revision]
(huggingface_hub.snapshot_download, which honours HF_ENDPOINT, HF_HUB_CACHE and HF_TOKEN)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ghostvis_core.errors import GhostvisError

# What a checkpoint folder needs (weights, configs, tokenizer); other files in a repo are not fetched.
WANTED = ("*.json", "*.safetensors", "*.jinja")


def is_hf_source(init_from: str) -> bool:
    """True for a URI or a folder path, False for a stage name: stage names have no '/', '\\' or '.', so a
    folder in the working directory is given as ./name (never mistaken for a stage, nor a stage for it)."""
    return init_from.startswith(("s3://", "hf://")) or any(c in init_from for c in "/\\.")


@contextmanager
def local_copy(uri: str) -> Iterator[Path]:
    """The local folder holding the checkpoint at `uri`: the folder itself, the Hub cache's snapshot
    (kept, as huggingface_hub does), or an S3 download (removed afterwards: the store keeps the import)."""
    if uri.startswith("s3://"):
        folder = _from_s3(uri)
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    else:
        yield _from_hub(uri) if uri.startswith("hf://") else _local(uri)


def _local(uri: str) -> Path:
    folder = Path(uri).expanduser()
    if not (folder / "config.json").is_file():
        raise GhostvisError(
            f"init_from {uri}: no config.json in that folder; give a Hugging Face checkpoint folder "
            "(config.json, *.safetensors, tokenizer.json), an s3:// or hf:// URI, or a stage name"
        )
    return folder


def _from_hub(uri: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, _, revision = uri.removeprefix("hf://").partition("@")
    # Read now: huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE once, when it is imported.
    endpoint, cache = os.environ.get("HF_ENDPOINT"), os.environ.get("HF_HUB_CACHE")
    try:
        return Path(
            snapshot_download(
                repo, revision=revision or None, allow_patterns=list(WANTED), endpoint=endpoint, cache_dir=cache
            )
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise GhostvisError(
            f"init_from {uri}: download from {endpoint or 'the Hugging Face Hub'} failed ({exc}); "
            "check the repository name and revision, HF_ENDPOINT and HF_TOKEN"
        ) from None


def _from_s3(uri: str) -> Path:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    dest = Path(tempfile.mkdtemp(prefix="ghostvis-hf-"))
    s3 = boto3.client("s3")
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix) :]
                if "/" not in name and any(Path(name).match(p) for p in WANTED):
                    s3.download_file(bucket, obj["Key"], str(dest / name))
    except (BotoCoreError, ClientError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        raise GhostvisError(
            f"init_from {uri}: cannot read it from S3 ({exc}); check the bucket, prefix and the "
            "AWS credentials / AWS_ENDPOINT_URL_S3"
        ) from None
    if not (dest / "config.json").is_file():
        shutil.rmtree(dest, ignore_errors=True)
        raise GhostvisError(f"init_from {uri}: no config.json under that prefix; upload the whole checkpoint folder")
    return dest
