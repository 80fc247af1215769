"""The UI's `export_model` job: the export runs in a process of its own (`python -m
ghostvis_core.run.hf.export`), not in the Dagster process, and its folder is the op's output metadata."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.test_e2e_demo import dagster_instance


def run_export_job(home, config: dict):
    """`dagster job execute` of export_model with this op config (a JSON file: YAML reads it)."""
    path = home.parent / "export_config.json"
    path.write_text(json.dumps({"ops": {"export_stage": {"config": config}}}))
    return run_cli(
        ["dagster", "job", "execute", "-m", "ghostvis_pipeline.definitions", "-j", "export_model", "-c", str(path)],
        home,
        check=False,
    )


@pytest.mark.e2e
def test_the_export_job_writes_the_folder_and_names_a_missing_run(home_copy, tmp_path):
    from dagster import DagsterEventType, EventRecordsFilter

    out = tmp_path / "sft-hf"
    proc = run_export_job(home_copy, {"stage": "sft", "to": str(out)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] in (["LlamaForCausalLM"], ["Qwen2ForCausalLM"])
    (event,) = dagster_instance(home_copy).get_event_records(
        EventRecordsFilter(event_type=DagsterEventType.STEP_OUTPUT), limit=1
    )
    md = event.event_log_entry.dagster_event.event_specific_data.metadata
    assert md["path"].value == str(out)
    assert md["files"].value == sorted(p.name for p in out.iterdir())

    proc = run_export_job(home_copy, {"stage": "sft", "run_key": "sft-nosuchrun", "to": str(tmp_path / "x")})
    assert proc.returncode != 0
    assert (
        "export of sft: stage sft has no completed run sft-nosuchrun; materialize the `sft` asset first"
        in proc.stdout + proc.stderr
    )
