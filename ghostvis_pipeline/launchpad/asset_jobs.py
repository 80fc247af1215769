"""Jobs for the UI's launchpad: shard data (partitioned), the training chain, and the checks alone."""

from dagster import AssetSelection, define_asset_job

from ghostvis_core.plan.lineage import Lineage

shard_data_job = define_asset_job(
    "shard_data",
    selection=AssetSelection.assets("raw_shards", "tokenized_shards"),  # partitioned by shard: inferred from them
    description="Download and tokenize shard partitions (backfill a range from the UI).",
)


def training_job(chain: Lineage):
    """Every stage of the lineage in dependency order, from the stored tokenized shards."""
    return define_asset_job(
        "training",
        selection=AssetSelection.assets(*chain.stage_names()),
        description=f"Every training stage of the lineage {chain.name} in dependency order ({chain.describe()}), "
        "from the stored tokenized shards.",
    )


checks_job = define_asset_job(
    "checks_only",
    selection=AssetSelection.all_asset_checks(),
    description="Re-execute every asset check (data and stages) against the newest materializations, without "
    "retraining or re-tokenizing: the same invariants `ghostvis audit` runs.",
)
