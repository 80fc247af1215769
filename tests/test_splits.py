"""One split rule and one partition-key rule for every kind of source.

The same four Parquet shards (013_00000 ... 013_00003) are served as a file:// listing, an s3://
listing (moto server), an http JSON listing (local server), and through a url_pattern over http,
s3 and file://. Shard 013_00002 is held out, pinned by name or by its sha256. Whatever the transport
and the pin, it must resolve to validation, its text must never reach the tokenizer, and every
transport must give the same partition keys. A pin that matches nothing fails with the names.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.data.catalog import (
    RemoteSource,
    check_sha256_pins,
    record_raw_shard,
    remote_manifest,
    save_manifest,
    shard_split,
    shard_split_shown,
    tokenizer_corpus,
)
from ghostvis_core.data.shard_manifest import Manifest, fetch_shard
from ghostvis_core.data.tokenize_shards import job_for_shard
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.store import FolderStore
from tests.test_sources import aws_env, fast_retries, http, s3  # noqa: F401 (fixtures)

NAMES = [f"013_{i:05d}" for i in range(4)]
HELD_OUT = "013_00002"
KEYS = [f"web/{n}" for n in NAMES]
TRANSPORTS = ["file_listing", "s3_listing", "http_listing", "pattern_http", "pattern_s3", "pattern_file"]


def shard_bytes(name: str) -> bytes:
    marker = "HELDOUTVALIDATIONTEXT" if name == HELD_OUT else f"training text of shard {name}"
    texts = [f"{marker} document {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(30)]
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": texts}), buf)
    return buf.getvalue()


DATA = {n: shard_bytes(n) for n in NAMES}
HELD_OUT_SHA = hashlib.sha256(DATA[HELD_OUT]).hexdigest()


def serve(transport: str, request, tmp_path: Path) -> dict:
    """Publish the four shards over `transport`; the RemoteSource fields that read them."""
    if transport.endswith("_file") or transport == "file_listing":
        folder = tmp_path / "published"
        folder.mkdir(exist_ok=True)
        for n, data in DATA.items():
            (folder / f"{n}.parquet").write_bytes(data)
        if transport == "file_listing":
            return {"listing": folder.as_uri()}
        return {"url_pattern": folder.as_uri() + "/013_{shard:05d}.parquet", "num_shards": 4}
    if transport.endswith("s3") or transport.startswith("s3"):
        client, bucket = request.getfixturevalue("s3")
        for n, data in DATA.items():
            client.put_object(Bucket=bucket, Key=f"web/{n}.parquet", Body=data)
        if transport == "s3_listing":
            return {"listing": f"s3://{bucket}/web/"}
        return {"url_pattern": f"s3://{bucket}/web/013_{{shard:05d}}.parquet", "num_shards": 4}
    server = request.getfixturevalue("http")
    for n, data in DATA.items():
        server.add(f"/ds/web/{n}.parquet", data)
    if transport == "http_listing":
        server.add("/ds/listing.json", json.dumps([f"web/{n}.parquet" for n in NAMES]).encode())
        return {"listing": server.url("/ds/listing.json")}
    return {"url_pattern": server.url("/ds/web/013_{shard:05d}.parquet"), "num_shards": 4}


def pins(kind: str) -> dict:
    return {"validation": [HELD_OUT]} if kind == "name" else {"validation_sha256": [HELD_OUT_SHA]}


def download_all(store: FolderStore, manifest: Manifest) -> dict[str, str]:
    """What raw_shards does per partition: fetch, verify, record; then the source's pin check."""
    splits = {}
    for e in manifest.shards:
        sid = manifest.shard_id(e)
        r = fetch_shard(sid, e, store.writable("raw_shard", sid))
        store.publish("raw_shard", sid)
        splits[sid] = record_raw_shard(store, manifest, sid, r.sha256, r.bytes)
    check_sha256_pins(store, manifest, "raw_shards")
    return splits


@pytest.mark.parametrize("pin", ["name", "sha256"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_held_out_shard_is_validation_and_never_reaches_the_tokenizer(transport, pin, request, tmp_path):
    store = FolderStore(tmp_path / "store")
    manifest = remote_manifest(RemoteSource(name="web", **serve(transport, request, tmp_path), **pins(pin)))
    save_manifest(store, manifest)
    assert [manifest.shard_id(e) for e in manifest.shards] == KEYS

    expected = {k: "validation" if k == f"web/{HELD_OUT}" else "train" for k in KEYS}
    before = {k: shard_split_shown(store, manifest, k) for k in KEYS}
    if pin == "name":  # a name pin is known before the download
        assert before == expected
    else:  # a content pin needs the content: nothing is called train before it is known
        assert set(before.values()) == {"pending download (sha256 pins)"}
        with pytest.raises(
            GhostvisError,
            match=rf"^shard web/{HELD_OUT} is not downloaded; materialize raw_shards "
            rf"partition web/{HELD_OUT} first$",
        ):
            shard_split(store, manifest, f"web/{HELD_OUT}")

    assert download_all(store, manifest) == expected
    assert {k: shard_split(store, manifest, k) for k in KEYS} == expected
    assert {k: shard_split_shown(store, manifest, k) for k in KEYS} == expected
    assert store.read_json("raw_shard_meta", f"web/{HELD_OUT}") == {
        "shard_id": f"web/{HELD_OUT}",
        "sha256": HELD_OUT_SHA,
        "bytes": len(DATA[HELD_OUT]),
        "split": "validation",
    }
    assert job_for_shard(store, manifest, f"web/{HELD_OUT}").split == "validation"
    assert job_for_shard(store, manifest, "web/013_00001").split == "train"

    corpus = tokenizer_corpus(store, max_train_bytes=10**9)
    assert corpus.train_shard_ids == ["web/013_00000", "web/013_00001", "web/013_00003"]
    assert corpus.validation_shard_ids == [f"web/{HELD_OUT}"]
    assert len(corpus.texts) == 3 * 30
    assert not any("HELDOUTVALIDATIONTEXT" in t for t in corpus.texts)
    assert corpus.train_bytes == sum(len(t.encode()) for t in corpus.texts)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_name_pin_that_matches_nothing_fails_on_every_source_kind(transport, request, tmp_path):
    src = RemoteSource(name="web", validation=["00006"], **serve(transport, request, tmp_path))
    with pytest.raises(GhostvisError) as exc:
        remote_manifest(src)
    msg = str(exc.value)
    assert msg.startswith("source web: pinned shards ['00006'] (in validation/sha256) match no shard ")
    assert "pins name shards by file stem" in msg
    assert "available: '013_00000', '013_00001', '013_00002', '013_00003'" in msg


@pytest.mark.parametrize("transport", ["s3_listing", "pattern_http"])
def test_a_sha256_pin_that_matches_no_content_fails_once_all_shards_are_downloaded(transport, request, tmp_path):
    store = FolderStore(tmp_path / "store")
    wrong = hashlib.sha256(b"not a shard of this source").hexdigest()
    manifest = remote_manifest(
        RemoteSource(name="web", validation_sha256=[wrong.upper()], **serve(transport, request, tmp_path))
    )
    assert manifest.validation_sha256 == [wrong]  # pins are compared as lowercase hex
    first = manifest.shards[0]
    r = fetch_shard(KEYS[0], first, store.writable("raw_shard", KEYS[0]))
    store.publish("raw_shard", KEYS[0])
    record_raw_shard(store, manifest, KEYS[0], r.sha256, r.bytes)
    check_sha256_pins(store, manifest, "raw_shards")  # 3 shards' content still unknown: not yet an error
    with pytest.raises(GhostvisError) as exc:
        download_all(store, manifest)
    assert str(exc.value) == (
        f"source web: validation_sha256 pin(s) ['{wrong}'] match none of its 4 shards' content (checked in "
        f"raw_shards); a pin must be the sha256 of one of the source's files (each raw_shards partition's metadata "
        f"shows its sha256): fix or remove the pin and re-materialize shard_manifest"
    )
    save_manifest(store, manifest)
    with pytest.raises(GhostvisError, match=r"validation_sha256 pin\(s\) .* \(checked in the tokenizer asset\)"):
        tokenizer_corpus(store, max_train_bytes=10**9)


def test_sha256_pins_are_checked_at_shard_manifest_when_the_contents_are_known(request, tmp_path):
    store = FolderStore(tmp_path / "store")
    served = serve("file_listing", request, tmp_path)
    known = {n: hashlib.sha256(d).hexdigest() for n, d in DATA.items()}
    wrong = "ab" * 32
    manifest = remote_manifest(RemoteSource(name="web", sha256=known, validation_sha256=[wrong], **served))
    with pytest.raises(
        GhostvisError,
        match=rf"pin\(s\) \['{wrong}'\] match none of its 4 shards' content \(checked in shard_manifest\)",
    ):
        check_sha256_pins(store, manifest, "shard_manifest")
    manifest.validation_sha256 = [HELD_OUT_SHA]
    check_sha256_pins(store, manifest, "shard_manifest")
    assert shard_split_shown(store, manifest, f"web/{HELD_OUT}") == "validation"  # from the expected digest
    with pytest.raises(
        GhostvisError, match=r"validation_sha256 pin 'abc' is not a sha256 digest; give the 64 hex digits"
    ):
        remote_manifest(RemoteSource(name="web", validation_sha256=["abc"], **served))


def test_partition_keys_are_file_stems_for_patterns_and_listings(tmp_path):
    from ghostvis_core.data.shard_manifest import manifest_from_pattern

    m = manifest_from_pattern("hub", "https://host/x/013_{shard:05d}.parquet", range(3), validation=["013_00001"])
    assert [m.shard_id(e) for e in m.shards] == ["hub/013_00000", "hub/013_00001", "hub/013_00002"]
    assert [e.split for e in m.shards] == ["train", "validation", "train"]
    with pytest.raises(GhostvisError) as exc:
        manifest_from_pattern("hub", "https://host/x/013_{shard:05d}.parquet", range(3), validation=["00001"])
    assert (
        "pinned shards ['00001'] (in validation/sha256) match no shard of https://host/x/013_{shard:05d}.parquet "
        "over range(0, 3)" in str(exc.value)
    )
    assert "available: '013_00000', '013_00001', '013_00002'" in str(exc.value)
    with pytest.raises(
        GhostvisError,
        match=r"several shards .* have the file stem\(s\) \['data'\]; a shard's key is "
        r"<source>/<file stem>",
    ):
        manifest_from_pattern("hub", "https://host/{shard:03d}/data.parquet", range(3))


# --- through Dagster, in process: shard_manifest -> raw_shards -> tokenizer and its check ----------


def dagster_run(assets, instance, home, *, run_config=None, tags=None, selection=None):
    from dagster import materialize

    from ghostvis_pipeline.launchers import Launcher
    from ghostvis_pipeline.resources import GhostvisHome

    return materialize(
        assets,
        instance=instance,
        resources={"home": GhostvisHome(root=str(home)), "launcher": Launcher()},  # the tokenizer trains in a job
        run_config=run_config or {},
        tags=tags,
        selection=selection,
        raise_on_error=False,
    )


def latest(instance, asset: str, partition: str | None = None) -> dict:
    """The metadata of the asset's newest materialization, or of its partition's."""
    from dagster import AssetKey, AssetRecordsFilter

    if partition is None:
        ev = instance.get_latest_materialization_event(AssetKey(asset))
    else:
        ev = (
            instance.fetch_materializations(
                AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=[partition]), limit=1
            )
            .records[0]
            .event_log_entry
        )
    return {k: getattr(v, "value", v) for k, v in ev.asset_materialization.metadata.items()}


def observed(instance, asset: str, partition: str) -> dict:
    """The metadata of the partition's newest observation: a shard's own figures (assets/data.py shard_observation)."""
    from dagster import AssetKey, AssetRecordsFilter

    [record] = instance.fetch_observations(
        AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=[partition]), limit=1
    ).records
    return {k: getattr(v, "value", v) for k, v in record.event_log_entry.asset_observation.metadata.items()}


def error_of(result) -> str:
    return "\n".join(e.event_specific_data.error.to_string() for e in result.all_events if e.is_step_failure)


def materialize_sources(instance, home, remote: dict):
    """shard_manifest for `remote`, then raw_shards over all its partitions in one run (a backfill)."""
    from ghostvis_pipeline.assets.data import raw_shards, shard_manifest
    from ghostvis_pipeline.demo import PARTITION_RANGE_END_TAG, PARTITION_RANGE_START_TAG

    manifest_cfg = {"ops": {"shard_manifest": {"config": {"sources": [], "remote": [remote]}}}}
    result = dagster_run([shard_manifest], instance, home, run_config=manifest_cfg)
    assert result.success, error_of(result)
    keys = instance.get_dynamic_partitions("shards")
    tags = {PARTITION_RANGE_START_TAG: keys[0], PARTITION_RANGE_END_TAG: keys[-1]}
    return keys, dagster_run([shard_manifest, raw_shards], instance, home, tags=tags, selection=[raw_shards])


@pytest.mark.parametrize("transport, pin", [("http_listing", "sha256"), ("pattern_s3", "name")])
def test_dagster_tokenizer_trains_on_train_shards_only(transport, pin, request, tmp_path):
    from dagster import DagsterInstance

    from ghostvis_pipeline.assets.data import shard_manifest, tokenizer
    from ghostvis_pipeline.checks import tokenizer_trained_on_train_shards_only

    home = tmp_path / "home"
    remote = {"name": "web", **serve(transport, request, tmp_path), **pins(pin)}
    with DagsterInstance.ephemeral() as instance:
        keys, raw = materialize_sources(instance, home, remote)
        assert keys == KEYS
        assert raw.success, error_of(raw)
        # per source: shards, train, validation, pending download (a content pin before the download)
        table = latest(instance, "shard_manifest")["by_source"]
        shown = "3 | 1 | 0" if pin == "name" else "0 | 0 | 4"
        assert f"| web | text | 4 | {shown} |" in table
        held_out = observed(instance, "raw_shards", f"web/{HELD_OUT}")
        assert {k: held_out[k] for k in ("split", "bytes", "sha256", "status")} == {
            "split": "validation",
            "bytes": len(DATA[HELD_OUT]),
            "sha256": HELD_OUT_SHA,
            "status": "downloaded",
        }

        result = dagster_run(
            [tokenizer, tokenizer_trained_on_train_shards_only],
            instance,
            home,
            run_config={"ops": {"tokenizer": {"config": {"vocab_size": 300}}}},
        )
        assert result.success, error_of(result)
        md = latest(instance, "tokenizer")
        assert (md["train_shards"], md["validation_shards_excluded"]) == (3, 1)
        # the shard lists are in the tokenizer's identity record, not in its event (it would grow with the shards)
        store = Home(home).store
        assert "train_shard_ids" not in md
        assert md["shard_lists"] == store.uri_of("identity", "tokenizer", md["identity"])
        lists = store.read_json("identity", "tokenizer", md["identity"])["metadata"]
        assert lists["train_shard_ids"] == ["web/013_00000", "web/013_00001", "web/013_00003"]
        assert lists["validation_shard_ids_excluded"] == [f"web/{HELD_OUT}"]
        [check] = result.get_asset_check_evaluations()
        assert check.check_name == "tokenizer_trained_on_train_shards_only" and check.passed
        cmd = {k: getattr(v, "value", v) for k, v in check.metadata.items()}
        assert (cmd["trained_shards"], cmd["validation_shards"], cmd["offending_shards"]) == (3, 1, 0)
        assert cmd["validation_shard_ids"] == f"web/{HELD_OUT}"

        # shard_manifest now shows the resolved split of the downloaded shard, however it was pinned
        again = dagster_run(
            [shard_manifest],
            instance,
            home,
            run_config={"ops": {"shard_manifest": {"config": {"sources": [], "remote": [remote]}}}},
        )
        assert again.success and "| web | text | 4 | 3 | 1 | 0 |" in latest(instance, "shard_manifest")["by_source"]


def test_dagster_check_fails_on_a_validation_shard_in_the_training_set(request, tmp_path):
    from dagster import AssetMaterialization, DagsterInstance, build_asset_check_context

    from ghostvis_pipeline.checks import tokenizer_trained_on_train_shards_only
    from ghostvis_pipeline.resources import GhostvisHome

    home = tmp_path / "home"
    remote = {"name": "web", **serve("file_listing", request, tmp_path), **pins("sha256")}
    with DagsterInstance.ephemeral() as instance:
        _, raw = materialize_sources(instance, home, remote)
        assert raw.success, error_of(raw)
        # a tokenizer trained before the fix: the sha256-pinned shard among its training shards
        Home(home).store.write_json(
            "identity", "tokenizer", "old-identity", data={"metadata": {"tokenizer_id": "old", "train_shard_ids": KEYS}}
        )
        instance.report_runless_asset_event(
            AssetMaterialization("tokenizer", metadata={"tokenizer_id": "old", "identity": "old-identity"})
        )
        ctx = build_asset_check_context(instance=instance, resources={"home": GhostvisHome(root=str(home))})
        res = tokenizer_trained_on_train_shards_only(ctx)
    md = {k: getattr(v, "value", v) for k, v in res.metadata.items()}
    assert res.passed is False
    assert (md["trained_shards"], md["validation_shards"], md["offending_shards"]) == (4, 1, 1)
    assert f"| web/{HELD_OUT} | validation |" in md["offenders"]


def test_dagster_raw_shards_fails_on_an_unmatched_sha256_pin(request, tmp_path):
    from dagster import DagsterInstance

    wrong = "cd" * 32
    remote = {"name": "web", **serve("pattern_http", request, tmp_path), "validation_sha256": [wrong]}
    with DagsterInstance.ephemeral() as instance:
        _, raw = materialize_sources(instance, tmp_path / "home", remote)
    assert not raw.success
    assert (
        f"source web: validation_sha256 pin(s) ['{wrong}'] match none of its 4 shards' content (checked in raw_shards)"
        in error_of(raw)
    )


def test_dagster_shard_manifest_fails_on_an_unmatched_name_pin(request, tmp_path):
    from dagster import DagsterInstance

    from ghostvis_pipeline.assets.data import shard_manifest

    remote = {"name": "web", **serve("s3_listing", request, tmp_path), "validation": ["00006"]}
    with DagsterInstance.ephemeral() as instance:
        result = dagster_run(
            [shard_manifest],
            instance,
            tmp_path / "home",
            run_config={"ops": {"shard_manifest": {"config": {"sources": [], "remote": [remote]}}}},
        )
        assert not result.success
        assert instance.get_dynamic_partitions("shards") == []
    assert "source web: pinned shards ['00006'] (in validation/sha256) match no shard listed at s3://" in error_of(
        result
    )


def test_the_same_tokenizer_whether_the_shard_is_pinned_by_name_or_by_sha256(request, tmp_path):
    from ghostvis_core.data.bpe_tokenizer import train_tokenizer

    served = serve("file_listing", request, tmp_path)
    ids, corpora = [], []
    for pin in ("name", "sha256"):
        store = FolderStore(tmp_path / f"store-{pin}")
        manifest = remote_manifest(RemoteSource(name="web", **served, **pins(pin)))
        save_manifest(store, manifest)
        download_all(store, manifest)
        corpus = tokenizer_corpus(store, max_train_bytes=10**9)
        corpora.append((corpus.train_shard_ids, corpus.texts))
        ids.append(train_tokenizer(corpus.texts, 300).tokenizer_id)
    assert corpora[0] == corpora[1]
    assert ids[0] == ids[1]
