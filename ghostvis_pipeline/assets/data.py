"""Data assets: shard manifest -> raw shards -> tokenizer -> tokenized shards -> token ledger."""


import time

from dagster import (
    AssetExecutionContext,
    BackfillPolicy,
    Config,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
)

from ghostvis_core import presets, run_modes
from ghostvis_core.cluster.slurm import SlurmJob
from ghostvis_core.cluster.slurm_pipeline import SlurmPipeline
from ghostvis_core.data.catalog import (
    DEMO_SOURCES, RemoteSource, check_sha256_pins, manifest_of_shard, publish_demo_source, record_raw_shard,
    remote_manifest, save_manifest, shard_split_shown, tokenizer_corpus,
)
from ghostvis_core.data.identities import ledger_identity, manifest_identity, shard_contents, tokenizer_identity
from ghostvis_core.data.ledger import Ledger, source_split_totals
from ghostvis_core.data.sources import fetch_shard
from ghostvis_core.data.tokenize import job_for_shard, tokenize_shards
from ghostvis_core.data.tokenizer import save_tokenizer, train_tokenizer
from ghostvis_core.errors import GhostvisError
from ghostvis_core.hf.imports import import_tokenizer
from ghostvis_core.identity import code_version, digest
from ghostvis_pipeline.config import config_from_dataclass
from ghostvis_pipeline.launchers import Launcher
from ghostvis_pipeline.metadata import latest_metadata, md_table
from ghostvis_pipeline.partitions import shard_partitions
from ghostvis_pipeline.resources import GhostvisHome


# A source of your own: the fields and defaults of ghostvis_core.data.catalog.RemoteSource, declared there once.
RemoteSourceConfig = config_from_dataclass(RemoteSource)


# The modules that make each data asset: its code_version hashes them and what they import
# (ghostvis_core/identity.py). Each asset's data version is its identity: see the assets' docstrings.
MANIFEST_CODE = code_version("ghostvis_core.data.catalog")
RAW_SHARDS_CODE = code_version("ghostvis_core.data.sources", "ghostvis_core.data.catalog")
TOKENIZER_CODE = code_version("ghostvis_core.data.tokenizer", "ghostvis_core.data.catalog", "ghostvis_core.hf.tokenizer_json")
TOKENIZE_CODE = code_version("ghostvis_core.data.tokenize")
LEDGER_CODE = code_version("ghostvis_core.data.ledger")


class ManifestConfig(Config):
    sources: list[str] = list(DEMO_SOURCES)  # embedded demo sources to publish
    remote: list[RemoteSourceConfig] = []  # sources of your own: URL pattern or listing


@asset(group_name="data", kinds={"parquet"}, owners=["team:data"], code_version=MANIFEST_CODE)
def shard_manifest(context: AssetExecutionContext, config: ManifestConfig, home: GhostvisHome) -> MaterializeResult:
    """Publishes each source's shard list (name, URL, bytes, sha256) and registers one `shards`
    partition per shard (`<source>/<file stem>` for every kind of source), so shards can be downloaded
    and tokenized as a backfill. A validation pin that matches no shard fails here. The split shown is
    the split rule's answer so far: a shard pinned by content is resolved once it is downloaded. Data
    version: the shard lists (names, pins, sizes, content hashes), not their URLs."""
    h = home.home()
    keys, rows = [], []
    manifests = [publish_demo_source(h, source) for source in config.sources]
    manifests += [remote_manifest(RemoteSource(**src.model_dump())) for src in config.remote]
    for manifest in manifests:
        check_sha256_pins(h.store, manifest, "shard_manifest")
    for manifest in manifests:
        save_manifest(h.store, manifest)
        for e in manifest.shards:
            sid = manifest.shard_id(e)
            keys.append(sid)
            rows.append([sid, shard_split_shown(h.store, manifest, sid), e.bytes, (e.sha256 or "")[:12], e.url])
    known = set(context.instance.get_dynamic_partitions(shard_partitions.name))
    new = [k for k in keys if k not in known]
    if new:
        context.instance.add_dynamic_partitions(shard_partitions.name, new)
    return MaterializeResult(data_version=DataVersion(digest(manifest_identity(manifests))), metadata={
        "shards": len(keys),
        "new_partitions": len(new),
        "sources": ", ".join(m.source for m in manifests),
        "manifest": MetadataValue.md(md_table(["shard", "split", "bytes", "sha256", "url"], rows)),
    })


# A backfill of raw_shards or tokenized_shards is one Dagster run (the CLI's --partition-range needs
# that); inside it the shards fan out over datatrove workers, or over a Slurm job array with the
# `slurm` launcher (one task per shard, on the cluster's nodes).
SHARD_BACKFILL = BackfillPolicy.single_run()


@asset(
    group_name="data",
    kinds={"parquet"},
    owners=["team:data"],
    partitions_def=shard_partitions,
    backfill_policy=SHARD_BACKFILL,
    deps=[shard_manifest],
    code_version=RAW_SHARDS_CODE,
)
def raw_shards(context: AssetExecutionContext, home: GhostvisHome) -> MaterializeResult:
    """Downloads shards through the one fetch path (temp name, verify size + sha256, rename), and
    records each one's content hash, size and split (the split rule applied to that content). Once
    every shard of a source is downloaded, a validation_sha256 pin that matches none of them fails here.
    Data version: the recorded content hash of every registered shard, the same whichever partitions a
    run covers, so a shard downloaded again with the same bytes changes nothing downstream."""
    store = home.home().store
    t0 = time.time()
    rows, total, fetched, manifests = [], 0, 0, {}
    for key in context.partition_keys:
        manifest = manifest_of_shard(store, key)
        manifests[manifest.source] = manifest
        r = fetch_shard(key, manifest.entry(key), store.fetch("raw_shard", key))
        store.publish("raw_shard", key)
        split = record_raw_shard(store, manifest, key, r.sha256, r.bytes)
        total += r.bytes
        fetched += r.downloaded
        rows.append([key, split, r.bytes, r.sha256[:12], "downloaded" if r.downloaded else "present"])
        context.log.info(f"shard {key} ({split}): {r.bytes:,} bytes {'downloaded' if r.downloaded else 'already present'}")
    for manifest in manifests.values():
        check_sha256_pins(store, manifest, "raw_shards")
    secs = time.time() - t0
    return MaterializeResult(data_version=DataVersion(digest(shard_contents(store))), metadata={
        "shards": len(rows), "downloaded": fetched, "bytes": total,
        "mb_per_s": round(total / 1e6 / max(secs, 1e-6), 1),
        "shards_table": MetadataValue.md(md_table(["shard", "split", "bytes", "sha256", "status"], rows)),
    })


class TokenizerConfig(Config):
    preset: str = ""  # "": GHOSTVIS_PRESET, else the default preset (read when the asset runs)
    vocab_size: int = 0  # 0: the preset's tokenizer vocabulary
    max_train_bytes: int = 200_000_000
    force: bool = False  # true: train even when a tokenizer of the same identity is in the store
    # a Hugging Face checkpoint (folder, s3://, hf://org/name@rev) whose tokenizer.json to use instead of
    # training one: the data is then tokenized as that model was trained, for stages that init_from it
    from_model: str = ""


@asset(group_name="data", kinds={"python"}, owners=["team:data"], deps=[raw_shards], code_version=TOKENIZER_CODE)
def tokenizer(context: AssetExecutionContext, config: TokenizerConfig, home: GhostvisHome) -> MaterializeResult:
    """Trains a byte-level BPE on the train shards of the text sources; served as tiktoken. A shard is
    left out when its split (the split rule applied to its content) is validation. Identity: the
    vocabulary, the byte cap and the text shards by recorded content and split; a tokenizer of the same
    identity in the store is returned, not retrained. Data version: the tokenizer id (a content hash),
    so a retraining that yields the same tokenizer changes nothing downstream."""
    store = home.home().store
    if config.from_model:
        tok = import_tokenizer(store, config.from_model)
        context.log.info(f"tokenizer: {tok.tokenizer_id} is the tokenizer of {config.from_model} (not trained)")
        return _tokenizer_result(store, {"tokenizer_id": tok.tokenizer_id, "vocab_size": tok.vocab_size,
                                         "from_model": config.from_model, "train_shards": 0, "train_shard_ids": []}, None)
    vocab = config.vocab_size or presets.tokenizer_vocab(run_modes.model_preset(config.preset or presets.default_preset()))
    ident = tokenizer_identity(store, vocab, config.max_train_bytes)
    key = digest(ident)
    record = store.read_json("identity", "tokenizer", key) if store.exists("identity", "tokenizer", key) else None
    if record and not config.force and store.exists("tokenizer", record["metadata"]["tokenizer_id"]):
        why = (f"identity {key} (vocab {vocab}, max_train_bytes {config.max_train_bytes}, the text shards by content "
               f"and split) equals that of tokenizer {record['metadata']['tokenizer_id']}, trained before")
        context.log.info(f"tokenizer: cache hit, {why}")
        return _tokenizer_result(store, record["metadata"], {"identity": key, "why": why})
    corpus = tokenizer_corpus(store, config.max_train_bytes)
    if not corpus.texts:
        raise GhostvisError("no downloaded text train shards to train the tokenizer on; materialize raw_shards first")
    context.log.info(f"tokenizer: {len(corpus.train_shard_ids)} train shards, "
                     f"{len(corpus.validation_shard_ids)} validation shards left out")
    t0 = time.time()
    tok = train_tokenizer(corpus.texts, vocab)
    save_tokenizer(tok, store)
    md = {"tokenizer_id": tok.tokenizer_id, "vocab_size": tok.vocab_size,
          "train_shards": len(corpus.train_shard_ids), "train_shard_ids": corpus.train_shard_ids,
          "validation_shards_excluded": len(corpus.validation_shard_ids),
          "validation_shard_ids_excluded": corpus.validation_shard_ids,
          "train_bytes": corpus.train_bytes, "train_seconds": round(time.time() - t0, 2)}
    store.write_json("identity", "tokenizer", key, data={
        "identity": ident, "code_version": TOKENIZER_CODE, "metadata": md})
    return _tokenizer_result(store, md, None)


def _tokenizer_result(store, md: dict, cached_from: dict | None) -> MaterializeResult:
    """The tokenizer's metadata (lists as JSON, its folder where the store is now); data version = its id."""
    out = {k: MetadataValue.json(v) if isinstance(v, list) else v for k, v in md.items()}
    out["path"] = MetadataValue.path(store.uri_of("tokenizer", md["tokenizer_id"]))
    if cached_from:
        out["cached_from"] = MetadataValue.json(cached_from)
    return MaterializeResult(metadata=out, data_version=DataVersion(md["tokenizer_id"]))


class TokenizeConfig(Config):
    workers: int = 2
    # per source, datatrove document filters: min_chars=N, max_chars=N, regex_exclude=PATTERN,
    # fineweb_quality. Exact duplicates within a shard are always removed. Drops are counted.
    filters: dict[str, list[str]] = {}


def data_runner(launcher: Launcher):
    """Where tokenization runs: datatrove workers here, or a Slurm job array with the `slurm` launcher."""
    if launcher.kind == "slurm":
        return SlurmPipeline(SlurmJob(**launcher.slurm.model_dump()))
    return None


@asset(
    group_name="data",
    kinds={"datatrove"},
    owners=["team:data"],
    partitions_def=shard_partitions,
    backfill_policy=SHARD_BACKFILL,
    deps=[raw_shards, tokenizer],
    code_version=TOKENIZE_CODE,
)
def tokenized_shards(context: AssetExecutionContext, config: TokenizeConfig, home: GhostvisHome,
                     launcher: Launcher) -> MaterializeResult:
    """Tokenizes shards with datatrove workers into token shards and writes their ledger rows.
    A shard already tokenized with the same content and tokenizer is not redone. Data version: the
    tokenizer, the filters and the recorded content of every registered shard (like raw_shards')."""
    h = home.home()
    tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
    jobs = [job_for_shard(h.store, manifest_of_shard(h.store, key), key) for key in context.partition_keys]
    t0 = time.time()
    reports = tokenize_shards(jobs, store=h.store, tokenizer_id=tokenizer_id,
                              logging_dir=h.root / "logs" / "datatrove" / tokenizer_id, workers=config.workers,
                              filters=dict(config.filters), run_pipeline=data_runner(launcher))
    secs = time.time() - t0
    done = [r for r in reports if not r.skipped]
    text_bytes = sum(r.text_bytes for r in done)
    for r in reports:
        context.log.info(f"shard {r.shard_id}: {r.docs:,} docs, {r.tokens:,} tokens{' (unchanged, skipped)' if r.skipped else ''}")
    version = digest({"tokenizer": tokenizer_id, "filters": dict(config.filters), "shards": shard_contents(h.store)})
    return MaterializeResult(data_version=DataVersion(version), metadata={
        "tokenizer_id": tokenizer_id, "shards": len(reports), "tokenized": len(done),
        "skipped_unchanged": len(reports) - len(done),
        "docs": sum(r.docs for r in reports), "tokens": sum(r.tokens for r in reports),
        "docs_dropped": sum(r.docs_dropped for r in reports), "tokens_dropped": sum(r.tokens_dropped for r in reports),
        "text_mb_per_s": round(text_bytes / 1e6 / max(secs, 1e-6), 2),
        "shards_table": MetadataValue.md(md_table(
            ["shard", "docs", "tokens", "dropped docs", "dropped tokens", "why", "status"],
            [[r.shard_id, r.docs, r.tokens, r.docs_dropped, r.tokens_dropped, r.drop_reasons,
              "skipped" if r.skipped else "tokenized"] for r in reports])),
    })


@asset(group_name="data", kinds={"duckdb", "parquet"}, owners=["team:data"], deps=[tokenized_shards, tokenizer],
       code_version=LEDGER_CODE)
def token_ledger(context: AssetExecutionContext, home: GhostvisHome) -> MaterializeResult:
    """The token ledger's shard table for the current tokenizer: what each source and split holds.
    Data version: that table (each shard's content hash, split, docs and tokens)."""
    store = home.home().store
    tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
    rows = Ledger.in_store(store).shards(tokenizer_id=tokenizer_id)
    if not rows:
        raise GhostvisError(f"the ledger has no shards tokenized with {tokenizer_id}; materialize tokenized_shards")
    by = source_split_totals(rows)
    table = [[t["source"], t["split"], t["shards"], t["docs"], t["tokens"], t["text_bytes"]] for t in by]
    version = digest({"tokenizer": tokenizer_id, "shards": ledger_identity(rows)})
    return MaterializeResult(data_version=DataVersion(version), metadata={
        "tokenizer_id": tokenizer_id,
        "shards": len(rows),
        "docs": sum(t["docs"] for t in by),
        "tokens": sum(t["tokens"] for t in by),
        "train_tokens": sum(t["tokens"] for t in by if t["split"] == "train"),
        "validation_tokens": sum(t["tokens"] for t in by if t["split"] == "validation"),
        "ledger_dir": MetadataValue.path(store.uri_of("ledger")),
        "by_source": MetadataValue.md(md_table(["source", "split", "shards", "docs", "tokens", "text_bytes"], table)),
    })
