"""`ghostvis status`: per asset, up to date, stale (which input changed, or its code) or missing.

The same answer the Dagster UI gives as synced / unsynced, from the same records: each
materialization carries its data version (the asset's identity), its code version and the data
versions of its inputs when it ran (its provenance). An asset is stale when its code version
changed since, or an input's data version is not the one it was made from; a partitioned input
(shards) is compared partition by partition, like Dagster does. A stale tokenizer or stage also names the
shards revised upstream since it was made, with the sha256 it was made of and the one recorded now.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ghostvis_core.home import Home
from ghostvis_core.store import Store
from ghostvis_pipeline.subcommand import subcommand

DATA_VERSION_TAG = "dagster/data_version"
SHOWN = 5  # partitions named per reason


@dataclass
class AssetStatus:
    asset: str
    state: str  # "up to date" | "stale" | "missing"
    reasons: list[str] = field(default_factory=list)
    partitions: str = ""  # "n/m up to date" for a partitioned asset


class Records:
    """The materializations of each asset, read in one pass per asset and kept per partition (newest
    first), so that the latest record of a partition, or its version at a cursor, is a dict lookup and
    a walk over that partition's own history: linear in the records, whatever the number of partitions."""

    def __init__(self, instance):
        self.instance, self.cache, self.materialized = instance, {}, {}

    def by_partition(self, key) -> dict[str | None, list]:
        from ghostvis_pipeline.metadata import materializations  # dagster: only when a status is asked for

        if key not in self.cache:
            history: dict[str | None, list] = {}
            for record in materializations(self.instance, key):
                history.setdefault(record.partition_key, []).append(record)
            self.cache[key] = history
        return self.cache[key]

    def partitions(self, key) -> set[str]:
        """The partitions of `key` that were ever materialized (computed once: asked once per partition
        of each dependent asset)."""
        if key not in self.materialized:
            self.materialized[key] = set(self.by_partition(key)) - {None}
        return self.materialized[key]

    def latest(self, key, partition: str | None = None):
        return next(iter(self.by_partition(key).get(partition, [])), None)

    def version_at(self, key, partition: str | None, storage_id: int | None) -> str | None:
        """The data version of (key, partition) as of storage_id (None: now)."""
        for r in self.by_partition(key).get(partition, []):
            if storage_id is None or r.storage_id <= storage_id:
                return _version(r)
        return None


def _version(record) -> str | None:
    return record.event_log_entry.asset_materialization.tags.get(DATA_VERSION_TAG)


def stale_reasons(records: Records, node, partition: str | None, record) -> list[str]:
    """Why one materialization (of one partition) is out of date: its code, or which inputs changed."""
    from dagster import DataProvenance

    prov = DataProvenance.from_tags(record.event_log_entry.asset_materialization.tags or {})
    if prov is None:
        return ["made before data versions were recorded: re-materialize it"]
    out = []
    code = node.code_versions_by_key.get(node.key)
    if code and code != prov.code_version:
        out.append(f"its code changed (code version {prov.code_version} -> {code})")
    for dep in sorted(node.dependency_keys, key=lambda k: k.to_user_string()):
        name = dep.to_user_string()
        if not prov.has_input_asset(dep):
            out.append(f"new input {name}")
            continue
        cursor = prov.input_storage_ids[dep]
        dep_partitions = records.partitions(dep)
        if not dep_partitions:
            now = records.version_at(dep, None, None)
            if now != prov.input_data_versions[dep].value:
                out.append(f"input {name} changed (data version {prov.input_data_versions[dep].value} -> {now})")
            continue
        keys = [partition] if partition in dep_partitions else sorted(dep_partitions)
        changed = [p for p in keys if records.version_at(dep, p, cursor) != records.version_at(dep, p, None)]
        if changed:
            more = f" and {len(changed) - SHOWN} more" if len(changed) > SHOWN else ""
            out.append(f"input {name} changed in partition(s) {', '.join(changed[:SHOWN])}{more}")
    return out


def shard_reasons(store: Store, asset: str, record, reasons: list[str]) -> list[str]:
    """A stale materialization's reasons with the shards revised since it was made, each with the sha256 it was
    made of and the one recorded now: for a trained tokenizer, its training data (in place of raw_shards' reason,
    which names every partition a backfill re-recorded); for a stage, the shards its run trained and validated on."""
    from ghostvis_core.data.shard_changes import describe_changes, run_data_changes, tokenizer_data_changes
    from ghostvis_core.runs.launch_spec import saved_shard_versions, saved_spec
    from ghostvis_pipeline.assets.data import kept_tokenizer_note, made_of

    md = {k: getattr(v, "value", v) for k, v in record.event_log_entry.asset_materialization.metadata.items()}
    made = made_of(store, md) if asset == "tokenizer" else None
    if made and (changes := tokenizer_data_changes(store, made)):
        return [r for r in reasons if not r.startswith("input raw_shards ")] + [
            kept_tokenizer_note(md["tokenizer_id"], changes, SHOWN)
        ]
    run_key = md.get("run_key")
    if run_key and store.exists("run_spec", asset, run_key):
        if changes := run_data_changes(store, saved_shard_versions(saved_spec(store, asset, run_key))):
            return [*reasons, f"run {run_key} trained on shards revised since: {describe_changes(changes, SHOWN)}"]
    return reasons


def asset_status(instance, records: Records, node, store: Store | None = None) -> AssetStatus:
    """One asset's status; with the store, a stale one also names the shards revised since (`shard_reasons`)."""
    name = node.key.to_user_string()
    if node.partitions_def is None:
        record = records.latest(node.key)
        if record is None:
            return AssetStatus(name, "missing", ["never materialized"])
        reasons = stale_reasons(records, node, None, record)
        if reasons and store is not None:
            reasons = shard_reasons(store, name, record, reasons)
        return AssetStatus(name, "stale" if reasons else "up to date", reasons)
    keys = node.partitions_def.get_partition_keys(dynamic_partitions_store=instance)
    missing, stale = [], {}
    for key in keys:
        record = records.latest(node.key, key)
        if record is None:
            missing.append(key)
        elif reasons := stale_reasons(records, node, key, record):
            stale[key] = reasons
    fresh = len(keys) - len(missing) - len(stale)
    reasons = [f"{p}: {'; '.join(r)}" for p, r in list(stale.items())[:SHOWN]]
    if missing:
        reasons.append(f"{len(missing)} partition(s) never materialized: {', '.join(missing[:SHOWN])}")
    state = "stale" if stale else ("missing" if missing or not keys else "up to date")
    return AssetStatus(name, state, reasons, f"{fresh}/{len(keys)} up to date")


def statuses(defs, instance, store: Store | None = None) -> list[AssetStatus]:
    """Every asset of the code location, upstream first (with the store: the revised shards named)."""
    records = Records(instance)
    return [asset_status(instance, records, node, store) for node in defs.assets]


def format_statuses(rows: list[AssetStatus]) -> str:
    lines = [f"{'asset':<22} {'status':<11} why"]
    for s in rows:
        first, rest = (s.partitions, s.reasons) if s.partitions else ((s.reasons or [""])[0], s.reasons[1:])
        lines.append(f"{s.asset:<22} {s.state:<11} {first}".rstrip())
        lines += [f"{'':<35}{r}" for r in rest]
    return "\n".join(lines)


def cmd_status(args) -> int:
    from dagster import DagsterInstance

    from ghostvis_pipeline.definitions import defs
    from ghostvis_pipeline.environment import prepare_environment

    home = Home.from_env()
    prepare_environment(home)
    rows = statuses(defs, DagsterInstance.get(), home.store)
    print(json.dumps([asdict(r) for r in rows], indent=2) if args.json else format_statuses(rows))
    return 0


def add_parser(sub) -> None:
    subcommand(
        sub,
        "status",
        help="per asset: up to date, stale (which input or code changed) or missing",
        description="What the Dagster UI shows as synced / unsynced: an asset is stale when its "
        "code or an input's data version changed since it was materialized.",
        fn=cmd_status,
        json=True,
    )
