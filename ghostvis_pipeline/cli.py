"""The `ghostvis` command: init, demo, plan, ledger, audit (chat, train, ... in their *_command modules).

Bad input ends with GhostVis's message naming the problem, the figures and the fix (exit code 2), a failed
blocking check with its failure lines as `ghostvis audit` prints them; any other failure with its type and
message (exit code 1). A traceback only with `--debug`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import RunConsumption
from ghostvis_core.data.ledger.summaries import run_consumption, run_keys, run_summaries
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.plan import presets, selected
from ghostvis_core.plan.budget import (
    DEFAULT_MFU,
    GPUS,
    LM_NEEDED_RULE,
    MemoryPlan,
    Plan,
    StepTime,
    budget_for_hours,
    memory_refusal,
    shortfall,
    source_plan,
)
from ghostvis_core.plan.budget import plan as make_plan
from ghostvis_core.plan.config import parse_sets
from ghostvis_core.plan.goodput import goodput_lines
from ghostvis_core.plan.origins import setting_origins
from ghostvis_core.plan.presets import TokenizerVocab, vocabulary_note
from ghostvis_core.plan.run_modes import (
    MODES,
    RunMode,
    compute_optimal_params,
    describe,
    mode_of,
)
from ghostvis_core.plan.stages import stage, stage_names
from ghostvis_core.verify.replay.settings import ReplaySettings
from ghostvis_pipeline import (
    chat_command,
    data_command,
    export_command,
    goodput_command,
    model_command,
    plan_goodput,
    prepare_command,
    status_command,
    store_command,
    trace_command,
    train_command,
)
from ghostvis_pipeline.subcommand import subcommand


def cmd_init(args) -> int:
    """Create GHOSTVIS_HOME and the Dagster instance folder (with the project's dagster.yaml), so a
    plain `dagster ...` command works; print the exports and the next command. Idempotent."""
    from pathlib import Path

    from ghostvis_pipeline.environment import init_report, prepare_environment

    config = Path(args.dagster_config) if args.dagster_config else None
    print(init_report(prepare_environment(Home.from_env(), config)))
    return 0


def cmd_demo(args) -> int:
    # the code location's lineage follows the demo's preset: set before the definitions are imported (they
    # read it once, at import), else `--preset smoke` ran the tiny preset's graph with the smoke lineage's plans
    os.environ["GHOSTVIS_PRESET"] = args.preset
    from ghostvis_pipeline.demo import format_summary, timed_demo

    home = Home.from_env()
    chain = selected.lineage()
    wanted = {chain.require(s) for s in args.stages or chain.stage_names()}
    stages = [s for s in chain.stage_names() if s in wanted]
    runs, wall = timed_demo(home, args.preset, stages)
    print(format_summary(runs, wall))
    print(ui_hint(home))
    return 0 if all(passed for r in runs for *_, passed in r.checks) else 1


def ui_hint(home: Home) -> str:
    return (
        f"state: {home.root}\n"
        f"Dagster UI: DAGSTER_HOME={home.dagster_home} dagster dev   (from the project folder)\n"
        f"MLflow UI:  mlflow ui --backend-store-uri {home.mlflow_tracking_uri}"
    )


PLAN_SHAPE_FLAGS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden")


def plan_overrides(args) -> dict[str, Any]:
    o: dict[str, Any] = {}
    for flag, key in [
        ("micro_batch_size", "batch.micro_batch_size"),
        ("seq_len", "batch.seq_len"),
        ("world_size", "batch.world_size"),
        ("grad_accum", "batch.grad_accum_steps"),
        ("total_batch_tokens", "batch.total_batch_tokens"),
        ("strategy", "parallel.strategy"),
        ("grad_checkpointing", "runtime.grad_checkpointing"),
        *[(f, f"model.{f}") for f in PLAN_SHAPE_FLAGS],
    ]:
        if getattr(args, flag) is not None:
            o[key] = getattr(args, flag)
    model = presets.resolve(args.stage, args.preset).model
    if args.seq_len is not None and args.seq_len > model.max_seq_len:
        o["model.max_seq_len"] = args.seq_len  # planned, with a note (plan_notes), not refused
    if args.total_batch_tokens is not None and args.grad_accum is None:
        o["batch.grad_accum_steps"] = None
    if args.grad_accum is not None and args.total_batch_tokens is None:
        o["batch.total_batch_tokens"] = None
    budgets = {
        k: getattr(args, k) for k in ("steps", "tokens", "tokens_per_param", "hours") if getattr(args, k) is not None
    }
    if len(budgets) > 1:
        raise GhostvisError(f"give one of --steps, --tokens, --tokens-per-param, --hours (got {', '.join(budgets)})")
    budgets.pop("hours", None)  # steps from the step time: budget_for_hours
    if budgets:
        o.update({"budget.steps": None, "budget.tokens": None, "budget.tokens_per_param": None})
        o.update({f"budget.{k}": v for k, v in budgets.items()})
    o.update(parse_sets(args.set or []))
    return o


def plan_notes(args) -> list[str]:
    """What the plan assumed that the user may not have meant."""
    model = presets.resolve(args.stage, args.preset).model
    notes = []
    if args.seq_len is not None and args.seq_len > model.max_seq_len:
        notes.append(
            f"seq_len {args.seq_len} is beyond the {args.preset} model's context ({model.max_seq_len}): "
            f"planned as a model trained to {args.seq_len} (context_expansion raises a model's context)"
        )
    return notes


def needed_rule(stage_name: str) -> str:
    """How `plan` counts a source's needed tokens: like the pre-flight for LM stages."""
    if stage(stage_name).objective == "lm":
        return LM_NEEDED_RULE
    return (
        f"needed = planned tokens x weight: an estimate; the {stage_name} pre-flight counts the rows "
        f"its objective packs from the data"
    )


def recipe_report(args, p) -> list[dict]:
    """Per source of --recipe: needed tokens (for LM stages exactly the pre-flight's), shards, epochs."""
    if not args.recipe:
        return []
    shards: dict[str, list[tuple[str, int]]] = {}
    for r in Ledger.in_store(Home.from_env().store).shards(tokenizer_id=args.tokenizer):
        if r.split == "train":
            shards.setdefault(r.source, []).append((r.shard_id, r.tokens))
    seq_len = p.batch.seq_len if stage(args.stage).objective == "lm" else None
    return [sp.to_dict() for sp in source_plan(presets.parse_recipe(args.recipe), p.step_tokens_total, shards, seq_len)]


def plan_mode_args(args) -> RunMode | None:
    """A run mode (--mode, or a mode's name in --preset) plans its own preset, GPU, GPUs, hours and MFU:
    args.preset becomes the model preset, args.gpu and args.mfu the mode's."""
    if args.mode and args.preset and args.mode != args.preset:
        raise GhostvisError(f"--mode {args.mode} sets the preset; drop --preset {args.preset}")
    name = args.mode or args.preset or selected.default_preset()
    mode = mode_of(name)
    args.preset = mode.preset if mode else name
    if mode is None:
        args.mfu = DEFAULT_MFU if args.mfu is None else args.mfu
        return None
    given = [f"--{f.replace('_', '-')}" for f in ("gpu", "mfu", "hours", "step_time") if getattr(args, f) is not None]
    if given:
        raise GhostvisError(
            f"run mode {mode.name} states the hardware and hours ({describe(mode)}); drop "
            f"{', '.join(given)}, or plan --preset {mode.preset} with them"
        )
    args.gpu, args.mfu = mode.gpu, mode.mfu
    return mode


def cmd_plan(args) -> int:
    if args.modes:
        return print_modes(args.stage, args.json)
    mode = plan_mode_args(args)
    overrides = plan_overrides(args)
    vocab = data_vocab(args, overrides)
    cfg = presets.resolve(args.stage, mode.name if mode else args.preset, overrides, vocab=vocab)
    if args.settings:
        return print_settings(cfg, overrides, args.json)
    step_time = StepTime(args.step_time, args.gpu, args.mfu)
    if args.hours is not None:
        cfg = budget_for_hours(cfg, args.hours, step_time, params=args.params)
    p = make_plan(cfg, step_time=step_time, price_per_gpu_hour=args.price, params=args.params)
    sources = recipe_report(args, p)
    notes = plan_notes(args) + (
        [n] if vocab and (n := vocabulary_note(vocab.tokenizer_id, vocab.size, args.preset)) else []
    )
    refusals = preflight_refusals(args.stage, cfg, sources)
    memory = MemoryPlan.from_dict(p.memory)
    goodput = plan_goodput.goodput_plan(args, cfg, p)
    if args.json:
        print(
            json.dumps(
                {
                    "stage": args.stage,
                    "preset": args.preset,
                    **({"run_mode": mode.name} if mode else {}),
                    **p.to_dict(),
                    **({"sources": sources, "needed_tokens_rule": needed_rule(args.stage)} if sources else {}),
                    **({"notes": notes} if notes else {}),
                    **({"refused_at_launch": refusals} if refusals else {}),
                    **({"goodput": goodput.to_dict()} if goodput else {}),
                },
                indent=2,
            )
        )
        return refuse_unfit(args.stage, memory) or refuse_short(refusals)
    if mode:
        print(f"run mode {mode.name}: {describe(mode)}")
    print_plan(args, p, sources)
    print_memory(memory)
    if goodput:
        print("\n".join(goodput_lines(goodput)))
    for note in notes:
        print(f"  note: {note}")
    return refuse_unfit(args.stage, memory) or refuse_short(refusals)


def print_settings(cfg, overrides: dict[str, Any], as_json: bool) -> int:
    """`ghostvis plan --settings`: every resolved setting of the stage and where it comes from."""
    rows = setting_origins(cfg, overrides)
    if as_json:
        print(json.dumps([{"key": k, "value": v, "from": o} for k, v, o in rows], indent=2, default=str))
        return 0
    print(f"{cfg.stage} ({cfg.preset}): {len(rows)} settings")
    for key, value, origin in rows:
        print(f"  {key:<32} {json.dumps(value, default=str):<28} {origin}")
    return 0


def data_vocab(args, overrides: dict[str, Any]) -> TokenizerVocab | None:
    """With --recipe the plan is of the data in the home: a fresh model's vocabulary is its tokenizer's (the
    newest, or --tokenizer), as at launch; None without a tokenizer, or with --vocab-size."""
    from ghostvis_core.data.bpe_tokenizer import load_tokenizer, newest_tokenizer

    if not args.recipe or "model.vocab_size" in overrides:
        return None
    store = Home.from_env().store
    if not args.tokenizer and not store.keys("tokenizer"):
        return None
    tok = load_tokenizer(args.tokenizer or newest_tokenizer(store), store)
    return TokenizerVocab(tok.tokenizer_id, tok.vocab_size)


def preflight_refusals(stage_name: str, cfg, sources: list[dict]) -> list[str]:
    """What the LM pre-flight will refuse in this plan: a source read more than once without data.allow_repeat
    (the same figures and message, budget.shortfall)."""
    if stage(stage_name).objective != "lm" or cfg.data.allow_repeat:
        return []
    return [
        shortfall(sp["source"], sp["needed_tokens"], sp["available_tokens"], sp["shards_available"])
        for sp in sources
        if sp["available_tokens"] is not None and sp["needed_tokens"] > sp["available_tokens"]
    ]


def refuse_short(refusals: list[str]) -> int:
    """Exit 2 with the pre-flight's message when the run would be refused at launch."""
    if refusals:
        print(
            f"ghostvis: error: this run would be refused at launch: pre-flight failed: {'; '.join(refusals)}",
            file=sys.stderr,
        )
        return 2
    return 0


def refuse_unfit(stage_name: str, mp: MemoryPlan) -> int:
    """Exit 2 with the numbers and the fixes when the memory plan does not fit the --gpu."""
    if mp.fit is not None and not mp.fit.fits:
        print(f"ghostvis: error: {memory_refusal(stage_name, mp)}", file=sys.stderr)
        return 2
    return 0


def print_memory(mp: MemoryPlan) -> None:
    print(
        f"  memory per GPU  = {mp.total_gb:.2f} GB ({mp.strategy}, {'bf16' if mp.bf16 else 'fp32'}, "
        f"activation checkpointing {'on' if mp.grad_checkpointing else 'off'}, micro batch "
        f"{mp.micro_batch_size} x {mp.seq_len}, {mp.world_size} GPUs)"
    )
    print(
        f"                  = {mp.weights_gb:.2f} weights + {mp.grads_gb:.2f} grads + {mp.optimizer_gb:.2f} "
        f"optimizer + {mp.buffers_gb:.2f} buffers + {mp.activations_gb:.2f} activations + "
        f"{mp.logits_gb:.2f} logits"
    )
    fit = mp.fit
    if fit is not None:
        print(
            f"  fits {fit.gpu or 'GPU'}        = {'yes' if fit.fits else 'NO'} ({fit.usable_gb:.1f} of "
            f"{fit.memory_gb:.0f} GB usable)"
        )


def print_plan(args, p, sources: list[dict]) -> None:
    b = p.batch
    print(f"{args.stage} ({args.preset})")
    print("  tokens_per_step = micro_batch_size x seq_len x world_size x grad_accum_steps")
    print(
        f"                  = {b.micro_batch_size} x {b.seq_len} x {b.world_size} x {b.grad_accum_steps}"
        f" = {b.tokens_per_step:,}"
    )
    print(f"  steps           = {p.steps:,}")
    print(f"  planned_tokens  = {p.planned_tokens:,}  (steps x tokens_per_step = {p.step_tokens_total:,})")
    print(f"  params          = {p.params_total:,} total, N = {p.params_non_embedding:,} non-embedding")
    print(f"  tokens/param    = {p.tokens_per_param:,.2f}")
    print(f"  FLOPs (6ND)     = {p.flops:.3e}")
    print(f"  FLOPs/token     = {p.flops_per_token:.4g}  (6N + attention: what MFU counts)")
    if p.step_time_s is not None:
        at = f"  ({args.gpu} peak x MFU {args.mfu:g})" if args.step_time is None and args.gpu else ""
        print(f"  step time       = {p.step_time_s:.3f} s{at}")
        print(f"  wall clock      = {p.hours:,.2f} h")
        print(f"  GPU-hours       = {p.gpu_hours:,.2f}  ({b.world_size} GPUs)")
    if p.cost is not None:
        print(f"  cost            = {p.cost:,.2f}  at {args.price}/GPU-hour")
    if sources:
        print(f"\n  {'source':<16} {'weight':>6} {'needed':>16} {'available':>16} {'epochs':>7} {'shards':>13}")
        for sp in sources:
            avail = f"{sp['available_tokens']:,}" if sp["available_tokens"] is not None else "not tokenized"
            ep = f"{sp['epochs']:.2f}" if sp["epochs"] is not None else "-"
            need = f"{sp['shards_needed']}/{sp['shards_available']}" if sp["shards_needed"] is not None else "-"
            print(
                f"  {sp['source']:<16} {sp['weight']:>6.2f} {sp['needed_tokens']:>16,} {avail:>16} {ep:>7} {need:>13}"
            )
        print(f"  ({needed_rule(args.stage)})")


def plan_mode(name: str, stage_name: str = "pretrain", overrides: dict | None = None) -> Plan:
    """The planner's plan of a run mode on its own hardware: steps, tokens, step time, hours, memory."""
    mode = mode_of(name)
    if mode is None:
        raise GhostvisError(f"'{name}' is a model preset, not a run mode; run modes: {', '.join(MODES)}")
    return make_plan(presets.resolve(stage_name, name, overrides), step_time=mode.step_time)


def print_modes(stage_name: str, as_json: bool) -> int:
    """`ghostvis plan --modes`: every run mode, what it states and what the planner derives from it."""
    rows = []
    for name, mode in MODES.items():
        p = plan_mode(name, stage_name)
        rows.append(
            {
                "mode": name,
                "states": describe(mode),
                "preset": mode.preset,
                "gpu": mode.gpu,
                "gpus": mode.gpus,
                "hours_target": mode.hours,
                "mfu": mode.mfu,
                "steps": p.steps,
                "tokens_per_step": p.batch.tokens_per_step,
                "tokens": p.step_tokens_total,
                "tokens_per_param": round(p.tokens_per_param, 2),
                "hours": round(p.hours, 3),
                "memory_gb": p.memory["total_gb"],
                "fits": p.memory["fit"]["fits"],
                "compute_optimal_params": int(compute_optimal_params(p)),
            }
        )
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'mode':<12} {'preset':>6} {'steps':>8} {'tokens/step':>11} {'tokens':>16} {'tok/param':>9} {'hours':>6} "
        f"{'GB/GPU':>7} {'fits':>4} {'20-tok/param N':>14}"
    )
    for r in rows:
        print(
            f"{r['mode']:<12} {r['preset']:>6} {r['steps']:>8,} {r['tokens_per_step']:>11,} {r['tokens']:>16,} "
            f"{r['tokens_per_param']:>9.2f} {r['hours']:>6.2f} {r['memory_gb']:>7.1f} "
            f"{'yes' if r['fits'] else 'NO':>4} "
            f"{r['compute_optimal_params'] / 1e6:>13,.0f}M"
        )
    print(
        f"({stage_name}; steps = the hours at the mode's GPU peak x MFU over model FLOPs per step, from the planner; "
        "20-tok/param N: the model size the compute would train to 20 tokens per parameter)"
    )
    return 0


def ledger_report(home: Home, tokenizer_id: str | None) -> dict[str, Any]:
    from ghostvis_core.verify.audit.contamination import shard_contamination

    ledger = Ledger.in_store(home.store)
    shards = ledger.shards(tokenizer_id=tokenizer_id)
    runs = run_summaries(ledger)
    return {
        "shards": shards,
        "runs": runs,
        "checks": check_verdicts(home, sorted({r.stage for r in runs})),
        "contamination": shard_contamination(ledger, shards),
    }


def check_verdicts(home: Home, stages: list[str]) -> dict[str, str]:
    """Per run key, whether its blocking checks passed, from the home's Dagster instance (none: no verdicts)."""
    if not (home.dagster_home / "storage").exists():
        return {}
    from dagster import DagsterInstance

    from ghostvis_pipeline.check_failures import run_verdicts

    with DagsterInstance.from_config(str(home.dagster_home)) as instance:
        return run_verdicts(instance, stages)


def resolve_run(home: Home, ledger: Ledger, name: str) -> str:
    """A stage name means its newest completed run; anything else is taken as a run key."""
    from ghostvis_core.runs.lookup import newest_completed_run

    if name not in stage_names():
        return name
    newest = newest_completed_run(home.store, name)
    if newest:
        return newest.run_key
    unfinished = run_keys(ledger, name)
    raise GhostvisError(
        f"stage {name} has no completed run; materialize the `{name}` asset"
        + (f" (or pass one of its unfinished run keys: {', '.join(unfinished)})" if unfinished else "")
    )


def format_run_consumption(c: RunConsumption) -> list[str]:
    """`ghostvis ledger --run`: a run's segments, parts, token figures, per-shard and per-range consumption."""
    lines = [
        f"{c.stage} {c.run_key}" + (f"  (from {c.parent_run_key})" if c.parent_run_key else ""),
        f"  steps {c.steps:,}, parts {c.parts}, tokens_per_step {c.tokens_per_step:,}, planned {c.planned_tokens:,}",
        "  "
        + ", ".join(f"{k} {v:,}" for k, v in c.counts.as_dict().items())
        + f", overlap_tokens {c.overlap_tokens:,}",
        "",
        f"  {'segment':>7} {'steps':>15} {'world_size':>10} {'real_tokens':>14}",
    ]
    lines += [
        f"  {s.segment:>7} {str(s.first_step) + '..' + str(s.last_step):>15} {s.world_size:>10} {s.real_tokens:>14,}"
        for s in c.segments
    ]
    lines += ["", f"  {'shard':<26} {'split':<10} {'epochs':>6} {'rows':>13} {'tokens':>14}"]
    lines += [f"  {r.shard_id:<26} {r.split:<10} {r.epochs:>6} {r.rows:>13} {r.tokens:>14,}" for r in c.shards]
    lines.append(f"  {'consumed (shard tokens)':<58} {c.consumed_tokens:>14,}")
    lines += [
        "",
        f"  {'shard':<26} {'split':<10} {'epoch':>5} {'token range':>21} {'row range':>13} {'tokens':>12} parts",
    ]
    lines += [
        f"  {r.shard_id:<26} {r.split:<10} {r.epoch:>5} {str(r.tok_start) + '..' + str(r.tok_end):>21} "
        f"{str(r.row_start) + '..' + str(r.row_end):>13} {r.tokens:>12,} {r.parts:>5}"
        for r in c.ranges
    ]
    lines.append("  (ranges are [start, end): token positions and rows of the shard; touching parts are joined)")
    return lines


def cmd_ledger(args) -> int:
    if args.run:
        home = Home.from_env()
        ledger = Ledger.in_store(home.store)
        consumed = run_consumption(ledger, resolve_run(home, ledger, args.run))
        print(
            json.dumps(consumed.as_dict(), indent=2, default=str)
            if args.json
            else "\n".join(format_run_consumption(consumed))
        )
        return 0
    report = ledger_report(Home.from_env(), args.tokenizer)
    if args.json:
        shards = [dataclasses.asdict(r) for r in report["shards"]]
        runs = [{**r.as_dict(), "checks": report["checks"].get(r.run_key, "-")} for r in report["runs"]]
        contamination = report["contamination"]
        print(json.dumps({"shards": shards, "runs": runs, "contamination": contamination}, indent=2, default=str))
        return 0
    shards, contamination = report["shards"], report["contamination"]
    print(
        f"{'shard':<26} {'split':<10} {'tokenizer':<22} {'docs':>7} {'tokens':>12} {'text_bytes':>12} "
        f"{'eval 13-grams':>13} {'docs sharing':>12} {'contaminated':>12}"
    )
    for r in shards:
        c = contamination.get(r.shard_id) if r.split == "train" else None
        eval_cols = (
            f"{c['shared_ngrams']:>13,} {c['docs_sharing']:>12,} {c['docs_contaminated']:>12,}"
            if c
            else f"{'-':>13} {'-':>12} {'-':>12}"
        )
        print(
            f"{r.shard_id:<26} {r.split:<10} {r.tokenizer_id:<22} {r.docs:>7,} {r.tokens:>12,} "
            f"{r.text_bytes:>12,} {eval_cols}"
        )
    print(
        f"{'total':<60} {sum(r.docs for r in shards):>7,} {sum(r.tokens for r in shards):>12,} "
        f"{sum(r.text_bytes for r in shards):>12,}"
    )
    print(
        "(eval 13-grams: a train shard's document fingerprints shared with evaluation data; docs sharing: its "
        "documents with any; contaminated: over the default contamination.max_overlap; see no_eval_contamination)"
    )
    print()
    print(
        f"{'stage':<20} {'run_key':<28} {'steps':>6} {'planned':>11} {'real':>11} {'pad':>9} {'loss':>11} "
        f"{'cropped':>9} seg checks"
    )
    for r in report["runs"]:
        t, c = r.totals, r.totals.counts
        print(
            f"{r.stage:<20} {r.run_key:<28} {t.steps:>6} {r.planned_tokens:>11,} {c.real_tokens:>11,} "
            f"{c.pad_tokens:>9,} {c.loss_tokens:>11,} {c.cropped_tokens:>9,} {len(t.segments):>3} "
            f"{report['checks'].get(r.run_key, '-')}"
        )
    print("(checks: the run's blocking checks in Dagster; FAILED names them, `ghostvis audit` says what disagrees)")
    return 0


def dagster_metadata(home: Home, stages: list[str]) -> dict[str, dict[str, Any]]:
    """Per stage, its newest materialization's metadata in the home's Dagster instance (when there is
    one: the audit needs only the store and MLflow, and compares Dagster's copy when it can)."""
    if not (home.dagster_home / "storage").exists():
        return {}
    from dagster import DagsterInstance

    from ghostvis_pipeline.metadata import newest_metadata_or_none

    with DagsterInstance.from_config(str(home.dagster_home)) as instance:
        found = {name: newest_metadata_or_none(instance, name) for name in stages}
        return {name: md for name, md in found.items() if md is not None}


def cmd_audit(args) -> int:
    """Every data and stage invariant from the store and MLflow; exit 1 naming each disagreement."""
    from ghostvis_core.verify.audit.audit_report import audit, format_report

    unknown = sorted(set(args.stage or []) - set(stage_names()))
    if unknown:
        raise GhostvisError(f"unknown stage(s) {', '.join(unknown)}; stages: {', '.join(stage_names())}")
    home = Home.from_env()
    stages = [s for s in stage_names() if s in args.stage] if args.stage else selected.lineage().stage_names()
    report = audit(home, stages, {} if args.no_dagster else dagster_metadata(home, stages), required=bool(args.stage))
    if args.replay:
        from ghostvis_core.verify.replay.check import add_replays

        add_replays(home.store, report, ReplaySettings(args.replay, args.replay_seed))
    print(json.dumps(report, indent=2, default=str) if args.json else "\n".join(format_report(report)))
    return 1 if report["failures"] else 0


def add_audit_parser(sub) -> None:
    """`ghostvis audit`: its stage selection, the Dagster comparison and the replay."""
    au = subcommand(
        sub,
        "audit",
        help="re-run every data and stage invariant from the store and MLflow (no Dagster "
        "run needed); exit 1 naming each stage and figure that disagrees",
        fn=cmd_audit,
        json=True,
    )
    au.add_argument("--stage", action="append", choices=stage_names(), help="audit only this stage (repeatable)")
    au.add_argument("--no-dagster", action="store_true", help="do not compare the Dagster instance's metadata")
    au.add_argument(
        "--replay",
        type=int,
        default=0,
        metavar="K",
        help="also replay K checkpoint intervals of each stage's run (the last among them) from the checkpoint "
        "before, on the ledger's rows, and compare the weights bit for bit with the checkpoint after",
    )
    au.add_argument(
        "--replay-seed", type=int, default=ReplaySettings.seed, help="the seed that draws the replayed intervals"
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ghostvis", description="GhostVis: a training pipeline whose token numbers are checked."
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    i = subcommand(
        sub, "init", help="create GHOSTVIS_HOME and the Dagster instance folder; print the exports", fn=cmd_init
    )
    i.add_argument(
        "--dagster-config",
        metavar="YAML",
        help="instance config to install (default: the project's dagster.yaml, SQLite; "
        "a team's PostgreSQL: deploy/dagster-postgres.yaml)",
    )

    d = subcommand(sub, "demo", help="materialize every asset on the embedded demo data", fn=cmd_demo)
    d.add_argument("--preset", default=selected.default_preset(), help="tiny (default) or smoke (fewer steps)")
    d.add_argument("--stages", nargs="*", help="train only these stages (default: all)")

    p = subcommand(sub, "plan", help="token / step / FLOP / cost / per-GPU memory planner", fn=cmd_plan)
    add_plan_arguments(p)

    lg = subcommand(sub, "ledger", help="the token ledger: shards and per-stage consumption", fn=cmd_ledger, json=True)
    lg.add_argument("--tokenizer", help="only shards tokenized with this tokenizer id")
    lg.add_argument(
        "--run",
        metavar="STAGE_OR_RUN_KEY",
        help="what one run consumed: segments, token figures, per shard and range "
        "(a stage name means its newest completed run)",
    )
    add_audit_parser(sub)
    chat_command.add_parser(sub)
    data_command.add_parser(sub)
    train_command.add_parser(sub)
    prepare_command.add_parser(sub)
    export_command.add_parser(sub)
    model_command.add_parser(sub)
    status_command.add_parser(sub)
    store_command.add_parser(sub)
    trace_command.add_parser(sub)
    goodput_command.add_parser(sub)
    return ap


PLAN_INT_FLAGS = {
    "micro-batch-size": "rows per micro-step per GPU (batch.micro_batch_size)",
    "seq-len": "tokens per row (batch.seq_len); beyond the model's context it is planned with a note",
    "world-size": "GPUs (batch.world_size)",
    "grad-accum": "micro-steps per optimizer step (batch.grad_accum_steps)",
    "total-batch-tokens": "tokens per optimizer step; grad-accum is derived from it",
    "steps": "budget: optimizer steps",
    "tokens": "budget: tokens to train on (steps rounded up)",
    "params": "N for 6ND FLOPs and for weight/optimizer memory, instead of the model shape's count "
    "(activations still follow the shape: the preset's, or --d-model, --n-layers, ...)",
    "vocab-size": "model shape: vocabulary (default: the preset's)",
    "d-model": "model shape: hidden size",
    "n-layers": "model shape: transformer blocks",
    "n-heads": "model shape: attention heads",
    "n-kv-heads": "model shape: key/value heads (grouped-query attention)",
    "ffn-hidden": "model shape: SwiGLU hidden size",
}


PLAN_SWITCHES = {
    "modes": "list the run modes with the steps, tokens and hours the planner derives for each, and whether each "
    "fits its GPU",
    "settings": "print every resolved setting of the stage and where it comes from: --set, the preset, the model, "
    "the stage table and lineage, or the default",
    "json": "print the plan (and memory plan) as JSON",
}


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage", default="pretrain", choices=stage_names(), help="the stage to plan (default pretrain)")
    p.add_argument(
        "--preset",
        help=f"model shape and stage defaults: {', '.join(presets.preset_names())} (default: "
        "GHOSTVIS_PRESET, else tiny); a run mode's name works too",
    )
    p.add_argument(
        "--mode",
        choices=list(MODES),
        help="a run mode: model preset, GPU, GPUs, hours and MFU; the "
        "planner derives steps and tokens and checks the memory (see --modes)",
    )
    for flag, text in PLAN_SWITCHES.items():
        p.add_argument(f"--{flag}", action="store_true", help=text)
    for flag, text in PLAN_INT_FLAGS.items():
        p.add_argument(f"--{flag}", type=int, help=text)
    p.add_argument("--tokens-per-param", type=float, help="budget: tokens per parameter (20 = Chinchilla)")
    p.add_argument(
        "--hours",
        type=float,
        help="budget: the steps that fit in this many hours of wall clock at "
        "--step-time, or at --gpu's peak x --mfu (e.g. --world-size 1 --gpu H100 --hours 4)",
    )
    p.add_argument(
        "--strategy",
        choices=["ddp", "fsdp"],
        help="parallel.strategy: ddp replicates the model, "
        "fsdp shards weights, grads and optimizer state over the GPUs",
    )
    p.add_argument(
        "--grad-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="runtime.grad_checkpointing: recompute each block's activations in the backward pass",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="any stage config value, e.g. --set parallel.strategy=ddp (repeatable)",
    )
    p.add_argument("--step-time", type=float, help="seconds per optimizer step (measured)")
    p.add_argument(
        "--gpu",
        choices=list(GPUS),
        help="estimate the step time from this GPU's peak bf16 FLOP/s at "
        "--mfu, and check the per-GPU memory against its memory (exit 2 if it does not fit)",
    )
    p.add_argument("--mfu", type=float, help=f"model FLOPs utilization assumed with --gpu (default {DEFAULT_MFU})")
    p.add_argument("--price", type=float, help="price per GPU-hour")
    p.add_argument("--recipe", help="mixture source=weight,...: per source tokens, epochs and shards from the ledger")
    p.add_argument("--tokenizer", help="count ledger shards of this tokenizer only")
    plan_goodput.add_goodput_arguments(p)


def user_error(exc: BaseException) -> str | None:
    """The message meant for the user inside a Dagster step failure (a GhostvisError or Failure)."""
    from dagster import Failure

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, GhostvisError):
            return str(exc)
        if isinstance(exc, Failure):
            return exc.description
        exc = getattr(exc, "user_exception", None) or exc.__cause__
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError:  # the reader stopped early (`ghostvis ledger --run sft | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:
        if getattr(args, "debug", False):  # `ghostvis store` has no --debug
            raise
        message = user_error(exc)
        if message is None:  # not bad input: name it, and how to see where it came from
            print(
                f"ghostvis: error: {args.cmd} failed: {type(exc).__name__}: {exc}\n"
                f"(not a known bad input: rerun with --debug for the traceback, and report it with the command)",
                file=sys.stderr,
            )
            return 1
        print(f"ghostvis: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
