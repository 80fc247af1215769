"""The README's "Your own data" walk, run verbatim against a corpus served from a local S3 server
(moto) and from HTTP: same partition keys and content hashes over both transports, the validation
shard in no tokenizer's or stage's training set, ledger totals equal to a recount of the token files,
and a pretrained checkpoint at the end."""

from __future__ import annotations

import functools
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import ShardRecord
from ghostvis_core.data.token_shard import TokenShard
from ghostvis_core.demo.corpus import build_text_source
from ghostvis_core.home import Home
from ghostvis_core.runs.lookup import completed_runs
from tests import readme_walks
from tests.readme_walks import readme_blocks, served_folder, upload_folder

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
SHARDS = 7  # 00000..00005 train, 00006 validation (pinned by name in the README)


def readme_walk() -> tuple[str, str, str]:
    """(S3 sources.yaml, HTTP sources.yaml, the bash commands) between the README's own-data markers."""
    yamls, (bash,) = readme_blocks("own-data")
    return yamls[0], yamls[1], bash


@pytest.fixture(scope="module")
def corpus(module_tmp) -> Path:
    """Seven FineWeb-Edu-schema shards cut from the demo prose documents, named 00000..00006."""
    out = module_tmp("corpus")
    files = build_text_source("demo_prose", out / "build")
    table = pa.concat_tables([pq.read_table(p) for p, _ in files])
    per = table.num_rows // SHARDS
    for i in range(SHARDS):
        (out / "web").mkdir(exist_ok=True)
        pq.write_table(table.slice(i * per, per), out / "web" / f"{i:05d}.parquet")
    return out


@pytest.fixture(scope="module")
def http_server(corpus):
    with served_folder(corpus) as host:
        yield host


@pytest.fixture(scope="module")
def s3_endpoint(corpus, moto_s3):
    upload_folder(moto_s3, "my-bucket", corpus)
    return moto_s3


def walk(workdir: Path, sources_yaml: str, commands: str, endpoint: str, stop_before: str | None = None):
    return readme_walks.walk(workdir, {"sources.yaml": sources_yaml}, commands, endpoint, stop_before)


def shards_of(home: Home) -> dict[str, ShardRecord]:
    return {r.shard_id: r for r in Ledger.in_store(home.store).shards()}


def test_the_readme_walk_over_s3_and_http_gives_the_same_shards_and_a_checkpoint(tmp_path, s3_endpoint, http_server):
    s3_yaml, http_yaml, commands = readme_walk()
    s3_home, out = walk(tmp_path / "s3", s3_yaml, commands, s3_endpoint)
    http_yaml = http_yaml.replace("127.0.0.1:8000", http_server)
    http_home, _ = walk(tmp_path / "http", http_yaml, commands, s3_endpoint, stop_before="ghostvis plan")

    s3_shards, http_shards = shards_of(s3_home), shards_of(http_home)
    assert sorted(s3_shards) == sorted(http_shards) == [f"web/{i:05d}" for i in range(SHARDS)]
    for key, row in s3_shards.items():
        other = http_shards[key]
        assert (row.content_sha256, row.split, row.docs, row.tokens) == (
            other.content_sha256,
            other.split,
            other.docs,
            other.tokens,
        ), key
    assert [k for k, r in s3_shards.items() if r.split == "validation"] == ["web/00006"]
    # the ledger's figures are those of the token files
    for key, row in s3_shards.items():
        shard = TokenShard.open(s3_home.store.fetch("token_shard", row.tokenizer_id, key, row.content_sha256), key)
        assert (len(shard.rows), shard.num_tokens) == (row.docs, row.tokens), key

    run = completed_runs(s3_home.store, "pretrain")[-1]
    assert run.steps == 12 and run.counts.real_tokens == 12 * 4096
    assert Path(run.checkpoint_uri, "model.safetensors").exists()
    ledger = Ledger.in_store(s3_home.store)
    consumed = ledger.consumed_by_shard(run.run_key)
    assert consumed and "web/00006" not in {r.shard_id for r in consumed}
    assert sum(r.tokens for r in consumed) == run.counts.real_tokens
    assert not ledger.leakage(run.run_key)
    # the tokenizer never saw the validation shard
    from dagster import AssetKey, DagsterInstance

    instance = DagsterInstance.from_config(str(s3_home.root / "dagster"))
    md = instance.get_latest_materialization_event(AssetKey("tokenizer")).asset_materialization.metadata
    trained = s3_home.store.read_json("identity", "tokenizer", md["identity"].value)["metadata"]["train_shard_ids"]
    assert "web/00006" not in trained
    assert f"run {run.run_key}" in out or run.run_key in out


def test_every_kind_downloads_to_the_same_shard_over_s3_http_and_file(
    tmp_path, corpus, s3_endpoint, http_server, monkeypatch
):
    """Every kind a user brings: chats in JSON Lines under their own column name, a folder of images with a
    captions file, preference pairs (two for one prompt) and problems under their own prompt column, on the S3
    server (listed) and the HTTP server (numbered): raw_shards' download and check (records.normalize_shard) make
    the same Parquet shard over S3, HTTP and file://, images included."""
    import boto3

    from ghostvis_core.data.catalog import RemoteSource, remote_manifest
    from ghostvis_core.data.normalize_shard import normalize_shard
    from ghostvis_core.data.shard_manifest import fetch_shard
    from ghostvis_core.store.files import sha256_file
    from tests.test_own_kinds import CAPTIONS, CHATS, write_jsonl

    kinds = corpus / "kinds"
    write_jsonl(kinds / "chats" / "00000.jsonl", [{"conversations": c} for c in CHATS[:2]])
    write_jsonl(kinds / "chats" / "00001.jsonl", [{"conversations": CHATS[2]}])
    write_jsonl(
        kinds / "pics" / "00000.jsonl", [{"image": f"img/{i}.png", "caption": c} for i, (c, _) in enumerate(CAPTIONS)]
    )
    pair = {"prompt": "What is 2 plus 2?", "chosen": "4", "rejected": "5"}
    write_jsonl(kinds / "pairs" / "00000.jsonl", [pair, {**pair, "chosen": "Four."}])  # two pairs for one prompt
    write_jsonl(kinds / "problems" / "00000.jsonl", [{"question": "What is 17 * 3?", "answer": 51}])
    for i, (_, image) in enumerate(CAPTIONS):
        (kinds / "pics" / "img").mkdir(parents=True, exist_ok=True)
        (kinds / "pics" / "img" / f"{i}.png").write_bytes(image)
    client = boto3.client(
        "s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test"
    )
    for p in sorted(kinds.rglob("*.*")):
        client.upload_file(str(p), "my-bucket", p.relative_to(corpus).as_posix())
    for var, value in (
        ("AWS_ENDPOINT_URL_S3", s3_endpoint),
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        monkeypatch.setenv(var, value)

    def downloaded(src: RemoteSource, where: str) -> dict[str, str]:
        m = remote_manifest(src)
        out = {}
        for e in m.shards:
            sid = m.shard_id(e)
            check = functools.partial(normalize_shard, sid, m.kind, m.columns, e.url)
            out[sid] = fetch_shard(sid, e, tmp_path / where / f"{sid}.parquet", check=check).sha256
        return out

    shards = {}
    for name, kind, columns, n in (
        ("chats", "chat", {"messages": "conversations"}, 2),
        ("pics", "image_caption", {}, 1),
        ("pairs", "preference", {}, 1),
        ("problems", "problem", {"prompt": "question"}, 1),
    ):
        over = {
            "s3": downloaded(RemoteSource(name, kind, listing=f"s3://my-bucket/kinds/{name}/", columns=columns), "s3"),
            "http": downloaded(
                RemoteSource(
                    name,
                    kind,
                    url_pattern=f"http://{http_server}/kinds/{name}/{{shard:05d}}.jsonl",
                    num_shards=n,
                    columns=columns,
                ),
                "http",
            ),
            "file": downloaded(RemoteSource(name, kind, listing=(kinds / name).as_uri(), columns=columns), "file"),
        }
        assert len(over["s3"]) == n and over["s3"] == over["http"] == over["file"], over
        shards |= over["s3"]
    stored = pq.read_table(tmp_path / "s3" / "pics" / "00000.parquet")
    assert stored.column("image").to_pylist() == [b for _, b in CAPTIONS]
    assert sha256_file(tmp_path / "s3" / "pics" / "00000.parquet") == shards["pics/00000"]
