"""A cache hit never hides a failed check (ghostvis_pipeline/cache.py): a run key is reused only if
every check passed on a materialization that carried it and no execution of a check on it failed.
A real (ephemeral) Dagster instance and a tiny asset whose check passes or fails by run config."""

from dagster import (
    AssetCheckResult,
    Config,
    DagsterInstance,
    Definitions,
    MaterializeResult,
    asset,
    asset_check,
    define_asset_job,
)

from ghostvis_pipeline.cache import checks_passed_in


class RunConfig(Config):
    run_key: str


class CheckConfig(Config):
    passes: bool


@asset
def stage(config: RunConfig) -> MaterializeResult:
    return MaterializeResult(metadata={"run_key": config.run_key})


@asset_check(asset=stage)
def counts_agree(config: CheckConfig) -> AssetCheckResult:
    return AssetCheckResult(passed=config.passes)


JOB = Definitions(
    assets=[stage], asset_checks=[counts_agree], jobs=[define_asset_job("j", selection=["stage"])]
).resolve_job_def("j")


def materialize(instance, run_key: str, passes: bool) -> str:
    result = JOB.execute_in_process(
        instance=instance,
        raise_on_error=False,
        run_config={
            "ops": {"stage": {"config": {"run_key": run_key}}, "stage_counts_agree": {"config": {"passes": passes}}}
        },
    )
    return result.run_id


def test_only_a_run_whose_checks_passed_and_never_failed_is_reused():
    with DagsterInstance.ephemeral() as instance:
        assert checks_passed_in(instance, "stage", "stage-a-r1", ["counts_agree"]) is None  # never materialized
        materialize(instance, "stage-a-r1", passes=False)
        assert checks_passed_in(instance, "stage", "stage-a-r1", ["counts_agree"]) is None
        passed = materialize(instance, "stage-a-r2", passes=True)
        assert checks_passed_in(instance, "stage", "stage-a-r2", ["counts_agree"]) == passed
        materialize(instance, "stage-a-r1", passes=True)  # a later pass does not hide the failure
        assert checks_passed_in(instance, "stage", "stage-a-r1", ["counts_agree"]) is None
        assert checks_passed_in(instance, "stage", "stage-a-r2", ["counts_agree", "not_run"]) is None
