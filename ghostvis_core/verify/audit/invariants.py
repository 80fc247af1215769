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
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.query import UNDECLARED_KINDS, Reuse
from ghostvis_core.data.ledger.records import ConsumptionRow, PartRow
from ghostvis_core.data.ledger.summaries import duplicate_shards, train_validation_overlap, validation_selected
from ghostvis_core.errors import GhostvisError
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.lookup import run_result
from ghostvis_core.runs.run_result import RunResult
from ghostvis_core.store import Store
from ghostvis_core.store.files import sha256_file
from ghostvis_core.verify.audit.check_outcome import CheckOutcome
from ghostvis_core.verify.audit.expected import (
    compare_ranges,
    expected_pieces,
    expected_tokens,
    part_row_problems,
    rows_per_step,
    share_problems,
)
from ghostvis_core.verify.audit.recount import FileRecount, recount
from ghostvis_core.verify.audit.token_files import TokenFile


@dataclass
class StageRun:
    """What the checks of one finished stage run read, loaded once from the store and the ledger."""

    spec: LaunchSpec
    record: RunResult
    chain: list[PartRow]
    consumption: list[ConsumptionRow]
    parts: list[PartRow]  # every part row of the run, on the chain or not

    @classmethod
    def load(cls, store: Store, ledger: Ledger, stage: str, run_key: str) -> StageRun:
        if not store.exists("run_spec", stage, run_key):
            raise GhostvisError(
                f"stage {stage} run {run_key}: its launch spec is not in the store; re-materialize the `{stage}` asset"
            )
        spec = LaunchSpec.read(store, stage, run_key)
        chain = ledger.chain(run_key)
        return cls(spec, run_result(store, stage, run_key), chain, ledger.consumption(chain), ledger.parts([run_key]))


def _compare(scope: str, trainer: TokenCounts, counted: TokenCounts) -> tuple[list[list[Any]], list[str]]:
    rows, failures = [], []
    for k, a, b in zip(TokenCounts.names(), trainer.as_list(), counted.as_list()):
        rows.append([scope, k, a, b, "ok" if a == b else "MISMATCH"])
        if a != b:
            failures.append(f"{scope}: {k} trainer {a:,} != recount {b:,}")
    return rows, failures


def tokens_recounted_from_files(store: Store, run: StageRun) -> CheckOutcome:
    """The four figures recounted from the token files over the consumed ranges equal the trainer's,
    per segment (the ledger's parts) and for the run (ledger chain and run record); no range is read
    twice; every range lies in its file and follows the row rule."""
    started = time.time()
    files = FileRecount(
        store,
        run.spec,
        {
            (r.shard_id, r.content_sha256): r.token_sha256
            for r in Ledger.in_store(store).shards(tokenizer_id=run.spec.tokenizer_id, every_version=True)
        },
    )
    problems = [p for p in (files.range_problem(r) for r in run.consumption) if p]
    problems += files.replaced
    tps = run.spec.plan.batch.tokens_per_step
    rows, failures = [], list(problems)
    for seg in sorted({p.segment for p in run.chain}):
        parts = [p for p in run.chain if p.segment == seg]
        ids = {p.part_id for p in parts}
        steps = sum(p.step_last - p.step_first + 1 for p in parts)
        counted, _ = recount(files, [r for r in run.consumption if r.part_id in ids], steps * tps)
        r, f = _compare(f"segment {seg} (ledger parts)", TokenCounts.total(p.counts for p in parts), counted)
        rows, failures = rows + r, failures + f
    counted, twice = recount(files, run.consumption, run.record.steps * tps)
    for scope, trainer in (
        ("run (ledger chain)", TokenCounts.total(p.counts for p in run.chain)),
        ("run (trainer's run record)", run.record.counts),
    ):
        r, f = _compare(scope, trainer, counted)
        rows, failures = rows + r, failures + f
    overlap = sum(p.overlap_tokens for p in run.chain)
    failures += [f"overlap_tokens {overlap:,} in the ledger's parts (must be 0)"] if overlap else []
    failures += [f"{twice:,} tokens read twice across parts (must be 0)"] if twice else []
    return CheckOutcome(
        "tokens_recounted_from_files",
        not failures,
        figures={
            **{f"{k}_trainer": v for k, v in run.record.counts.as_dict().items()},
            **{f"{k}_recount": v for k, v in counted.as_dict().items()},
            "overlap_tokens": overlap,
            "read_twice_tokens": twice,
            "ranges": len(run.consumption),
            "files_opened": files.opened,
            "range_problems": len(problems),
            "recount_seconds": round(time.time() - started, 3),
        },
        tables={
            "comparison": (["scope", "figure", "trainer", "recount", "status"], rows),
            "range_problems": (["problem"], [[p] for p in problems[:200]]),
        },
        failures=failures,
    )


def consumption_matches_plan(store: Store, run: StageRun) -> CheckOutcome:
    """The rows and shard ranges the plan says the run had to read are exactly the recorded ones, the
    parts tile the plan's steps and rows, and the trainer's positions equal steps x tokens_per_step."""
    expected = expected_pieces(store, run.spec)
    ranges = compare_ranges(expected, run.consumption)
    failures = part_row_problems(run.chain, run.spec)
    ids = [p.part_id for p in run.parts]
    failures += [
        f"part {i} is recorded {ids.count(i)} times in the ledger" for i in sorted(set(ids)) if ids.count(i) > 1
    ]
    failures += [
        f"{kind} {shard} epoch {epoch} tokens {span} ({n:,} tokens): {range_readers(run, shard, epoch, span)}"
        for kind, shard, epoch, span, n in ranges[:50]
    ]
    plan = run.spec.plan
    tps, steps, planned = plan.batch.tokens_per_step, plan.steps, plan.planned_tokens
    consumed = run.record.counts.consumed
    if consumed != steps * tps:
        failures.append(f"consumed positions (real + pad) {consumed:,} != steps x tokens_per_step {steps * tps:,}")
    if not 0 <= steps * tps - planned < tps:
        failures.append(f"steps x tokens_per_step {steps * tps:,} is not within one step of planned {planned:,}")
    totals = {kind: sum(r[4] for r in ranges if r[0] == kind) for kind in ("gap", "read twice", "unexpected")}
    return CheckOutcome(
        "consumption_matches_plan",
        not failures,
        figures={
            "planned_tokens": planned,
            "steps_planned": steps,
            "steps_trained": run.record.steps,
            "steps_x_tokens_per_step": steps * tps,
            "consumed_positions": consumed,
            "rows_planned": steps * rows_per_step(run.spec),
            "rows_recorded": run.chain[-1].rows_last if run.chain else 0,
            "expected_shard_tokens": expected_tokens(expected),
            "consumed_shard_tokens": sum(int(r.tok_end) - int(r.tok_start) for r in run.consumption),
            **{f"{k.replace(' ', '_')}_tokens": v for k, v in totals.items()},
        },
        tables={"ranges": (["kind", "shard", "epoch", "tokens_range", "tokens"], ranges[:200])},
        failures=failures,
    )


def range_readers(run: StageRun, shard: str, epoch: int, span: str) -> str:
    """Which recorded parts of the run read tokens `span` ("a..b") of (shard, epoch), with their
    segments and steps (from the ledger's parts table): a range's message names who read it."""
    a, b = (int(x) for x in span.split(".."))
    ids = sorted(
        {
            r.part_id
            for r in run.consumption
            if r.shard_id == shard and int(r.epoch) == epoch and r.tok_start < b and a < r.tok_end
        }
    )
    parts = {p.part_id: p for p in run.parts}
    named = [
        _part_text(i, None, parts[i].segment, f"{parts[i].step_first}..{parts[i].step_last}") for i in ids if i in parts
    ]
    return "read by " + " and ".join(named) if named else "read by no part of the run's chain"


def no_validation_selected(ledger: Ledger, run: StageRun) -> CheckOutcome:
    """The run's selected train shards (its spec) are all train in the ledger's shard table; the split
    label the spec carries is shown, never trusted."""
    found = validation_selected(ledger, run.spec.tokenizer_id, run.spec.train_shards)
    rows = [[r.source, r.shard_id, r.split, r.spec_split] for r in found]
    return CheckOutcome(
        "no_validation_selected",
        not found,
        figures={"selected_train_shards": sum(len(v) for v in run.spec.train_shards.values()), "not_train": len(found)},
        tables={"offenders": (["source", "shard", "ledger split", "spec split"], rows)},
        failures=[f"{r.shard_id} selected for training is {r.split}" for r in found],
    )


def every_rank_read_its_rows(ledger: Ledger, run: StageRun) -> CheckOutcome:
    """Each part keeps every rank's share: exactly the rows the loader gives that rank in those steps,
    and the shares' figures sum to the part's."""
    shares = ledger.shares(run.chain)
    per_step = rows_per_step(run.spec)
    rows = []
    for part in run.chain:
        rows += share_problems(part, [s for s in shares if s.part_id == part.part_id], per_step)
    return CheckOutcome(
        "every_rank_read_its_rows",
        not rows and bool(run.chain),
        figures={
            "parts": len(run.chain),
            "shares": len(shares),
            "problems": len(rows),
            "rows_expected": sum((p.step_last - p.step_first + 1) * per_step for p in run.chain),
            "rows_recorded": sum(b - a for s in shares for a, b in s.row_ranges),
        },
        tables={"problems": (["part", "rank", "expected rows", "recorded rows", "problem"], rows[:200])},
        failures=[f"part {r[0]} rank {r[1]}: {r[4]} (expected {r[2]}, recorded {r[3]})" for r in rows]
        or ([] if run.chain else ["the run has no part in the ledger"]),
    )


def figures_agree(
    ledger: Ledger, run: StageRun, mlflow: dict[str, float], metadata: dict[str, Any] | None
) -> CheckOutcome:
    """real/pad/loss/cropped: ledger == MLflow == run record (== Dagster metadata when there is one), exactly."""
    totals = ledger.run_counts(run.spec.run_key).as_dict()
    rows, failures = [], []
    for k in TokenCounts.names():
        sides = {
            "ledger": totals[k],
            "mlflow": mlflow.get(MLFLOW_METRICS[k]),
            "run_record": getattr(run.record.counts, k),
        }
        if metadata is not None:
            sides["metadata"] = metadata.get(k)
        vals = [None if v is None else int(v) for v in sides.values()]
        ok = vals[0] is not None and all(v == vals[0] for v in vals)
        rows.append([k, *vals, "ok" if ok else "MISMATCH"])
        if not ok:
            failures.append(f"{k}: " + ", ".join(f"{n} {v}" for n, v in zip(sides, vals)))
    header = ["figure", "ledger", "mlflow", "run_record"] + (["metadata"] if metadata is not None else []) + ["status"]
    return CheckOutcome(
        "ledger_mlflow_metadata_agree",
        not failures,
        figures={"segments": str(sorted({p.segment for p in run.chain}))},
        tables={"comparison": (header, rows)},
        failures=failures,
    )


def _points_by_step(history: dict[str, list[tuple[int, float]]]) -> dict[int, dict[str, set[int]]]:
    """step -> figure -> the values MLflow holds for it (a resumed segment re-logs its steps: one value)."""
    out: dict[int, dict[str, set[int]]] = {}
    for k, metric in MLFLOW_METRICS.items():
        for step, value in history.get(metric, []):
            out.setdefault(step, {}).setdefault(k, set()).add(int(value))
    return out


def _history_problems(by_step: dict[int, dict[str, set[int]]], tokens_per_step: int) -> list[str]:
    """At each logged step: each figure logged once, none below its previous point, and real + pad ==
    step x tokens_per_step."""
    out, last = [], {}
    for step in sorted(by_step):
        values = by_step[step]
        for k in TokenCounts.names():
            got = sorted(values.get(k, ()))
            if len(got) != 1:
                out.append(f"step {step}: {k} has {len(got)} values in MLflow ({', '.join(map(str, got)) or 'none'})")
                continue
            if k in last and got[0] < last[k][1]:
                out.append(f"step {step}: {k} mlflow {got[0]:,} falls below {last[k][1]:,} at step {last[k][0]}")
            last[k] = (step, got[0])
        if all(len(values.get(k, ())) == 1 for k in ("real_tokens", "pad_tokens")):
            consumed = min(values["real_tokens"]) + min(values["pad_tokens"])
            if consumed != step * tokens_per_step:
                out.append(
                    f"step {step}: real + pad mlflow {consumed:,} != step x tokens_per_step {step * tokens_per_step:,}"
                )
    return out


def mlflow_token_history(
    chain: list[PartRow], tokens_per_step: int, history: dict[str, list[tuple[int, float]]]
) -> CheckOutcome:
    """Every logged point of the four token metrics, not only the newest (a chart reading 512, 512, 512,
    2048 with its last point right is wrong): per step see `_history_problems`; and at each committed
    step (a part's step_last along the chain) each figure equals the ledger's cumulative figure up to
    that part (the trainer logs the token metrics at every checkpoint step)."""
    by_step = _points_by_step(history)
    failures, rows, cumulative = _history_problems(by_step, tokens_per_step), [], TokenCounts()
    for part in chain:
        cumulative = cumulative + part.counts
        step = part.step_last
        for k, want in cumulative.as_dict().items():
            got = sorted(by_step.get(step, {}).get(k, ()))
            rows.append(
                [
                    step,
                    part.part_id,
                    part.segment,
                    k,
                    ", ".join(map(str, got)) or "none",
                    want,
                    "ok" if got == [want] else "MISMATCH",
                ]
            )
            if got != [want]:
                failures.append(
                    f"step {step} (end of part {part.part_id}, segment {part.segment}): {k} "
                    f"mlflow {', '.join(f'{v:,}' for v in got) or 'not logged'} != ledger {want:,}"
                )
    return CheckOutcome(
        "mlflow_token_history",
        not failures and bool(chain),
        figures={
            "logged_steps": len(by_step),
            "committed_steps": len(chain),
            "tokens_per_step": tokens_per_step,
            "problems": len(failures),
        },
        tables={"committed_steps": (["step", "part", "segment", "figure", "mlflow", "ledger", "status"], rows)},
        failures=failures[:100] or ([] if chain else ["the run has no part in the ledger"]),
    )


def tokens_match_plan(figures: dict[str, Any]) -> CheckOutcome:
    """Consumed positions == steps x tokens_per_step, within one step of planned_tokens (`figures`: the
    run's tokens_per_step, steps, planned_tokens and four figures, from metadata or the run record)."""
    tps, steps, planned = figures["tokens_per_step"], figures["steps"], figures["planned_tokens"]
    consumed, step_tokens = TokenCounts.from_mapping(figures).consumed, steps * tps
    failures = [f"consumed {consumed:,} != steps x tokens_per_step {step_tokens:,}"] if consumed != step_tokens else []
    failures += (
        []
        if 0 <= step_tokens - planned < tps
        else [f"steps x tokens_per_step {step_tokens:,} not within one step of planned {planned:,}"]
    )
    return CheckOutcome(
        "tokens_match_plan",
        not failures,
        figures={
            "planned_tokens": planned,
            "consumed_tokens": consumed,
            "steps_x_tokens_per_step": step_tokens,
            "tolerance_tokens": tps,
            "difference": step_tokens - planned,
        },
        failures=failures,
    )


def _part_text(part_id: str, run: str | None, segment: int, steps: str) -> str:
    return f"part {part_id} ({'run ' + run + ', ' if run else ''}segment {segment}, steps {steps})"


REUSE_HEADER = [
    "kind",
    "shard",
    "tokens_range",
    "rows",
    "tokens",
    "run_a",
    "part_a",
    "segment_a",
    "steps_a",
    "run_b",
    "part_b",
    "segment_b",
    "steps_b",
    "passed_over",
]


def _reuse_row(r: Reuse) -> list:
    """One range read twice, as a row of REUSE_HEADER."""
    ranges = [f"{r.tok_start}..{r.tok_end}", f"{r.row_start}..{r.row_end}"]
    sides = [getattr(r, f"{field}_{side}") for side in "ab" for field in ("run", "part", "segment", "steps")]
    fallback = f"{r.checkpoint}: {r.reason}" if r.checkpoint else ""
    return [r.kind, r.shard_id, *ranges, r.tokens, *sides, fallback]


def no_reuse(ledger: Ledger, run_key: str) -> CheckOutcome:
    """No token range consumed twice in the stage's lineage unless declared (replay, allowed repeat, steps
    trained again after a resume passed over a damaged checkpoint, which the table names with its reason).
    Each failure names the two parts that read the range, with their segments (launches) and steps,
    so a resume from a checkpoint too early reads as which launch re-read which steps."""
    found = ledger.reuse(run_key)
    bad = [r for r in found if r.kind in UNDECLARED_KINDS]
    retrained = [r for r in found if r.kind == "retrained_after_fallback"]
    rows = [_reuse_row(r) for r in found[:200]]
    failures = []
    for r in bad[:50]:
        runs = (r.run_a, r.run_b) if r.run_a != r.run_b else (None, None)
        failures.append(
            f"{r.kind} {r.shard_id} tokens {r.tok_start}..{r.tok_end}: read by "
            f"{_part_text(r.part_a, runs[0], r.segment_a, r.steps_a)} and "
            f"{_part_text(r.part_b, runs[1], r.segment_b, r.steps_b)}"
        )
    failures += reuse_hints(bad)
    return CheckOutcome(
        "no_reuse",
        not bad,
        figures={
            "reused_tokens": sum(r.tokens for r in bad),
            "declared_replay_or_repeat_tokens": sum(r.tokens for r in found if r.kind in ("replay", "repeat")),
            "retrained_after_fallback_tokens": sum(r.tokens for r in retrained),
            "passed_over_checkpoints": ", ".join(sorted({r.checkpoint for r in retrained})) or "none",
        },
        tables={"ranges": (REUSE_HEADER, rows)},
        failures=failures,
    )


def reuse_hints(bad: list[Reuse]) -> list[str]:
    """What the undeclared re-reads are, whether a user may have meant them, and the setting that declares
    them: a source an earlier stage read (a replay) or a second epoch of this run (a repeat). A reuse within
    one epoch (a resume that kept both reads) has no setting: it is a fault."""
    out = []
    cross = sorted({r.source for r in bad if r.kind == "undeclared_cross_stage"})
    if cross:
        tokens = sum(r.tokens for r in bad if r.kind == "undeclared_cross_stage")
        listed = ", ".join(f'"{s}"' for s in cross)
        out.append(
            f"{tokens} tokens of source(s) {', '.join(cross)} were read by an earlier stage of this lineage and "
            f"again by this one: expected when this stage replays them on purpose (a replay mix, or one source "
            f"declared for two stages); declare it with --set 'data.replay_sources=[{listed}]' (the run config's "
            f"data.replay_sources, keeping any source already declared there), else give this stage data its "
            f"lineage has not read"
        )
    repeat = sorted({r.source for r in bad if r.kind == "undeclared_repeat"})
    if repeat:
        out.append(
            f"source(s) {', '.join(repeat)} were read in a second epoch by this run (the budget is larger than "
            f"the data): declare it with --set data.allow_repeat=true, or lower budget.steps or add data"
        )
    return out


def no_validation_leakage(
    ledger: Ledger, run_key: str, tokenizer_id: str, versions: dict[str, str] | None = None
) -> CheckOutcome:
    """No shard consumed in training along the run's chain is anything but train in the ledger's shard
    table (of the run's tokenizer, in the version the run read: `versions`): the split is looked up there,
    never taken from the label the trainer wrote into its consumption rows, and a shard the table does
    not know fails too."""
    leaked = ledger.leakage(run_key, tokenizer_id, versions)
    rows = [[r.consumed.shard_id, r.split, r.label, r.consumed.tokens, r.consumed.rows] for r in leaked]
    return CheckOutcome(
        "no_validation_leakage",
        not leaked,
        figures={
            "leaked_tokens": sum(r.consumed.tokens for r in leaked),
            "leaked_shards": ", ".join(r.consumed.shard_id for r in leaked) or "none",
        },
        tables={"leaked": (["shard", "ledger split", "trainer's label", "tokens", "rows"], rows)},
        failures=[
            f"shard {r.consumed.shard_id} consumed in training ({r.consumed.tokens:,} tokens, rows "
            f"{r.consumed.rows}) is not train (ledger shard table: {r.split}; "
            f"the trainer labelled it {r.label})"
            for r in leaked
        ],
    )


def ledger_matches_token_files(store: Store, ledger: Ledger, tokenizer_id: str) -> CheckOutcome:
    """Every ledger shard record's docs and tokens equal a recount of its token file, for every version of
    a shard (a run may have trained an earlier one)."""
    mismatches, total = [], 0
    records = ledger.shards(tokenizer_id=tokenizer_id, every_version=True)
    ledger_total = sum(int(r.tokens) for r in records)
    for r in records:
        try:
            shard = TokenFile(store.fetch("token_shard", tokenizer_id, r.shard_id, r.content_sha256), r.shard_id)
            docs, tokens = shard.num_docs, shard.num_tokens
        except GhostvisError as exc:
            mismatches.append([r.shard_id, r.docs, -1, r.tokens, -1, str(exc)])
            continue
        total += tokens
        same = not r.token_sha256 or sha256_file(shard.path) == r.token_sha256
        if (docs, tokens, same) != (r.docs, r.tokens, True):
            mismatches.append([r.shard_id, r.docs, docs, r.tokens, tokens, "ok" if same else "other content"])
    return CheckOutcome(
        "ledger_matches_token_files",
        not mismatches,
        figures={"recounted_tokens": total, "ledger_tokens": ledger_total, "mismatched_shards": len(mismatches)},
        tables={
            "mismatches": (["shard", "ledger_docs", "file_docs", "ledger_tokens", "file_tokens", "sha256"], mismatches)
        },
        failures=[
            f"shard {m[0]}: ledger {m[1]} docs / {m[3]} tokens, file {m[2]} / {m[4]}, sha256 {m[5]}" for m in mismatches
        ],
    )


def all_manifest_shards_tokenized(store: Store, ledger: Ledger, tokenizer_id: str) -> CheckOutcome:
    """Every shard of every registered manifest is tokenized with the tokenizer."""
    have = {r.shard_id for r in ledger.shards(tokenizer_id=tokenizer_id)}
    want = [m.shard_id(e) for m in registered_manifests(store).values() for e in m.shards]
    missing = [s for s in want if s not in have]
    return CheckOutcome(
        "all_manifest_shards_tokenized",
        not missing,
        figures={
            "manifest_shards": len(want),
            "tokenized_shards": len(want) - len(missing),
            "missing": ", ".join(missing[:50]) or "none",
        },
        failures=[f"shard {s} not tokenized" for s in missing[:50]],
    )


def no_duplicate_content(ledger: Ledger, tokenizer_id: str) -> CheckOutcome:
    """No two shards with the same content, and no document in both a train and a validation shard."""
    dups = duplicate_shards(ledger, tokenizer_id)
    overlap = train_validation_overlap(ledger, ledger.shards(tokenizer_id=tokenizer_id))
    return CheckOutcome(
        "no_duplicate_content",
        not dups and not overlap,
        figures={"duplicate_shards": len(dups), "docs_in_train_and_validation": len(overlap)},
        tables={
            "duplicates": (
                ["content_sha256", "shards"],
                [[d.content_sha256[:16], ", ".join(d.shards)] for d in dups],
            ),
            "leaked_docs": (
                ["validation shard", "row", "train shard", "row"],
                [[o.validation_shard, o.validation_row, o.train_shard, o.train_row] for o in overlap[:100]],
            ),
        },
        failures=[f"same content: {', '.join(d.shards)}" for d in dups]
        + [
            f"document in {o.validation_shard} row {o.validation_row} and {o.train_shard} row {o.train_row}"
            for o in overlap[:50]
        ],
    )
