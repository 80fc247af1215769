"""Data assets: shard manifest -> raw shards -> tokenizer -> tokenized shards -> token ledger."""

import time
from collections import Counter
from contextlib import ExitStack
from functools import partial

from dagster import (
    AssetExecutionContext,
    AssetObservation,
    BackfillPolicy,
    Config,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
)

from ghostvis_core.data.catalog import (
    RemoteSource,
    check_declarations,
    check_sha256_pins,
    keep_replaced_version,
    manifests_of_shards,
    record_raw_shard,
    remote_manifest,
    save_manifest,
    shard_split_shown,
)
from ghostvis_core.data.data_identities import ledger_identity, manifest_identity, shard_contents, tokenizer_identity
from ghostvis_core.data.dedup import dedup_indexes, removed_rows
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.summaries import source_split_totals
from ghostvis_core.data.normalize_shard import normalize_shard
from ghostvis_core.data.shard_changes import ShardChange, describe_changes, training_data_changes
from ghostvis_core.data.shard_manifest import fetch_shard
from ghostvis_core.data.tokenize_shards import job_for_shard, tokenize_shards
from ghostvis_core.demo.publish_sources import DEMO_SOURCES, publish_demo_source
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.identity import code_version, digest
from ghostvis_core.launch.cluster.slurm_pipeline import SlurmPipeline
from ghostvis_core.launch.cluster.slurm_script import SlurmJob
from ghostvis_core.plan import presets, run_modes, selected
from ghostvis_core.run.tokenizer_training import TokenizerSpec, brought_spec, tokenizer_job, write_spec
from ghostvis_core.store.fence import is_committed
from ghostvis_pipeline.config import config_from_dataclass
from ghostvis_pipeline.launchers import Launcher
from ghostvis_pipeline.leases import run_lease
from ghostvis_pipeline.metadata import latest_metadata, md_table, newest_metadata_or_none
from ghostvis_pipeline.partitions import shard_partitions
from ghostvis_pipeline.resources import GhostvisHome

# A source of your own: the fields and defaults of ghostvis_core.data.catalog.RemoteSource, declared there once.
RemoteSourceConfig = config_from_dataclass(RemoteSource)


# The modules that make each data asset: its code_version hashes them and what they import
# (ghostvis_core/identity.py). Each asset's data version is its identity: see the assets' docstrings.
MANIFEST_CODE = code_version("ghostvis_core.data.catalog")
RAW_SHARDS_CODE = code_version("ghostvis_core.data.shard_manifest", "ghostvis_core.data.catalog")
TOKENIZER_CODE = code_version(
    "ghostvis_core.run.tokenizer_training", "ghostvis_core.data.catalog", "ghostvis_core.data.brought_tokenizer"
)
TOKENIZE_CODE = code_version("ghostvis_core.data.tokenize_shards", "ghostvis_core.data.dedup")
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
    check_declarations(
        [(source, DEMO_SOURCES.get(source, "text")) for source in config.sources]
        + [(src.name, src.kind) for src in config.remote]
    )
    remote = [remote_manifest(RemoteSource(**src.model_dump())) for src in config.remote]
    manifests = [publish_demo_source(h, source) for source in config.sources] + remote
    for manifest in manifests:
        check_sha256_pins(h.store, manifest, "shard_manifest")
    for manifest in manifests:
        save_manifest(h.store, manifest)
    keys = [sid for manifest in manifests for sid in manifest.entries_by_id]
    known = set(context.instance.get_dynamic_partitions(shard_partitions.name))
    new = [k for k in keys if k not in known]
    if new:
        context.instance.add_dynamic_partitions(shard_partitions.name, new)
    return MaterializeResult(
        data_version=DataVersion(digest(manifest_identity(manifests))),
        metadata={
            "shards": len(keys),
            "new_partitions": len(new),
            "sources": ", ".join(m.source for m in manifests),
            "by_source": MetadataValue.md(
                md_table(
                    ["source", "kind", "shards", "train", "validation", "pending download (sha256 pins)", "manifest"],
                    [source_split_counts(h.store, m) for m in manifests],
                )
            ),
        },
    )


def source_split_counts(store, manifest) -> list:
    """One source's row of shard_manifest's table: its shards by the split shown (catalog.shard_split_shown)
    and where its manifest, the list of every shard, is. One row per source, so the event does not grow
    with the number of shards."""
    shown = Counter(shard_split_shown(store, manifest, sid) for sid in manifest.entries_by_id)
    pending = sum(n for split, n in shown.items() if split not in ("train", "validation"))
    return [
        manifest.source,
        manifest.kind,
        len(manifest.shards),
        shown["train"],
        shown["validation"],
        pending,
        store.uri_of("manifest", manifest.source),
    ]


# A backfill of raw_shards or tokenized_shards is one Dagster run (the CLI's --partition-range needs
# that); inside it the shards fan out over datatrove workers, or over a Slurm job array with the
# `slurm` launcher (one task per shard, on the cluster's nodes).
SHARD_BACKFILL = BackfillPolicy.single_run()


def shard_asset(kind: str, deps: list, code: str):
    """The decorator of a data asset with one partition per shard (raw_shards, tokenized_shards), backfilled
    as one run (SHARD_BACKFILL)."""
    return asset(
        group_name="data",
        kinds={kind},
        owners=["team:data"],
        partitions_def=shard_partitions,
        backfill_policy=SHARD_BACKFILL,
        deps=deps,
        code_version=code,
    )


@shard_asset("parquet", [shard_manifest], RAW_SHARDS_CODE)
def raw_shards(context: AssetExecutionContext, home: GhostvisHome) -> MaterializeResult:
    """Downloads shards through the one fetch path (temp name, verify size + sha256, check every row of
    the kind and write a user's JSON Lines or renamed columns as the kind's Parquet, rename), and
    records each one's content hash, size and split (the split rule applied to that content). A shard
    is its content: a download whose content differs from the recorded one is a new version, and the
    previous file and record are kept (`keep_replaced_version`, `record_raw_shard`) for the runs that
    trained on them. Once
    every shard of a source is downloaded, a validation_sha256 pin that matches none of them fails here.
    Each shard's figures are an observation of its partition (`shard_observation`); the run's counts are
    its one summary log line. Data version: the recorded content hash of every
    registered shard, the same whichever partitions a run covers, so a shard downloaded again with the
    same bytes changes nothing downstream."""
    store = home.home().store
    t0 = time.time()
    keys = context.partition_keys
    manifests = manifests_of_shards(store, keys)
    total = fetched = 0
    for key in keys:
        manifest = manifests[key]
        local = store.fetch("raw_shard", key) if store.exists("raw_shard", key) else store.writable("raw_shard", key)
        r = fetch_shard(
            key,
            manifest.entry(key),
            local,
            check=partial(normalize_shard, key, manifest.kind, manifest.columns, manifest.entry(key).url),
            admit=partial(keep_replaced_version, store, key),
        )
        store.publish("raw_shard", key)
        split = record_raw_shard(store, manifest, key, r.sha256, r.bytes)
        total += r.bytes
        fetched += r.downloaded
        shard_observation(
            context,
            key,
            {
                "split": split,
                "bytes": r.bytes,
                "sha256": r.sha256,
                "status": "downloaded" if r.downloaded else "present",
                "path": MetadataValue.path(store.uri_of("raw_shard", key)),
            },
        )
    for manifest in {m.source: m for m in manifests.values()}.values():
        check_sha256_pins(store, manifest, "raw_shards")
    secs = time.time() - t0
    context.log.info(
        f"raw_shards: {len(keys):,} shards, {fetched:,} downloaded, {len(keys) - fetched:,} already "
        f"present, {total:,} bytes, {total / 1e6 / max(secs, 1e-6):.1f} MB/s"
    )
    return MaterializeResult(data_version=DataVersion(digest(shard_contents(store))))


def shard_observation(context: AssetExecutionContext, partition: str, figures: dict) -> None:
    """One shard's own figures, logged as an observation of its partition: shown in that partition's
    events in the UI, and each costs the same whatever the number of partitions the run covers. The
    backfill's MaterializeResult sets no metadata: Dagster copies it into each of the run's N
    materializations; the run's counts are its one summary log line."""
    # not add_asset_metadata(partition_key=...): Dagster 1.13 reloads every dynamic partition key per call (N^2)
    context.log_event(AssetObservation(asset_key=context.asset_key, partition=partition, metadata=figures))


class TokenizerConfig(Config):
    preset: str = ""  # "": GHOSTVIS_PRESET, else the default preset (read when the asset runs)
    vocab_size: int = 0  # 0: the preset's tokenizer vocabulary
    max_train_bytes: int = 200_000_000
    force: bool = False  # true: train even when a tokenizer of the same identity is in the store
    # a Hugging Face checkpoint (folder, s3://, hf://org/name@rev) whose tokenizer.json to use instead of
    # training one: the data is then tokenized as that model was trained, for stages that init_from it
    from_model: str = ""
    # a tokenizer file to use instead of training one: a byte-level BPE tokenizer.json or a tiktoken BPE file
    # (path, s3://, http(s)://, hf://org/name@rev for its tokenizer.json): ghostvis_core.data.brought_tokenizer
    from_file: str = ""
    # with from_file or from_model: GhostVis's bos, eot, system, user, assistant, image, pad -> the file's text
    # for each ({"user": "<|im_start|>user\n"}); ChatML and Llama 3 files need none
    special_tokens: dict[str, str] = {}
    pattern: str = ""  # with a tiktoken BPE file: its split regex ("": cl100k's, which Llama 3 uses too)


@asset(group_name="data", kinds={"python"}, owners=["team:data"], deps=[raw_shards], code_version=TOKENIZER_CODE)
def tokenizer(
    context: AssetExecutionContext, config: TokenizerConfig, home: GhostvisHome, launcher: Launcher
) -> MaterializeResult:
    """Trains a byte-level BPE on the train shards of the text sources; served as tiktoken. A shard is
    left out when its split (the split rule applied to its content) is validation. Identity: the
    vocabulary, the byte cap and the text shards by recorded content and split; a tokenizer of the same
    identity in the store is returned, not retrained (read here: a cache hit launches nothing). Or takes
    the tokenizer of a model (from_model) or a file (from_file), brought again each time. Training, taking
    and bringing run in the tokenizer job (ghostvis_core/run/tokenizer_training.py), launched where the launcher
    runs jobs; this process plans, launches and reads the record the job wrote. Data version: the tokenizer
    id (a content hash), so a retraining that yields the same tokenizer changes nothing downstream.
    `ghostvis data` keeps an existing tokenizer whose training data alone changed (`tokenizer_kept`): it does
    not materialize this asset then, which stays stale naming the changed shards until materialized by choice."""
    store = home.home().store
    if config.from_model and config.from_file:
        raise GhostvisError("tokenizer: from_model and from_file are both set; set one of them")
    if config.from_model or config.from_file:
        return _bring_tokenizer(context, config, home.home(), launcher)
    ident = trained_identity(store, config)
    key = digest(ident)
    with run_lease(context, store, "tokenizer", key):  # a second launch waits, then finds this one's tokenizer
        return _train_or_reuse_tokenizer(context, config, home.home(), launcher, ident, key, ident["vocab_size"])


def trained_identity(store, config: TokenizerConfig) -> dict:
    """What the tokenizer this config trains is made of (`tokenizer_identity`): its vocabulary (the preset's
    unless given), its byte cap, and the text shards by content and split as raw_shards recorded them."""
    vocab = config.vocab_size or presets.tokenizer_vocab(
        run_modes.model_preset(config.preset or selected.default_preset())
    )
    return tokenizer_identity(store, vocab, config.max_train_bytes)


def made_of(store, md: dict) -> dict | None:
    """The identity a trained tokenizer's materialization (its metadata `md`) was trained on, from its identity
    record; None for a tokenizer taken from a model or a file, or one whose record is not in the store."""
    key = md.get("identity")
    if not key or md.get("from_model") or md.get("from_file") or not store.exists("identity", "tokenizer", key):
        return None
    return store.read_json("identity", "tokenizer", key)["identity"]


def tokenizer_kept(instance, store, preset: str) -> bool:
    """Whether `ghostvis data` keeps the newest tokenizer instead of materializing the asset: it was trained by
    this asset for the preset's vocabulary and the default byte cap, and only its training data changed since (a
    text shard revised, added or removed upstream). A new tokenizer would re-tokenize every shard and make every
    trained stage stale, so it is trained only by choice: by materializing the asset (`ghostvis data
    --retrain-tokenizer`). False: materialize it (no tokenizer yet, another vocabulary or byte cap, or the same
    identity: a cache hit)."""
    md = newest_metadata_or_none(instance, "tokenizer")
    made = made_of(store, md) if md else None
    if made is None:
        return False
    return bool(training_data_changes(made, trained_identity(store, TokenizerConfig(preset=preset))))


def kept_tokenizer_note(tokenizer_id: str, changes: list[ShardChange], shown: int = 5) -> str:
    """What `ghostvis status` and `ghostvis data` say of a tokenizer kept while its training data changed."""
    return (
        f"its training data changed since {tokenizer_id} was trained: {describe_changes(changes, shown)}. It is "
        "kept (tokenized_shards tokenize the new versions with it); to train a new one on the current shards, "
        "materialize tokenizer (`ghostvis data --retrain-tokenizer`): every shard is then tokenized again and every "
        "stage is stale"
    )


def _train_or_reuse_tokenizer(
    context, config, h: Home, launcher: Launcher, ident: dict, key: str, vocab: int
) -> MaterializeResult:
    """Under the identity's lease: the tokenizer of this identity if one was trained (also by the launch this one
    waited for), else a new one, trained by a job where the launcher runs jobs
    (ghostvis_core/run/tokenizer_training.py)."""
    store = h.store
    committed = is_committed(store, "tokenizer", key, "identity", "tokenizer", key)  # not a lost launch's
    record = store.read_json("identity", "tokenizer", key) if committed else None
    if record and not config.force and store.exists("tokenizer", record["metadata"]["tokenizer_id"]):
        why = (
            f"identity {key} (vocab {vocab}, max_train_bytes {config.max_train_bytes}, the text shards by content "
            f"and split) equals that of tokenizer {record['metadata']['tokenizer_id']}, trained before"
        )
        context.log.info(f"tokenizer: cache hit, {why}")
        return _tokenizer_result(store, record["metadata"], key, {"identity": key, "why": why})
    spec = TokenizerSpec(
        key, store.uri, ident, TOKENIZER_CODE, vocab_size=vocab, max_train_bytes=config.max_train_bytes
    )
    return _tokenizer_result(store, _run_tokenizer_job(context, spec, h, launcher), key, None)


def _bring_tokenizer(context, config, h: Home, launcher: Launcher) -> MaterializeResult:
    """A tokenizer taken from a model (from_model: the import code imports torch) or brought as a file (from_file:
    a download and a tiktoken build), by the tokenizer job; brought again at each materialization."""
    spec = brought_spec(
        h.store.uri,
        TOKENIZER_CODE,
        from_model=config.from_model,
        from_file=config.from_file,
        special_tokens=dict(config.special_tokens),
        pattern=config.pattern,
    )
    md = _run_tokenizer_job(context, spec, h, launcher)
    return _tokenizer_result(h.store, md | {"markers": MetadataValue.json(md["markers"])}, None, None)


def _run_tokenizer_job(context, spec: TokenizerSpec, h: Home, launcher: Launcher) -> dict:
    """The tokenizer job launched on its spec; the figures of the identity record it wrote."""
    write_spec(spec, h.store)
    launcher.run(context, tokenizer_job(spec), h)
    return h.store.read_json("identity", "tokenizer", spec.key)["metadata"]


# The shards a trained tokenizer read and left out: lists as long as the sources, kept in its identity record
# (read by checks.tokenizer_trained_on_train_shards_only), not in its materialization event (133 KB at 10,000 shards).
SHARD_LISTS = ("train_shard_ids", "validation_shard_ids_excluded")


def _tokenizer_result(store, md: dict, identity_key: str | None, cached_from: dict | None) -> MaterializeResult:
    """The tokenizer's figures without its shard lists, the identity record that holds them (`shard_lists`;
    none for a tokenizer taken from a model, which read no shard), its folder where the store is now;
    data version = its id."""
    out = {k: v for k, v in md.items() if k not in SHARD_LISTS}
    out["path"] = MetadataValue.path(store.uri_of("tokenizer", md["tokenizer_id"]))
    if identity_key:
        out["identity"] = identity_key
        out["shard_lists"] = MetadataValue.path(store.uri_of("identity", "tokenizer", identity_key))
    if cached_from:
        out["cached_from"] = MetadataValue.json(cached_from)
    return MaterializeResult(metadata=out, data_version=DataVersion(md["tokenizer_id"]))


class TokenizeConfig(Config):
    workers: int = 2
    # per source, datatrove document filters: min_chars=N, max_chars=N, regex_exclude=PATTERN,
    # fineweb_quality. Exact duplicates within a shard are always removed. Drops are counted.
    filters: dict[str, list[str]] = {}
    # per text source, near duplicates removed across all its downloaded shards before tokenization
    # (first in shard order kept), counted as minhash_dup: {web: minhash} (ghostvis_core/data/dedup.py).
    dedup: dict[str, str] = {}


def data_runner(launcher: Launcher):
    """Where tokenization runs: datatrove workers here, or a Slurm job array with the `slurm` launcher."""
    if launcher.kind == "slurm":
        return SlurmPipeline(SlurmJob(**launcher.slurm.model_dump()))
    return None


@shard_asset("datatrove", [raw_shards, tokenizer], TOKENIZE_CODE)
def tokenized_shards(
    context: AssetExecutionContext, config: TokenizeConfig, home: GhostvisHome, launcher: Launcher
) -> MaterializeResult:
    """Tokenizes shards with datatrove workers into token shards and writes their ledger rows.
    A shard already tokenized with the same content and tokenizer is not redone. Each shard's figures
    are an observation of its partition (`shard_observation`), the run's counts its summary log line.
    Data version: the tokenizer, the
    filters, the dedup settings and the recorded content of every registered shard."""
    h = home.home()
    tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
    keys = context.partition_keys
    manifests = manifests_of_shards(h.store, keys)
    with ExitStack() as leases:  # one tokenization (and dedup index) per source and tokenizer at a time, in name order
        for source in sorted({m.source for m in manifests.values()}):
            leases.enter_context(run_lease(context, h.store, "tokenized_shards", f"{tokenizer_id}.{source}"))
        return _tokenize(context, config, h, launcher, tokenizer_id, keys, manifests)


def _tokenize(context, config, h, launcher, tokenizer_id: str, keys, manifests) -> MaterializeResult:
    """Under the leases of the shards' sources: shards another launch tokenized meanwhile are skipped."""
    jobs = [job_for_shard(h.store, manifests[key], key) for key in keys]
    t0 = time.time()
    indexes = dedup_indexes(
        h.store,
        dict(config.dedup),
        jobs,
        tokenizer_id=tokenizer_id,
        filters=dict(config.filters),
        logging_dir=h.root / "logs" / "datatrove" / "dedup",
        workers=config.workers,
    )
    for ix in indexes:
        context.log.info(
            f"dedup {ix.source} ({ix.method}, index {ix.key}{', reused' if ix.reused else ''}): "
            f"{ix.removed:,} near duplicates over {len(ix.shards):,} shards"
        )
    reports = tokenize_shards(
        jobs,
        store=h.store,
        tokenizer_id=tokenizer_id,
        logging_dir=h.root / "logs" / "datatrove" / tokenizer_id,
        workers=config.workers,
        filters=dict(config.filters),
        run_pipeline=data_runner(launcher),
        removed=removed_rows(h.store, indexes),
    )
    secs = time.time() - t0
    for r in reports:
        shard_observation(context, r.shard_id, shard_figures(h.store, tokenizer_id, r))
    done = [r for r in reports if not r.skipped]
    context.log.info(
        f"tokenized_shards: {len(reports):,} shards ({len(done):,} tokenized, {len(reports) - len(done):,} unchanged "
        f"and skipped), {sum(r.docs for r in reports):,} docs, {sum(r.tokens for r in reports):,} tokens, "
        f"{sum(r.text_bytes for r in done) / 1e6 / max(secs, 1e-6):.2f} MB/s of text; every shard: `ghostvis ledger`"
    )
    version = digest(
        {
            "tokenizer": tokenizer_id,
            "filters": dict(config.filters),
            "dedup": dict(config.dedup),
            "shards": shard_contents(h.store),
        }
    )
    return MaterializeResult(data_version=DataVersion(version))


def shard_figures(store, tokenizer_id: str, report) -> dict:
    """One partition's observation: that shard's figures from its ledger row (never a table of every shard,
    which would be stored with each of the N partitions' events: N^2; the ledger holds that table)."""
    return {
        "tokenizer_id": tokenizer_id,
        "docs": report.docs,
        "tokens": report.tokens,
        "docs_dropped": report.docs_dropped,
        "tokens_dropped": report.tokens_dropped,
        "drop_reasons": report.drop_reasons,
        "status": "skipped (unchanged)" if report.skipped else "tokenized",
        "content_sha256": report.content_sha256,
        "replaces_sha256": report.replaces_sha256,
        "token_file": MetadataValue.path(
            store.uri_of("token_shard", tokenizer_id, report.shard_id, report.content_sha256)
        ),
    }


@asset(
    group_name="data",
    kinds={"duckdb", "parquet"},
    owners=["team:data"],
    deps=[tokenized_shards, tokenizer],
    code_version=LEDGER_CODE,
)
def token_ledger(context: AssetExecutionContext, home: GhostvisHome) -> MaterializeResult:
    """The token ledger's shard table for the current tokenizer: what each source and split holds; writes
    the ledger's fingerprint index (Ledger.write_ngram_index). Data version: that table (each shard's
    content hash, split, docs and tokens)."""
    store = home.home().store
    tokenizer_id = latest_metadata(context, "tokenizer")["tokenizer_id"]
    ledger = Ledger.in_store(store)
    rows = ledger.shards(tokenizer_id=tokenizer_id)
    if not rows:
        raise GhostvisError(f"the ledger has no shards tokenized with {tokenizer_id}; materialize tokenized_shards")
    ledger.write_ngram_index()  # `ghostvis trace --text` looks a text up in it, not in a file per shard
    by = source_split_totals(rows)
    table = [[t.source, t.split, t.shards, t.docs, t.tokens, t.text_bytes] for t in by]
    version = digest({"tokenizer": tokenizer_id, "shards": ledger_identity(rows)})
    return MaterializeResult(
        data_version=DataVersion(version),
        metadata={
            "tokenizer_id": tokenizer_id,
            "shards": len(rows),
            "docs": sum(t.docs for t in by),
            "tokens": sum(t.tokens for t in by),
            "train_tokens": sum(t.tokens for t in by if t.split == "train"),
            "validation_tokens": sum(t.tokens for t in by if t.split == "validation"),
            "ledger_dir": MetadataValue.path(store.uri_of("ledger")),
            "by_source": MetadataValue.md(
                md_table(["source", "split", "shards", "docs", "tokens", "text_bytes"], table)
            ),
        },
    )
