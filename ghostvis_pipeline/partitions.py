"""One dynamic partition per shard (`<source>/<shard>`), registered from the shard manifests."""

from dagster import DynamicPartitionsDefinition

shard_partitions = DynamicPartitionsDefinition(name="shards")
