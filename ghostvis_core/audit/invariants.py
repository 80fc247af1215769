"""Every stage and data invariant as a plain function of the store, the ledger and (for the figures
that are copies) MLflow and Dagster metadata. The Dagster asset checks and `ghostvis audit` call
these same functions, so a check in the UI and an audit from a terminal cannot disagree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ghostvis_core.counts import MLFLOW_METRICS, TokenCounts
from ghostvis_core.data.catalog import registered_manifests
from ghostvis_core.data.ledger import Ledger, duplicate_shards, file_sha256, train_validation_overlap, validation_selected
from ghostvis_core.data.token_shard import TokenShard
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import LocalStore
from ghostvis_core.train.result import RunResult
from ghostvis_core.train.runs import run_result
from ghostvis_core.train.spec import LaunchSpec
from ghostvis_core.audit.expected import (
    compare_ranges, expected_pieces, expected_tokens, part_row_problems, rows_per_step, share_problems,
)
from ghostvis_core.audit.outcome import CheckOutcome
from ghostvis_core.audit.recount import FileRecount, recount


@dataclass
class StageRun:
    """What the checks of one finished stage run read, loaded once from the store and the ledger."""

    spec: LaunchSpec
    record: RunResult
    chain: list[dict[str, Any]]
    consumption: list[dict[str, Any]]
    parts: list[dict[str, Any]]  # every part row of the run, on the chain or not

    @classmethod
    def load(cls, store: LocalStore, ledger: Ledger, stage: str, run_key: str) -> "StageRun":
        if not store.exists("run_spec", stage, run_key):
            raise GhostvisError(f"stage {stage} run {run_key}: its launch spec is not in the store; "
                                f"re-materialize the `{stage}` asset")
        spec = LaunchSpec.from_dict(store.read_json("run_spec", stage, run_key))
        chain = ledger.chain(run_key)
        return cls(spec, run_result(store, stage, run_key), chain, ledger.consumption([p["part_id"] for p in chain]),
                   ledger.parts([run_key]))


def _compare(scope: str, trainer: TokenCounts, counted: TokenCounts) -> tuple[list[list[Any]], list[str]]:
    rows, failures = [], []
    for k, a, b in zip(TokenCounts.names(), trainer.as_list(), counted.as_list()):
        rows.append([scope, k, a, b, "ok" if a == b else "MISMATCH"])
        if a != b:
            failures.append(f"{scope}: {k} trainer {a:,} != recount {b:,}")
    return rows, failures


def tokens_recounted_from_files(store: LocalStore, run: StageRun) -> CheckOutcome:
    """The four figures recounted from the token files over the consumed ranges equal the trainer's,
    per segment (the ledger's parts) and for the run (ledger chain and run record); no range is read
    twice; every range lies in its file and follows the row rule."""
    started = time.time()
    files = FileRecount(store, run.spec, {r["shard_id"]: r.get("token_sha256")
                                          for r in Ledger.in_store(store).shards(tokenizer_id=run.spec.tokenizer_id)})
    problems = [p for p in (files.range_problem(r) for r in run.consumption) if p]
    problems += files.replaced
    tps = int(run.spec.plan["tokens_per_step"])
    rows, failures = [], list(problems)
    for seg in sorted({p["segment"] for p in run.chain}):
        parts = [p for p in run.chain if p["segment"] == seg]
        ids = {p["part_id"] for p in parts}
        steps = sum(p["step_last"] - p["step_first"] + 1 for p in parts)
        counted, _ = recount(files, [r for r in run.consumption if r["part_id"] in ids], steps * tps)
        r, f = _compare(f"segment {seg} (ledger parts)", TokenCounts.total(TokenCounts.from_mapping(p) for p in parts), counted)
        rows, failures = rows + r, failures + f
    counted, twice = recount(files, run.consumption, run.record.steps * tps)
    for scope, trainer in (("run (ledger chain)", TokenCounts.total(TokenCounts.from_mapping(p) for p in run.chain)),
                           ("run (trainer's run record)", run.record.counts)):
        r, f = _compare(scope, trainer, counted)
        rows, failures = rows + r, failures + f
    overlap = sum(p["overlap_tokens"] for p in run.chain)
    failures += [f"overlap_tokens {overlap:,} in the ledger's parts (must be 0)"] if overlap else []
    failures += [f"{twice:,} tokens read twice across parts (must be 0)"] if twice else []
    return CheckOutcome("tokens_recounted_from_files", not failures, figures={
        **{f"{k}_trainer": v for k, v in run.record.counts.as_dict().items()},
        **{f"{k}_recount": v for k, v in counted.as_dict().items()},
        "overlap_tokens": overlap, "read_twice_tokens": twice, "ranges": len(run.consumption),
        "files_opened": files.opened, "range_problems": len(problems),
        "recount_seconds": round(time.time() - started, 3)},
        tables={"comparison": (["scope", "figure", "trainer", "recount", "status"], rows),
                "range_problems": (["problem"], [[p] for p in problems[:200]])}, failures=failures)


def consumption_matches_plan(store: LocalStore, run: StageRun) -> CheckOutcome:
    """The rows and shard ranges the plan says the run had to read are exactly the recorded ones, the
    parts tile the plan's steps and rows, and the trainer's positions equal steps x tokens_per_step."""
    expected = expected_pieces(store, run.spec)
    ranges = compare_ranges(expected, run.consumption)
    failures = part_row_problems(run.chain, run.spec)
    ids = [p["part_id"] for p in run.parts]
    failures += [f"part {i} is recorded {ids.count(i)} times in the ledger" for i in sorted(set(ids)) if ids.count(i) > 1]
    failures += [f"{kind} {shard} epoch {epoch} tokens {span} ({n:,} tokens)" for kind, shard, epoch, span, n in ranges[:50]]
    plan = run.spec.plan
    tps, steps, planned = int(plan["tokens_per_step"]), int(plan["steps"]), int(plan["planned_tokens"])
    consumed = run.record.counts.consumed
    if consumed != steps * tps:
        failures.append(f"consumed positions (real + pad) {consumed:,} != steps x tokens_per_step {steps * tps:,}")
    if not 0 <= steps * tps - planned < tps:
        failures.append(f"steps x tokens_per_step {steps * tps:,} is not within one step of planned {planned:,}")
    totals = {kind: sum(r[4] for r in ranges if r[0] == kind) for kind in ("gap", "read twice", "unexpected")}
    return CheckOutcome("consumption_matches_plan", not failures, figures={
        "planned_tokens": planned, "steps_planned": steps, "steps_trained": run.record.steps,
        "steps_x_tokens_per_step": steps * tps, "consumed_positions": consumed,
        "rows_planned": steps * rows_per_step(run.spec),
        "rows_recorded": run.chain[-1]["rows_last"] if run.chain else 0,
        "expected_shard_tokens": expected_tokens(expected),
        **{f"{k.replace(' ', '_')}_tokens": v for k, v in totals.items()}},
        tables={"ranges": (["kind", "shard", "epoch", "tokens_range", "tokens"], ranges[:200])}, failures=failures)


def no_validation_selected(ledger: Ledger, run: StageRun) -> CheckOutcome:
    """The run's selected train shards (its spec) hold no shard the ledger calls validation."""
    found = validation_selected(ledger, run.spec.tokenizer_id, run.spec.train_shards)
    rows = [[r["source"], r["shard_id"], r["split"], r["spec_split"]] for r in found]
    return CheckOutcome("no_validation_selected", not found, figures={
        "selected_train_shards": sum(len(v) for v in run.spec.train_shards.values()), "not_train": len(found)},
        tables={"offenders": (["source", "shard", "ledger split", "spec split"], rows)},
        failures=[f"{r['shard_id']} selected for training is {r['split']}" for r in found])


def every_rank_read_its_rows(ledger: Ledger, run: StageRun) -> CheckOutcome:
    """Each part keeps every rank's share: exactly the rows the loader gives that rank in those steps,
    and the shares' figures sum to the part's."""
    shares = ledger.shares([p["part_id"] for p in run.chain])
    per_step = rows_per_step(run.spec)
    rows = []
    for part in run.chain:
        rows += share_problems(part, [s for s in shares if s["part_id"] == part["part_id"]], per_step)
    return CheckOutcome("every_rank_read_its_rows", not rows and bool(run.chain), figures={
        "parts": len(run.chain), "shares": len(shares), "problems": len(rows)},
        tables={"problems": (["part", "rank", "expected rows", "recorded rows", "problem"], rows[:200])},
        failures=[f"part {r[0]} rank {r[1]}: {r[4]} (expected {r[2]}, recorded {r[3]})" for r in rows]
        or ([] if run.chain else ["the run has no part in the ledger"]))


def figures_agree(ledger: Ledger, run: StageRun, mlflow: dict[str, float], metadata: dict[str, Any] | None) -> CheckOutcome:
    """real/pad/loss/cropped: ledger == MLflow == run record (== Dagster metadata when there is one), exactly."""
    totals = ledger.run_counts(run.spec.run_key).as_dict()
    rows, failures = [], []
    for k in TokenCounts.names():
        sides = {"ledger": totals[k], "mlflow": mlflow.get(MLFLOW_METRICS[k]),
                 "run_record": getattr(run.record.counts, k)}
        if metadata is not None:
            sides["metadata"] = metadata.get(k)
        vals = [None if v is None else int(v) for v in sides.values()]
        ok = vals[0] is not None and all(v == vals[0] for v in vals)
        rows.append([k, *vals, "ok" if ok else "MISMATCH"])
        if not ok:
            failures.append(f"{k}: " + ", ".join(f"{n} {v}" for n, v in zip(sides, vals)))
    header = ["figure", "ledger", "mlflow", "run_record"] + (["metadata"] if metadata is not None else []) + ["status"]
    return CheckOutcome("ledger_mlflow_metadata_agree", not failures,
                        figures={"segments": str(sorted({p["segment"] for p in run.chain}))},
                        tables={"comparison": (header, rows)}, failures=failures)


def tokens_match_plan(figures: dict[str, Any]) -> CheckOutcome:
    """Consumed positions == steps x tokens_per_step, within one step of planned_tokens (`figures`: the
    run's tokens_per_step, steps, planned_tokens and four figures, from metadata or the run record)."""
    tps, steps, planned = figures["tokens_per_step"], figures["steps"], figures["planned_tokens"]
    consumed, step_tokens = TokenCounts.from_mapping(figures).consumed, steps * tps
    failures = ([f"consumed {consumed:,} != steps x tokens_per_step {step_tokens:,}"] if consumed != step_tokens else [])
    failures += ([] if 0 <= step_tokens - planned < tps else
                 [f"steps x tokens_per_step {step_tokens:,} not within one step of planned {planned:,}"])
    return CheckOutcome("tokens_match_plan", not failures, figures={
        "planned_tokens": planned, "consumed_tokens": consumed, "steps_x_tokens_per_step": step_tokens,
        "tolerance_tokens": tps, "difference": step_tokens - planned}, failures=failures)


def no_reuse(ledger: Ledger, run_key: str) -> CheckOutcome:
    """No token range consumed twice in the stage's lineage unless declared (replay, allowed repeat)."""
    found = ledger.reuse(run_key)
    bad = [r for r in found if r["kind"] in ("reuse", "undeclared_repeat", "undeclared_cross_stage")]
    rows = [[r["kind"], r["shard_id"], f"{r['tok_start']}..{r['tok_end']}", f"{r['row_start']}..{r['row_end']}",
             r["tokens"], r["run_a"], r["run_b"]] for r in found[:200]]
    return CheckOutcome("no_reuse", not bad, figures={
        "reused_tokens": sum(r["tokens"] for r in bad),
        "declared_replay_or_repeat_tokens": sum(r["tokens"] for r in found if r not in bad)},
        tables={"ranges": (["kind", "shard", "tokens_range", "rows", "tokens", "run_a", "run_b"], rows)},
        failures=[f"{r['kind']} {r['shard_id']} tokens {r['tok_start']}..{r['tok_end']}" for r in bad[:50]])


def no_validation_leakage(ledger: Ledger, run_key: str) -> CheckOutcome:
    """No validation shard consumed in training along the run's chain."""
    leaked = ledger.leakage(run_key)
    return CheckOutcome("no_validation_leakage", not leaked, figures={
        "leaked_tokens": sum(r["tokens"] for r in leaked),
        "leaked_shards": ", ".join(r["shard_id"] for r in leaked) or "none"},
        failures=[f"validation shard {r['shard_id']} consumed ({r['tokens']:,} tokens)" for r in leaked])


def ledger_matches_token_files(store: LocalStore, ledger: Ledger, tokenizer_id: str) -> CheckOutcome:
    """Every ledger shard record's docs and tokens equal a recount of its token file."""
    mismatches, total = [], 0
    for r in ledger.shards(tokenizer_id=tokenizer_id):
        try:
            shard = TokenShard.open(store.fetch("token_shard", tokenizer_id, r["shard_id"]), r["shard_id"])
            docs, tokens = len(shard.rows), shard.num_tokens
        except GhostvisError as exc:
            mismatches.append([r["shard_id"], r["docs"], -1, r["tokens"], -1, str(exc)])
            continue
        total += tokens
        same = not r.get("token_sha256") or file_sha256(shard.path) == r["token_sha256"]
        if (docs, tokens, same) != (r["docs"], r["tokens"], True):
            mismatches.append([r["shard_id"], r["docs"], docs, r["tokens"], tokens, "ok" if same else "other content"])
    return CheckOutcome("ledger_matches_token_files", not mismatches, figures={
        "recounted_tokens": total, "mismatched_shards": len(mismatches)},
        tables={"mismatches": (["shard", "ledger_docs", "file_docs", "ledger_tokens", "file_tokens", "sha256"], mismatches)},
        failures=[f"shard {m[0]}: ledger {m[1]} docs / {m[3]} tokens, file {m[2]} / {m[4]}, sha256 {m[5]}"
                  for m in mismatches])


def all_manifest_shards_tokenized(store: LocalStore, ledger: Ledger, tokenizer_id: str) -> CheckOutcome:
    """Every shard of every registered manifest is tokenized with the tokenizer."""
    have = {r["shard_id"] for r in ledger.shards(tokenizer_id=tokenizer_id)}
    want = [m.shard_id(e) for m in registered_manifests(store).values() for e in m.shards]
    missing = [s for s in want if s not in have]
    return CheckOutcome("all_manifest_shards_tokenized", not missing, figures={
        "manifest_shards": len(want), "tokenized_shards": len(want) - len(missing),
        "missing": ", ".join(missing[:50]) or "none"}, failures=[f"shard {s} not tokenized" for s in missing[:50]])


def no_duplicate_content(ledger: Ledger, tokenizer_id: str) -> CheckOutcome:
    """No two shards with the same content, and no document in both a train and a validation shard."""
    dups = duplicate_shards(ledger, tokenizer_id)
    overlap = train_validation_overlap(ledger, ledger.shards(tokenizer_id=tokenizer_id))
    return CheckOutcome("no_duplicate_content", not dups and not overlap, figures={
        "duplicate_shards": len(dups), "docs_in_train_and_validation": len(overlap)},
        tables={"duplicates": (["content_sha256", "shards"], [[d["content_sha256"][:16], ", ".join(d["shards"])] for d in dups]),
                "leaked_docs": (["validation shard", "row", "train shard", "row"],
                                [[o["validation_shard"], o["validation_row"], o["train_shard"], o["train_row"]]
                                 for o in overlap[:100]])},
        failures=[f"same content: {', '.join(d['shards'])}" for d in dups]
        + [f"document in {o['validation_shard']} row {o['validation_row']} and {o['train_shard']} row {o['train_row']}"
           for o in overlap[:50]])
