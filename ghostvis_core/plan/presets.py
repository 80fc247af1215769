"""Presets: per stage, the values that differ from the config dataclasses' defaults.

A preset names a model shape and, per stage, the batch, budget, optimiser and data recipe, as deltas
over ghostvis_core/plan/config.py (the only place defaults live; tests/test_stages.py refuses a preset
value equal to its default). The stage's objective, upstream and evidence come from the stage table
(ghostvis_core/plan/stages.py). `resolve` (its docstring states the precedence) turns them, the upstream
model, overrides, the tokenizer's vocabulary and the registered sources into a frozen, validated StageConfig.

- tiny:  ~5M params, trains every stage on 2 CPU cores in minutes (the demo).
- smoke: the tiny model with fewer steps and half the rows per micro-batch, for end-to-end tests.
- 500m / 1.5b / 7b: GPU-class shapes the planner prices (Chinchilla budgets by default).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import Any

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan import lineage, run_modes, selected, stages
from ghostvis_core.plan.config import SourceWeight, StageConfig, apply_overrides, check_ranges

MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=688, max_seq_len=256),
    "500m": dict(
        vocab_size=65536, d_model=1280, n_layers=24, n_heads=10, n_kv_heads=5, ffn_hidden=3456, max_seq_len=2048
    ),
    "1.5b": dict(
        vocab_size=65536, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=8, ffn_hidden=5632, max_seq_len=4096
    ),
    "7b": dict(
        vocab_size=65536, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, max_seq_len=4096
    ),
}

# Tokenizer vocabulary (including special tokens) trained for each preset; the model's vocab_size
# is set from the trained tokenizer at launch, this is what the tokenizer asset aims for.
TOKENIZER_VOCAB = {"tiny": 4096, "smoke": 4096, "500m": 65536, "1.5b": 65536, "7b": 65536}

_TEXT_VAL = ["demo_prose", "demo_code"]


def _batch(micro_batch_size: int, seq_len: int) -> dict[str, int]:
    """A CPU preset stage's batch (tiny, smoke): rows and length differ; all run on 2 CPU ranks, no accumulation."""
    return dict(micro_batch_size=micro_batch_size, seq_len=seq_len, world_size=2, grad_accum_steps=1)


def _recipe(**weights: float) -> list[dict[str, Any]]:
    """A data recipe from source=weight, in the order given (the order the config lists them)."""
    return [{"source": source, "weight": weight} for source, weight in weights.items()]


def _text_data(**weights: float) -> dict[str, Any]:
    """A text stage's data: its recipe of demo prose and code, validated on both (the held-out bpb the gate reads)."""
    return dict(recipe=_recipe(**weights), val_sources=_TEXT_VAL)


def _schedule(steps: int, **optim: Any) -> dict[str, dict[str, Any]]:
    """A stage's length and learning-rate schedule: its steps, and the LR warmed up and decayed over them."""
    return dict(budget=dict(steps=steps), optim=optim)


def _every(steps: int, **eval_fields: Any) -> dict[str, dict[str, Any]]:
    """A stage that evaluates and checkpoints on the same step; eval_fields are eval's other deltas."""
    return dict(eval=dict(every_steps=steps, **eval_fields), checkpoint=dict(every_steps=steps))


# Stage defaults per preset: nested dicts merged over the StageConfig tree. A stage's `model`
# entry lists changes to the upstream checkpoint's model (context_expansion raises the context);
# every other model field is inherited from upstream and may not change.
_TINY: dict[str, dict[str, Any]] = {
    "pretrain": dict(
        batch=_batch(8, 256),
        **_schedule(200, lr=2e-3, warmup_steps=15),
        data=_text_data(demo_prose=0.5, demo_code=0.5),
    ),
    "continued_pretrain": dict(
        batch=_batch(8, 256),
        # Near pretraining's final LR (2e-4): re-warming to pretraining's peak undoes more than 60
        # steps recover (held-out code loss rose at 1e-3 and 1.5e-3, fell at 3e-4 and 5e-4).
        **_schedule(60, lr=3e-4, warmup_steps=5),
        data=_text_data(demo_code=0.7, demo_prose=0.3),
        **_every(30),
    ),
    "context_expansion": dict(
        # Adjusted base frequency (ABF): a 16x larger RoPE base stretches the slow dimensions over the
        # longer context and leaves the fast (local) ones nearly unchanged; position interpolation
        # (model.rope_scaling=4) is the alternative.
        model=dict(max_seq_len=1024, rope_base=160000.0),
        batch=_batch(2, 1024),
        # What pretraining and continued pretraining leave unread: 25,937 prose and 53,715 code tokens
        # (`ghostvis ledger`). Code files are the corpus's long documents, so they take 70% of the rows;
        # 18 steps (72 rows of 1,024) is the most both sources hold without repeating the lineage's tokens.
        # 5e-5, a sixth of continued pretraining's peak: re-warming to 5e-4 raised held-out loss beyond the old
        # context (5.846 -> 5.873); 2e-4 / 1e-4 / 5e-5 lowered it (5.842 / 5.836 / 5.834; README "context_expansion").
        **_schedule(18, lr=5e-5, warmup_steps=5),
        data=_text_data(demo_code=0.7, demo_prose=0.3),
        **_every(9),
    ),
    "reasoning_mix": dict(
        batch=_batch(4, 512),
        # Replays code as well as prose, at a lower LR: with prose alone at 1e-3, held-out code bpb rose
        # 11% (2.73 -> 3.04), beyond the lineage quality gate's 10% (ghostvis_core/verify/eval/quality_gate.py).
        **_schedule(80, lr=7e-4, warmup_steps=5),
        data=dict(
            recipe=_recipe(demo_reasoning=0.6, demo_prose=0.2, demo_code=0.2),
            replay_sources=["demo_prose", "demo_code"],
            val_sources=["demo_reasoning", "demo_prose"],
        ),
        # 64 held-out problems for the answer accuracy (8 samples each): seed 1337's reasoning_mix answers 5 of 512
        # samples right (1 of 192 with 24 problems; greedy, 0 of 64)
        **_every(40, samples=64),
    ),
    "vision_alignment": dict(
        vision={},  # the VisionConfig defaults: a tiny ViT, 16 latents
        batch=_batch(32, 40),
        # The frozen tiny LM barely reads a soft prefix: the resampler first learns a generic prefix
        # (caption loss falls, true and shuffled image alike) and starts to carry the image only after
        # many steps at a high LR, so the stage trains for several epochs of its images (declared
        # repetition); docs/architecture.md, "Fixed costs", has the measured gaps.
        **_schedule(300, lr=1e-2, warmup_steps=8, weight_decay=0.0),
        data=dict(recipe=_recipe(demo_images=1.0), val_sources=["demo_images"], allow_repeat=True),
        **_every(150, val_tokens=8000),
    ),
    "sft": dict(
        batch=_batch(8, 256),
        # Near pretraining's final LR: at 1e-3 held-out prose bpb rose 40% over the upstream (2.67 -> 3.73),
        # far beyond the lineage quality gate's 10%.
        **_schedule(60, lr=2e-4, warmup_steps=5),
        data=dict(recipe=_recipe(demo_chat=1.0), val_sources=["demo_chat"], allow_repeat=True),
        **_every(30, samples=24, sample_max_tokens=40),
    ),
    "dpo": dict(
        # DPO plus an NLL term on the chosen reply (beta 0.1, alpha 1), at a sixth of the former LR: plain DPO at
        # 3e-4 pushed held-out prose bpb 25% over SFT's (3.73 -> 4.67) and chat answered "8, 8, 8, ...".
        dpo=dict(loss="sft_dpo"),
        batch=_batch(16, 96),
        **_schedule(40, lr=5e-5, warmup_steps=4, weight_decay=0.0),
        data=dict(recipe=_recipe(demo_prefs=1.0), val_sources=["demo_prefs"]),
        **_every(20, val_tokens=19200),
    ),
    "rl": dict(
        # 8 completions per prompt (at most 48 new tokens, temperature 1, the defaults): a group has a signal
        # only when one completion's reward differs (a well-formed or exact answer), which is rare for a tiny policy.
        # Plain-text prompts: the demo lineage starts rl from reasoning_mix (lineage.py "demo"), which learned the
        # problems as text, not as chat turns. A completion ends at the newline closing its `Answer: n` line: only
        # an answer line that is the completion's last earns the format reward.
        grpo=dict(group_size=8, prompt="text", stop_at_answer=True),
        # A row is one (prompt, completion): 32 rows = 4 prompts x 8 completions per micro-batch and rank, 8 prompts a
        # step (a group is sampled as one batch; seed 1337, held-out exact answers among 512 samples 4 -> 10 with 4
        # prompts a step or 8, well-formed 0.12 -> 0.87 with 4, 0.95 with 8; README "The tiny demo's rl").
        batch=_batch(32, 128),
        # 3e-4: started from reasoning_mix (a policy that writes the answer format), 1e-4 left held-out reward flat
        # in 30 steps (0.108 -> 0.100) and 3e-4 raised it (0.105 -> 0.131, well-formed answers 73% -> 100%)
        # (README "The tiny demo's rl").
        # The demo's dpo model never writes a well-formed `Answer:` line (0 of 320 samples chat-rendered, also after
        # a trial sft on 582 chats solving such problems), so from it every group's advantages are 0: the tiny
        # preset's lineage (selected.PRESET_LINEAGES) starts rl from reasoning_mix.
        **_schedule(30, lr=3e-4, warmup_steps=3, weight_decay=0.0),
        # The problems reasoning_mix trained on as text (as nanochat's RL reads GSM8K train), as prompt + answer:
        # demo_problems, a source of their own, so no token range of an earlier stage is read again.
        data=dict(recipe=_recipe(demo_problems=1.0), val_sources=["demo_problems"]),
        # eval's samples: held-out problems for the reward evidence (greedy, and 8 samples each; split over ranks)
        **_every(15, samples=64),
    ),
}

# Named config variants of a stage (dotted overrides), materialized side by side as partitions of
# `<stage>_variants` and compared in MLflow (tag ghostvis.variant).
VARIANTS: dict[str, dict[str, dict[str, str]]] = {
    "pretrain": {"lr_1e-3": {"optim.lr": "1e-3"}, "lr_4e-3": {"optim.lr": "4e-3"}, "muon": {"optim.name": "muon"}},
}

# The smoke preset: the tiny model and recipes with few steps, for end-to-end tests.
_SMOKE_STEPS = {
    "pretrain": 24,
    "continued_pretrain": 8,
    "context_expansion": 6,
    "reasoning_mix": 8,
    "vision_alignment": 8,
    "sft": 8,
    "dpo": 6,
    "rl": 4,
}
# What else the smoke preset makes cheaper: every stage reads half the tiny preset's rows per micro-batch (the
# training steps are most of a smoke run's work on a CPU); rl samples 2 short completions per prompt (2 prompts
# per row batch), asked as chat turns (grpo.prompt's default: smoke keeps the vlm lineage, rl on dpo's chat model).
_SMOKE_DELTAS = {
    # context_expansion warms up in 1 step at 5e-4: with 5 warm-up steps, 6 steps end at the peak LR, never decayed,
    # and held-out loss beyond the old context rose at every peak tried (3e-4 / 5e-4 / 1e-3: 6.915 -> 7.111 / 6.979 /
    # 6.971); warmed up in 1 and decayed over 5, 5e-4 lowers it (6.915 -> 6.861, within the old context 7.011 ->
    # 6.979), so does 3e-4 (6.871), 1e-3 does not (7.010; README "context_expansion").
    "context_expansion": dict(optim=dict(lr=5e-4, warmup_steps=1)),
    "rl": dict(
        grpo=dict(group_size=2, max_new_tokens=24),
        batch=_batch(4, 96),
    ),
}

# Why a stage's evidence cannot improve in a preset's run, per preset and stage: the report card prints it next
# to the figures that did not move (ghostvis_core/verify/eval/report_card.py), instead of a flat line passing as
# success.
EVIDENCE_NOTES: dict[str, dict[str, str]] = {
    "tiny": {
        # measured (benchmarks/seeds.py, seeds 1337-1341; README "Evidence across seeds"): its samples' well-formed
        # rate 0.12-0.28 -> 0.87-0.95, their exact answers 1-4 -> 5-16 of 512
        "rl": "30 steps on 2 cores mostly teach a 5M-parameter policy to end on its answer line (its samples' "
        "well-formed rate rises several-fold); its exact answers rise with it by a few samples of 512, so a seed can "
        "leave them flat, and its greedy answers move by a problem or two of 64",
    },
    "smoke": {
        **dict.fromkeys(
            _SMOKE_STEPS, "smoke runs a few steps to test the plumbing; its evidence is not expected to move"
        ),
        # measured: 0 of 32 completions rewarded as the preset runs, 0 of 128 with the tiny preset's grpo settings
        # from smoke's reasoning_mix (README "The smoke demo's rl")
        "rl": "a policy trained a few steps (held-out loss ~6 nats/token) never writes the `Answer:` line the reward "
        "reads, not even with the tiny demo's rl settings (0 of 128 samples rewarded): every group's rewards are "
        "equal, so no step changes the weights",
    },
}


def evidence_note(stage: str, preset: str) -> str:
    """The preset's reason why `stage`'s evidence cannot improve in its run ('' when it should)."""
    return EVIDENCE_NOTES.get(preset, {}).get(stage, "")


_LARGE_PRETRAIN = dict(
    batch=dict(micro_batch_size=8, seq_len=2048, world_size=8, total_batch_tokens=524288),
    budget=dict(tokens_per_param=20.0),
    optim=dict(lr=6e-4, warmup_steps=700),
    eval=dict(every_steps=500, val_tokens=10_485_760),
    checkpoint=dict(every_steps=1000, keep_last=3),
)

# What the larger presets change on top: weights, grads and Adam states (16 bytes per parameter)
# no longer fit one GPU next to the activations, so they are sharded (FSDP2); 7b also recomputes
# activations per block (`ghostvis plan --preset 7b --gpu H100` shows the arithmetic).
_LARGE_PARALLEL: dict[str, dict[str, Any]] = {
    "1.5b": dict(parallel=dict(strategy="fsdp")),
    "7b": dict(parallel=dict(strategy="fsdp"), runtime=dict(grad_checkpointing=True)),
}


def tokenizer_vocab(preset: str) -> int:
    model_for(preset)  # validates the name
    return TOKENIZER_VOCAB[preset]


def preset_names() -> list[str]:
    return ["tiny", "smoke", *[m for m in MODELS if m != "tiny"]]


def _stage_defaults(stage: str, preset: str) -> dict[str, Any]:
    if preset in ("tiny", "smoke"):
        base = _TINY[stage]
        if preset == "smoke":
            steps = _SMOKE_STEPS[stage]
            base = {
                **base,
                "budget": dict(steps=steps),
                "eval": {**base.get("eval", {}), "every_steps": steps, "val_tokens": 4096, "samples": 4},
                "checkpoint": dict(every_steps=steps // 2),
                "batch": {**base["batch"], "micro_batch_size": max(1, base["batch"]["micro_batch_size"] // 2)},
                **_SMOKE_DELTAS.get(stage, {}),
            }
        return base
    if stage == "pretrain":
        return {**_LARGE_PRETRAIN, **_LARGE_PARALLEL.get(preset, {})}
    raise GhostvisError(f"stage '{stage}' has no defaults in preset '{preset}' yet")


def model_for(preset: str) -> dict[str, Any]:
    if preset not in preset_names():
        raise GhostvisError(f"unknown preset '{preset}'; choose one of: {', '.join(preset_names())}")
    return dict(MODELS["tiny" if preset == "smoke" else preset])


SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden")


@dataclass(frozen=True)
class TokenizerVocab:
    """The tokenizer a stage trains with: a fresh model's vocab_size is fitted to it, a continued one must match."""

    tokenizer_id: str
    size: int  # tokens, special ones included


@dataclass(frozen=True)
class RegisteredSources:
    """The ledger's shard records tokenized with the run's tokenizer: an empty recipe follows them, a recipe naming
    a source outside them is refused."""

    tokenizer_id: str
    shards: tuple[Any, ...]  # ShardRecord (ghostvis_core/data/ledger/records.py, a layer above this one)


def resolve(
    stage: str,
    preset: str = selected.DEFAULT_PRESET,
    overrides: dict[str, Any] | None = None,
    upstream: dict[str, Any] | None = None,
    vocab: TokenizerVocab | None = None,
    sources: RegisteredSources | None = None,
) -> StageConfig:
    """The one way a StageConfig is made: a frozen, validated tree nobody changes afterwards.

    Precedence, lowest first (each later input wins over the earlier ones):
    1. the dataclass defaults (config.py);
    2. the stage table (stages.py): objective and the default eval.evidence; init_from from the lineage;
    3. the preset's deltas for the stage; its model shape (model_for) only when nothing is inherited;
    4. the upstream model: `upstream` (the config.json of the checkpoint the stage starts from), else the
       upstream stage resolved with the same preset. The model, and the vision stack unless the preset declares
       one, are inherited; the preset's declared model changes (context_expansion's context) apply on top;
    5. dotted `overrides` (a run config's or `--set`, which win over the `--recipe` / `--val-sources` flags,
       merged into them by the caller); with `upstream` a model shape change is refused;
    6. what the run's data decides: `sources` fill an empty recipe (or replace a preset recipe naming none of
       them) and refuse a recipe naming unregistered ones; `vocab` sets a fresh model's vocab_size
       (a continued model must already match it);
    7. a run mode named as `preset`: its model preset and world size enter at steps 3 and 5 (an override of a key
       the mode derives is refused), and the validated config is priced: budget.steps = what its hours buy.
    """
    overrides = overrides or {}
    mode = run_modes.mode_of(preset)
    if mode:
        preset, overrides = mode.preset, run_modes.mode_base(mode, overrides)
    base = _base(stage, preset, upstream, init_source(stage, overrides))
    cfg = StageConfig.from_dict(apply_overrides(base, overrides))
    if upstream:
        _refuse_shape_change(cfg, upstream)
    if sources is not None:
        cfg = follow_registered_sources(cfg, sources, preset_recipe="data.recipe" not in overrides)
    if vocab is not None:
        cfg = fit_vocab(cfg, vocab, overrides, upstream)
    validate(cfg)
    return run_modes.priced(mode, cfg) if mode else cfg


def _base(stage: str, preset: str, upstream: dict[str, Any] | None, init_from: str | None) -> dict[str, Any]:
    """Steps 1-4 of `resolve` as a config dict, before any override (`init_from`: what the stage starts from)."""
    entry = stages.stage(stage)
    defaults = json.loads(json.dumps(_stage_defaults(stage, preset)))
    from_stage = init_from if init_from in stages.stage_names() else None
    inherited = upstream or (_preset_config(from_stage, preset, selected.lineage()).to_dict() if from_stage else None)
    model = dict(inherited["model"]) if inherited else model_for(preset)
    model.update(defaults.pop("model", {}))
    if inherited and inherited.get("vision") and "vision" not in defaults:
        defaults["vision"] = inherited["vision"]
    defaults.setdefault("eval", {}).setdefault("evidence", list(entry.evidence))
    return StageConfig.from_dict(
        {
            "stage": stage,
            "preset": preset,
            "objective": entry.objective,
            "init_from": init_from,
            "model": model,
            **defaults,
        }
    ).to_dict()


@functools.cache
def _preset_config(stage: str, preset: str, chain: lineage.Lineage) -> StageConfig:
    """A stage as its preset alone resolves it in the lineage `chain` (what a downstream stage inherits when no
    checkpoint is given): resolved once per process and lineage, which the frozen config makes safe to share."""
    return resolve(stage, preset)


def init_source(stage: str, overrides: dict[str, Any]) -> str | None:
    """The stage's init_from (a stage or a Hugging Face source) before resolution: the override, else the stage
    it starts from in the selected lineage (lineage.py). The launcher needs it to find the upstream checkpoint
    that resolution then inherits from."""
    if "init_from" in overrides:
        return apply_overrides({"init_from": None}, {"init_from": overrides["init_from"]})["init_from"]
    return selected.lineage().upstream(stage)


def follow_registered_sources(cfg: StageConfig, sources: RegisteredSources, preset_recipe: bool) -> StageConfig:
    """Fill an empty recipe / val_sources from the registered sources of the stage's kind (also when
    none of a preset's recipe sources is registered: the preset's recipe is for its own data); refuse
    a recipe of the user's that names sources nobody registered, and say which ones are."""
    kind, shards = stages.stage(cfg.stage).reads, sources.shards
    registered = {r.source for r in shards}
    data = cfg.data
    if preset_recipe and not registered & {s.source for s in data.recipe}:
        data = dataclasses.replace(data, recipe=(), val_sources=())
    train: dict[str, int] = {}
    for r in shards:
        if r.kind == kind and r.split == "train":
            train[r.source] = train.get(r.source, 0) + r.tokens
    if not data.recipe and train:
        total = sum(train.values())
        data = dataclasses.replace(data, recipe=tuple(SourceWeight(s, t / total) for s, t in sorted(train.items())))
    if not data.val_sources:
        chosen = {s.source for s in data.recipe}
        data = dataclasses.replace(
            data,
            val_sources=tuple(sorted({r.source for r in shards if r.split == "validation" and r.source in chosen})),
        )
    known = sorted(registered)
    missing = sorted({s for s in [*(s.source for s in data.recipe), *data.val_sources] if s not in known})
    if missing or not data.recipe:
        example = next(iter(sorted(train)), "my_source")
        raise GhostvisError(
            f"stage {cfg.stage}: "
            + (
                f"the recipe names source(s) {', '.join(missing)}, which are not registered"
                if missing
                else f"no {kind} source is registered"
            )
            + f" (sources tokenized with {sources.tokenizer_id}: {', '.join(known) or 'none'}); set the stage's recipe "
            f"to your sources (run config `recipe: {{{example}: 1.0}}` or `ghostvis train {cfg.stage} --recipe "
            f"{example}=1.0`), or register them in shard_manifest and backfill raw_shards and tokenized_shards"
        )
    return dataclasses.replace(cfg, data=data)


def padded_vocab(tokens: int) -> int:
    """The vocab_size a model is built with for a tokenizer of `tokens` tokens: padded to a multiple of 64."""
    return 64 * math.ceil(tokens / 64)


def vocabulary_note(tokenizer_id: str, tokens: int, preset: str) -> str | None:
    """Said where a tokenizer is made and where a model is sized: a trained tokenizer smaller than its preset
    plans (too little distinct text to learn that many merges), and the vocab_size a fresh model gets."""
    planned = tokenizer_vocab(run_modes.model_preset(preset))
    if tokens >= planned:
        return None
    return (
        f"tokenizer {tokenizer_id} has {tokens:,} tokens, fewer than the {planned:,} the {preset} preset plans (the "
        f"text holds too few distinct pairs to merge that often): a new model is built and priced with vocab_size "
        f"{padded_vocab(tokens):,} ({tokens:,} padded to 64); more text or the tokenizer asset's vocab_size changes it"
    )


def fit_vocab(
    cfg: StageConfig, vocab: TokenizerVocab, overrides: dict[str, Any], upstream: dict[str, Any] | None
) -> StageConfig:
    """A fresh model takes the tokenizer's vocabulary (padded to 64); a continued one must match it."""
    padded = padded_vocab(vocab.size)
    if upstream is None:
        if "model.vocab_size" in overrides and cfg.model.vocab_size != padded:
            raise GhostvisError(
                f"model.vocab_size={cfg.model.vocab_size} does not fit tokenizer {vocab.tokenizer_id} "
                f"({vocab.size} tokens, padded to {padded}); drop the override"
            )
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=padded))
    if cfg.model.vocab_size != padded:
        raise GhostvisError(
            f"stage {cfg.stage}: tokenizer {vocab.tokenizer_id} has {vocab.size} tokens (padded {padded}) but the "
            f"upstream {upstream['stage']} model has vocab_size {cfg.model.vocab_size}; the tokenizer changed since "
            f"that run — re-run the chain from pretrain with this tokenizer"
        )
    return cfg


def _refuse_shape_change(cfg: StageConfig, upstream: dict[str, Any]) -> None:
    changed = [
        f"model.{k}={getattr(cfg.model, k)} (upstream {upstream['stage']} has {upstream['model'][k]})"
        for k in SHAPE_FIELDS
        if getattr(cfg.model, k) != upstream["model"][k]
    ]
    if changed:
        raise GhostvisError(
            f"stage {cfg.stage}: {', '.join(changed)}; a stage starts from its upstream checkpoint and "
            "cannot change the model shape (drop the override, or retrain from pretrain)"
        )


def parse_recipe(text: str) -> dict[str, float]:
    """'web=0.7,code=0.3' (a --recipe flag) -> {'web': 0.7, 'code': 0.3}."""
    try:
        return {k.strip(): float(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise GhostvisError(
            f"--recipe {text!r}: expected source=weight,... e.g. web=0.6,books=0.15,code=0.25"
        ) from None


def data_overrides(recipe: dict[str, float], val_sources: list[str]) -> dict[str, Any]:
    """Dotted overrides for a recipe given as source -> weight (normalised to sum 1) and validation
    sources. No recipe leaves the preset's; a recipe without validation sources validates on those of
    its sources that have validation shards (the preset's validation sources belong to its recipe)."""
    out: dict[str, Any] = {}
    if recipe:
        total = sum(recipe.values())
        if total <= 0 or any(w <= 0 for w in recipe.values()):
            raise GhostvisError(f"recipe weights must be positive, got {recipe}")
        out["data.recipe"] = [{"source": s, "weight": w / total} for s, w in recipe.items()]
        out["data.val_sources"] = []
    if val_sources:
        out["data.val_sources"] = list(val_sources)
    return out


def validate(cfg: StageConfig) -> None:
    """What the types cannot say (enum-like fields were checked when the tree was built)."""
    check_ranges(cfg)
    b = cfg.batch
    if not 0 <= cfg.contamination.max_overlap <= 1:
        raise GhostvisError(
            f"contamination.max_overlap must be a share between 0 and 1 (0: any shared 13-gram "
            f"fails), got {cfg.contamination.max_overlap}"
        )
    for name in ("micro_batch_size", "seq_len", "world_size"):
        if getattr(b, name) <= 0:
            raise GhostvisError(f"batch.{name} must be positive, got {getattr(b, name)}")
    if b.seq_len > cfg.model.max_seq_len:
        raise GhostvisError(
            f"stage {cfg.stage}: batch.seq_len={b.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len} "
            "(the context the model was trained for); run context_expansion first or lower batch.seq_len"
        )
    if cfg.objective in ("vision_align",) and cfg.vision is None:
        raise GhostvisError(f"stage {cfg.stage}: objective {cfg.objective} needs a vision config")
    if cfg.objective == "grpo":
        validate_grpo(cfg)
    if cfg.objective == "dpo" and (cfg.dpo is None or cfg.init_from is None):
        raise GhostvisError(
            f"stage {cfg.stage}: dpo needs a dpo section and init_from (the starting policy, and "
            "the reference model unless dpo.loss is simpo)"
        )
    set_budget = [k for k in ("steps", "tokens", "tokens_per_param") if getattr(cfg.budget, k) is not None]
    if len(set_budget) != 1:
        raise GhostvisError(f"budget: set exactly one of steps, tokens, tokens_per_param (got {set_budget or 'none'})")
    total = sum(s.weight for s in cfg.data.recipe)
    if cfg.data.recipe and (abs(total - 1.0) > 1e-6 or any(s.weight <= 0 for s in cfg.data.recipe)):
        raise GhostvisError(
            "data.recipe weights must be positive and sum to 1, got "
            + ", ".join(f"{s.source}={s.weight}" for s in cfg.data.recipe)
        )


def validate_grpo(cfg: StageConfig) -> None:
    """A GRPO group never straddles micro-batches or sources, and prompt + completion fit a row."""
    g, b = cfg.grpo, cfg.batch
    if g is None or cfg.init_from is None:
        raise GhostvisError(f"stage {cfg.stage}: grpo needs a grpo section and init_from (the policy to start from)")
    if g.group_size < 2 or b.micro_batch_size % g.group_size:
        raise GhostvisError(
            f"stage {cfg.stage}: batch.micro_batch_size={b.micro_batch_size} must be a multiple of "
            f"grpo.group_size={g.group_size} (>= 2): each prompt's completions are rows of one micro-batch"
        )
    if not 0 < g.max_new_tokens < b.seq_len:
        raise GhostvisError(
            f"stage {cfg.stage}: grpo.max_new_tokens={g.max_new_tokens} must be positive and below "
            f"batch.seq_len={b.seq_len} (the row holds the prompt and the completion)"
        )
    if len(cfg.data.recipe) != 1:
        raise GhostvisError(
            f"stage {cfg.stage}: grpo reads one source of problems, the recipe has "
            f"{len(cfg.data.recipe)}; set data.recipe to one source"
        )
    if cfg.parallel.strategy != "ddp":
        raise GhostvisError(f"stage {cfg.stage}: grpo samples on each rank's whole model; set parallel.strategy=ddp")
