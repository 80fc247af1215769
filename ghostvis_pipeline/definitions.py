"""The Dagster code location: `dagster dev` (workspace.yaml) and `dagster ... -m ghostvis_pipeline.definitions`."""

import warnings

from dagster import BetaWarning, Definitions, PreviewWarning, SupersessionWarning, in_process_executor

# Dagster's notes on its own beta/preview/superseded APIs (e.g. `backfill_policy`) are not the
# user's business; filtered by class before the asset modules below are imported.
for _category in (BetaWarning, PreviewWarning, SupersessionWarning):
    warnings.filterwarnings("ignore", category=_category)

from ghostvis_core.plan import selected
from ghostvis_core.plan.presets import VARIANTS
from ghostvis_core.plan.stages import stage
from ghostvis_core.verify.replay.refusal import REPLAYABLE_OBJECTIVES
from ghostvis_pipeline.assets.data import raw_shards, shard_manifest, token_ledger, tokenized_shards, tokenizer
from ghostvis_pipeline.assets.evaluation import evaluation, report
from ghostvis_pipeline.assets.training import stage_asset, variants_asset
from ghostvis_pipeline.checks import (
    data_checks,
    lineage_quality_gate,
    replay_check,
    stage_checks,
    tokenizer_trained_on_train_shards_only,
)
from ghostvis_pipeline.launchers import Launcher
from ghostvis_pipeline.launchpad.asset_jobs import checks_job, shard_data_job, training_job
from ghostvis_pipeline.launchpad.export import export_model
from ghostvis_pipeline.launchpad.trace import trace
from ghostvis_pipeline.resources import GhostvisHome

# The stages of the selected lineage (GHOSTVIS_LINEAGE, ghostvis_core/plan/lineage.py), each starting from its
# lineage upstream's checkpoint and reading the token ledger and the tokenizer: a new tokenizer (a new data
# version) shows every stage as unsynced in the UI and in `ghostvis status`.
chain = selected.lineage()
stage_assets = []
for name, start in chain.starts:
    deps = [token_ledger, tokenizer] + ([start] if start else [])
    stage_assets.append(stage_asset(stage(name), deps))
    if name in VARIANTS:
        stage_assets.append(variants_asset(stage(name), deps))

all_assets = [shard_manifest, raw_shards, tokenizer, tokenized_shards, token_ledger, *stage_assets, evaluation, report]
defs = Definitions(
    assets=all_assets,
    asset_checks=[
        tokenizer_trained_on_train_shards_only,
        *data_checks(),
        *[c for name in chain.stage_names() for c in stage_checks(name)],
        *[replay_check(name) for name in chain.stage_names() if stage(name).objective in REPLAYABLE_OBJECTIVES],
        lineage_quality_gate,
    ],
    jobs=[shard_data_job, training_job(chain), checks_job, export_model, trace],
    resources={"home": GhostvisHome(), "launcher": Launcher()},
    # Every step in the run's own process: the heavy work already runs elsewhere (torchrun, datatrove
    # workers, a cluster), and a process per step re-imports the code location for each of a
    # stage's checks, which would cost more than a smoke stage's training.
    executor=in_process_executor,
)
