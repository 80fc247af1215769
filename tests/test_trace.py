"""`ghostvis trace` on the session's demo home: a document trained in pretrain and replayed in reasoning_mix
shows exactly the steps, ranks and rows that fed it (written here from the smoke preset's plan), a validation
document shows none while its training twin shows them, and a step's documents are exactly its rows. No run is
launched: the demo's runs are read."""

from __future__ import annotations

import json

import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.plan.batch import BatchPlan
from ghostvis_core.runs.lookup import completed_runs
from ghostvis_core.verify.audit.row_index import place
from ghostvis_core.verify.trace import find_text, shard_row, trace_document, trace_step
from tests.conftest import run_cli


def test_a_global_row_is_placed_by_the_row_rule():
    plan = BatchPlan(micro_batch_size=2, seq_len=8, world_size=3, grad_accum_steps=2)  # 12 rows a step
    assert place(0, plan) == {"step": 1, "rank": 0, "micro_batch": 0}
    assert place(12 + 7, plan) == {"step": 2, "rank": 0, "micro_batch": 1}  # micro 1 starts at row 6
    assert place(12 + 5, plan) == {"step": 2, "rank": 2, "micro_batch": 0}
    assert shard_row("demo_prose/00000:12") == ("demo_prose/00000", 12)
    with pytest.raises(GhostvisError, match="give <shard>:<row>"):
        shard_row("demo_prose/00000")


def replayed_document(ledger: Ledger) -> tuple[str, int]:
    """(shard, raw row) of a document that both pretrain and reasoning_mix consumed."""
    rows = {stage: ledger.consumption(ledger.parts(stage=stage)) for stage in ("pretrain", "reasoning_mix")}
    for c in rows["reasoning_mix"]:
        for p in rows["pretrain"]:
            if p.shard_id == c.shard_id and max(p.row_start, c.row_start) < min(p.row_end, c.row_end):
                return c.shard_id, max(p.row_start, c.row_start)
    raise AssertionError("no document of pretrain is replayed in reasoning_mix")


# The demo's lineage, each stage's one run in the session's demo home (the smoke preset).
LINEAGE = {
    "pretrain",
    "continued_pretrain",
    "context_expansion",
    "reasoning_mix",
    "vision_alignment",
    "sft",
    "dpo",
    "rl",
}
# The first document of the demo's first prose shard, where the smoke preset's runs fed it: (stage, step, rank,
# micro-batch, global row). pretrain's first row is the first document of its first prose shard; reasoning_mix
# replays it (its replay share reads pretrain's documents again) in its second row.
FIRST_PROSE_DOC = ("demo_prose/00000", 0)
FIRST_PROSE_DOC_HITS = {("pretrain", 1, 0, 0, 0), ("reasoning_mix", 1, 0, 0, 1)}
# Step 3 of the smoke pretrain: 8 rows a step (2 ranks x 4 rows x 1 micro-batch), so global rows 16-23, rank 0
# the first four (the row rule).
PRETRAIN_STEP_3 = {(0, 16), (0, 17), (0, 18), (0, 19), (1, 20), (1, 21), (1, 22), (1, 23)}


def stage_runs(home: Home, stages: set[str]) -> set[tuple[str, str]]:
    """(stage, run key) of each stage's one completed run in the demo home."""
    runs = {(s, r.run_key) for s in stages for r in completed_runs(home.store, s)}
    assert {s for s, _ in runs} == stages and len(runs) == len(stages), runs
    return runs


def hits(report: dict) -> set[tuple]:
    return {(h["stage"], h["step"], h["rank"], h["micro_batch"], h["global_row"]) for h in report["trained_by"]}


def test_a_document_trained_in_pretrain_and_replayed_in_reasoning_mix_shows_exactly_where(demo_home):
    home = Home(demo_home)
    ledger = Ledger.in_store(home.store)
    report = trace_document(home.store, ledger, *FIRST_PROSE_DOC)
    assert hits(report) == FIRST_PROSE_DOC_HITS
    assert {(h["stage"], h["run_key"]) for h in report["trained_by"]} == stage_runs(home, {"pretrain", "reasoning_mix"})
    for h in report["trained_by"]:  # each hit is a row of that step on that rank, by the ledger's feeds
        fed = [f for f in ledger.feeds(ledger.chain(h["run_key"])) if (f.step, f.rank) == (h["step"], h["rank"])]
        assert h["global_row"] in fed[0].micro_rows[h["micro_batch"]]
    downstream = {(r["stage"], r["run_key"]) for r in report["downstream_runs"]}
    assert downstream == stage_runs(home, LINEAGE) and report["registered_models"] is None
    assert report["document"]["text"]


def test_a_validation_document_was_trained_by_nothing_and_its_training_twin_was(demo_home):
    """The first document of the prose validation shard and of the first prose training shard: the same question
    of the same ledger, answered empty for the one and with every hit for the other."""
    home = Home(demo_home)
    ledger = Ledger.in_store(home.store)
    report = trace_document(home.store, ledger, "demo_prose/val_00000", 0)
    assert report["trained_by"] == [] and report["downstream_runs"] == [] and report["document"]["text"]
    twin = trace_document(home.store, ledger, *FIRST_PROSE_DOC)
    assert hits(twin) == FIRST_PROSE_DOC_HITS and len(twin["downstream_runs"]) == len(LINEAGE)


def test_a_step_lists_the_rows_each_rank_fed_with_their_documents(demo_home):
    home = Home(demo_home)
    ledger = Ledger.in_store(home.store)
    report = trace_step(home.store, ledger, "pretrain", 3)
    assert {("pretrain", report["run_key"])} == stage_runs(home, {"pretrain"})
    assert {(x["rank"], x["global_row"]) for x in report["fed"]} == PRETRAIN_STEP_3
    feeds = [f for f in ledger.feeds(ledger.chain(report["run_key"])) if f.step == 3]
    assert {(f.rank, g) for f in feeds for rows in f.micro_rows for g in rows} == PRETRAIN_STEP_3
    assert all(x["text"] and x["raw_rows"][0] < x["raw_rows"][1] for x in report["fed"])
    with pytest.raises(GhostvisError, match="recorded no step 100000"):
        trace_step(home.store, ledger, "pretrain", 100000)


def test_ghostvis_trace_prints_both_answers_and_json(demo_home):
    shard_id, row = replayed_document(Ledger.in_store(Home(demo_home).store))
    doc = json.loads(run_cli(["ghostvis", "trace", "--doc", f"{shard_id}:{row}", "--json"], demo_home).stdout)
    assert {h["stage"] for h in doc["trained_by"]} == {"pretrain", "reasoning_mix"}
    assert any(m["stage"] == "sft" for m in doc["registered_models"])  # the demo registers every stage's model
    step = run_cli(["ghostvis", "trace", "--stage", "pretrain", "--step", "2"], demo_home).stdout
    assert step.splitlines()[0].startswith("pretrain run pretrain-") and "demo_" in step


def test_a_passage_is_found_through_the_ledgers_fingerprints(demo_home):
    """40 words of a pretrain document name it (its fingerprints are the most shared); 12 words cannot."""
    import pyarrow.parquet as pq

    home = Home(demo_home)
    ledger = Ledger.in_store(home.store)
    shard_id, row = replayed_document(ledger)
    text = pq.read_table(home.store.fetch("raw_shard", shard_id), columns=["text"]).column(0)[row].as_py()
    passage = " ".join(text.split()[:40])
    found = find_text(home.store, ledger, passage)
    assert (shard_id, row) in {(d["shard_id"], d["row"]) for d in found}
    assert all(d["shared"] == d["of"] > 0 for d in found)
    with pytest.raises(GhostvisError, match="12 words have no 13-gram fingerprint"):
        find_text(home.store, ledger, " ".join(f"w{i}" for i in range(12)))


def test_the_trace_job_gives_the_same_answer_in_dagster(demo_home):
    from ghostvis_pipeline.launchpad.trace import trace
    from ghostvis_pipeline.resources import GhostvisHome

    home = Home(demo_home)
    resources = {"home": GhostvisHome(root=str(demo_home))}
    config = {"ops": {"trace_ledger": {"config": {"stage": "pretrain", "step": 3}}}}
    result = trace.execute_in_process(run_config=config, resources=resources)
    assert result.success
    assert result.output_for_node("trace_ledger") == trace_step(home.store, Ledger.in_store(home.store), "pretrain", 3)
    empty = trace.execute_in_process(
        run_config={"ops": {"trace_ledger": {"config": {}}}}, resources=resources, raise_on_error=False
    )
    assert not empty.success
    (failure,) = [e for e in empty.all_events if e.is_step_failure]
    assert "give doc (<shard>:<row>), text, or stage and step" in failure.step_failure_data.error.message


def test_the_content_proof_wrote_each_runs_row_index_and_a_trace_writes_a_missing_one(demo_home, tmp_path):
    """The demo's stage checks wrote the row index of every stage's run (what trace reads); a ledger
    without it (a run traced before its checks ran) gets it written by the trace, with the same answer."""
    import shutil

    home = Home(demo_home)
    ledger = Ledger.in_store(home.store)
    heads = [h for h in ledger.run_heads() if h.stage in ("pretrain", "vision_alignment", "rl")]
    assert {h.stage for h in heads} == {"pretrain", "vision_alignment", "rl"}
    assert all(ledger.row_index_file(h.head).is_file() for h in heads if "@" not in h.run_key)
    want = trace_step(home.store, ledger, "vision_alignment", 2)
    bare = Ledger(shutil.copytree(ledger.root, tmp_path / "ledger", ignore=shutil.ignore_patterns("row_index")))
    head = next(h.head for h in bare.run_heads() if h.run_key == want["run_key"])
    assert not bare.row_index_file(head).is_file()
    assert trace_step(home.store, bare, "vision_alignment", 2) == want
    assert bare.row_index_file(head).is_file()


def test_the_report_card_links_each_step_range_to_the_documents_it_fed(demo_home):
    """The report card's "Step ranges" table gives, per stage and segment, a `ghostvis trace` command that
    lists what a step of the range fed, and the Dagster trace job's config for the same answer."""
    (card,) = (demo_home / "store" / "reports").glob("*/report.md")
    section = card.read_text().split("## Step ranges: the documents a step fed")[1].split("\n## ")[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| pretrain |")]
    assert rows and rows[0][2] == "1-" + rows[0][2].split("-")[1]
    command = rows[0][3]
    assert command.startswith("ghostvis trace --stage pretrain --run-key pretrain-") and command.endswith("--step 1")
    out = run_cli(command.split() + ["--json"], demo_home).stdout
    assert json.loads(out)["fed"]
    assert json.loads(rows[0][4].split("config ", 1)[1].rstrip(" |")) == {
        "stage": "pretrain",
        "step": 1,
        "run_key": command.split("--run-key ")[1].split()[0],
    }
