"""The shards a stage run read, as MLflow dataset inputs (the run page's "Datasets used"): one per
shard, named by its shard id, its source the raw shard in the store, its digest the shard's content
sha256 from the ledger, its context the split (`train` / `validation`).

MLflow refuses a dataset digest longer than 36 characters (`MAX_DATASET_DIGEST_SIZE` in
mlflow.utils.validation; it raises, it does not truncate), and a sha256 has 64 hex digits: the
digest is the hash's first 36 digits and the dataset's profile holds the full `content_sha256`.
Imported by the logging thread only (mlflow is not imported on the training thread).
"""

from __future__ import annotations

import json
import warnings

from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import Dataset, DatasetInput, InputTag
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT
from mlflow.utils.validation import MAX_DATASET_DIGEST_SIZE

from ghostvis_core.run.track.shard_input import ShardInput

TOKEN_FILE_TAG = "ghostvis.token_file"


def digest(content_sha256: str) -> str:
    """The MLflow dataset digest of a shard: as much of its sha256 as MLflow stores."""
    return content_sha256[:MAX_DATASET_DIGEST_SIZE]


def dataset_input(shard: ShardInput) -> DatasetInput:
    """The dataset (the same for every run that reads this content) and this run's tags on it."""
    with warnings.catch_warnings():  # MLflow registers its local source for "" and "file" and warns of both
        warnings.simplefilter("ignore", UserWarning)
        source = resolve_dataset_source(shard.uri)
    meta = MetaDataset(source, name=shard.shard_id, digest=digest(shard.content_sha256)).to_dict()
    profile = {"content_sha256": shard.content_sha256, "source": shard.source, "split": shard.split}
    dataset = Dataset(
        name=meta["name"],
        digest=meta["digest"],
        source_type=meta["source_type"],
        source=meta["source"],
        profile=json.dumps(profile),
    )
    return DatasetInput(
        dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, shard.split), InputTag(TOKEN_FILE_TAG, shard.token_file)]
    )
