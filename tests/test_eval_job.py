"""The evaluation job's spec: written once by the asset, read by `python -m ghostvis_core.verify.eval`."""

from __future__ import annotations

from ghostvis_core.store import open_store
from ghostvis_core.verify.eval.__main__ import read_spec
from ghostvis_core.verify.eval.eval_spec import EvalSpec, eval_job


def test_the_spec_keeps_the_lineage_and_sources_in_order_through_the_store(tmp_path):
    """The store writes a JSON object's keys sorted; the scores are in the lineage's order (the asset's table, the
    results file) and each stage's bpb in the sources' order, as when the asset scored in process."""
    store = open_store(str(tmp_path / "store"))
    lineage = {"pretrain": "pretrain-1-r1", "sft": "sft-2-r1", "dpo": "dpo-3-r1"}
    held_out = {"web": [{"shard_id": "web/00003", "content_sha256": "ab"}], "code": []}
    spec = EvalSpec("ev1d", store.uri, "sqlite:///m.db", "tok", lineage, held_out, ["ghostvis_capitals"], [])
    job = eval_job(spec)
    store.write_json("run_spec", job.stage, job.run_key, data=spec.to_dict())
    back = read_spec(store.uri_of("run_spec", "evaluation", "ev1d"))
    assert back == spec
    assert list(back.lineage) == ["pretrain", "sft", "dpo"] and list(back.held_out) == ["web", "code"]
    assert (job.module, job.ranks, job.done) == ("ghostvis_core.verify.eval", 1, ("report", "evaluation/ev1d.json"))
