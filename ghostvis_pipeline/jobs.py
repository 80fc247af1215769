"""Jobs for the UI's launchpad: shard data (partitioned) and the training chain."""

from dagster import AssetSelection, define_asset_job

from ghostvis_core.stages import stage_names

shard_data_job = define_asset_job(
    "shard_data",
    selection=AssetSelection.assets("raw_shards", "tokenized_shards"),  # partitioned by shard: inferred from them
    description="Download and tokenize shard partitions (backfill a range from the UI).",
)

training_job = define_asset_job(
    "training",
    selection=AssetSelection.assets(*stage_names()),
    description="Every training stage in dependency order, from the stored tokenized shards.",
)
