"""Typed configuration: one frozen dataclass per component, one tree per stage run.

A `StageConfig` is made only by `presets.resolve` (defaults here, the stage table, a preset's deltas, the upstream
checkpoint's model, dotted overrides such as `batch.micro_batch_size=8`, the tokenizer's vocabulary and the registered
sources), validated there, and never changed afterwards (`dataclasses.replace` makes a new one). Enum-like fields are
`Literal`s, checked when the tree is built. It is saved as JSON next to every checkpoint and in the launch spec.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from ghostvis_core.errors import GhostvisError

# What a stage trains for: a key of ghostvis_core.run.train.objectives.OBJECTIVES.
Objective = Literal["lm", "vision_align", "sft", "dpo", "grpo"]
# What a stage's evaluation measures besides its held-out loss (ghostvis_core/run/train/evidence.py measures each).
Evidence = Literal["domain_loss", "beyond_context_loss", "reasoning", "caption_image_gap", "reply_endings", "reward"]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    max_seq_len: int
    rope_base: float = 10000.0
    # Position interpolation factor for context expansion: positions are divided by it.
    rope_scaling: float = 1.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # Biases on the q, k and v projections (Qwen2's attention; exported as Qwen2ForCausalLM).
    qkv_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class VisionConfig:
    """Vision encoder (frozen) + perceiver resampler + MLP projector (trained in vision_alignment)."""

    image_size: int = 32
    patch_size: int = 4
    d_vision: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_latents: int = 16
    resampler_layers: int = 2
    # Local SigLIP checkpoint directory (used through transformers when installed); None = tiny ViT.
    encoder_path: str | None = None


@dataclass(frozen=True)
class BatchConfig:
    micro_batch_size: int
    seq_len: int
    world_size: int = 1
    grad_accum_steps: int | None = None
    # Alternative to grad_accum_steps: the tokens one optimizer step must see; grad_accum is derived.
    total_batch_tokens: int | None = None


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # adamw, or muon: Muon (Nesterov momentum, update orthogonalized by Newton-Schulz) for the hidden
    # weight matrices at peak muon_lr, AdamW (the settings above) for embeddings, head, norms and biases;
    # the schedule scales both lrs alike (ghostvis_core/run/train/muon.py).
    name: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95


@dataclass(frozen=True)
class BudgetConfig:
    """Exactly one of steps, tokens, tokens_per_param decides planned_tokens."""

    steps: int | None = None
    tokens: int | None = None
    tokens_per_param: float | None = None


@dataclass(frozen=True)
class SourceWeight:
    source: str
    weight: float = 1.0


@dataclass(frozen=True)
class DataConfig:
    # Empty recipe: every registered source of the stage's kind (stages.py `reads`), weighted by its
    # train tokens; empty val_sources: those of the recipe's sources that have validation shards.
    recipe: tuple[SourceWeight, ...] = ()
    val_sources: tuple[str, ...] = ()
    # Sources a stage replays from its lineage on purpose (shown as declared replay, not reuse).
    replay_sources: tuple[str, ...] = ()
    allow_repeat: bool = False
    seed: int = 1337


@dataclass(frozen=True)
class EvalConfig:
    every_steps: int = 50
    val_tokens: int = 16384
    # Evidence this stage must show, measured before (step 0) and after training on held-out data;
    # the stage table (stages.py) gives the default.
    evidence: tuple[Evidence, ...] = ()
    samples: int = 16  # held-out prompts sampled for generation-based evidence
    sample_max_tokens: int = 48


@dataclass(frozen=True)
class DPOConfig:
    # The preference loss (TRL's definitions; formulas in train/objectives.py DPOObjective): sigmoid (DPO),
    # ipo, simpo (reference-free: length-averaged log-probs and a target margin) or sft_dpo (DPO plus an
    # NLL term on the chosen response).
    loss: Literal["sigmoid", "ipo", "simpo", "sft_dpo"] = "sigmoid"
    # The strength of the implicit reward (every loss; for ipo 1/(2 beta) is the margin it regresses to).
    beta: float = 0.1
    # simpo: the target reward margin (TRL's simpo_gamma; gamma / beta is SimPO's gamma_beta_ratio).
    gamma: float = 0.5
    # sft_dpo: the weight of the chosen response's mean token NLL (TRL's rpo_alpha).
    alpha: float = 1.0


@dataclass(frozen=True)
class GRPOConfig:
    """The rl stage's group-relative policy optimisation (ghostvis_core/run/train/grpo.py)."""

    group_size: int = 4  # completions sampled per prompt; rows 0..G-1 of a group share the prompt
    max_new_tokens: int = 48  # a completion's length bound (each generated token is accounted)
    temperature: float = 1.0
    kl_beta: float = 0.0  # weight of the KL term to the frozen upstream model (0: no reference loaded)
    # Advantages as TRL's scale_rewards: `group` divides reward minus group mean by the group's standard deviation
    # (GRPO); `none` keeps reward minus group mean (Dr. GRPO): a group that differs only by the small format reward
    # then moves the weights a tenth as much as one that differs by an exact answer, not as much.
    scale_rewards: Literal["group", "none"] = "group"
    # How the policy reads a problem's question line: `chat` as a user turn of the chat template, answered after
    # the assistant marker (a policy tuned on chats, as the lineage's dpo model); `text` as the document's own
    # tokens (a base model trained on such documents).
    prompt: Literal["chat", "text"] = "chat"
    # End a completion also at the newline that closes a well-formed answer line (data/problems.py
    # `closes_answer_line`): a policy that writes the answer line and runs on earns no format reward (the answer
    # line must be the last); stopped there, the line it reached is the last. Off: a stop token or max_new_tokens.
    stop_at_answer: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 100
    keep_last: int = 2
    # Write the weights and optimizer state as DCP shards (every rank its own, whatever the strategy) in
    # a background thread while training continues; the checkpoint is committed (marker last) once every
    # shard is written, before the next checkpoint or the end of the run.
    async_save: bool = False
    # Also checkpoint once this many minutes passed since the last checkpoint (0: by steps only), decided by all
    # ranks together at a step boundary (rank 0's clock): long runs lose at most this much to a crash.
    every_minutes: float = 0.0


# The stop signals of runtime.preempt_grace_s: torchrun passes them on to its ranks
# (launch/cluster/torchrun_command.py), which take each as a preemption (run/train/preemption.py). torchrun's own
# default list lacks SIGUSR1 and SIGUSR2 (they killed it: exit -10) and holds SIGHUP and SIGQUIT, which stay a
# plain stop (a lost terminal, a core dump).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


@dataclass(frozen=True)
class RuntimeConfig:
    # auto: bf16 autocast on CUDA and on CPUs with bf16 matrix instructions (AMX / AVX512-BF16).
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    # Recompute each transformer block in the backward pass instead of keeping its activations.
    grad_checkpointing: bool = False
    # torch.compile each block: auto = on CUDA, off on CPU (compilation costs more than it saves there).
    compile: Literal["auto", "on", "off"] = "auto"
    # float8 matmuls in the decoder's Linear layers (torchao, train/float8.py): ~+20% tokens/s on H100-class
    # GPUs (compute capability >= 8.9); the trainer refuses it elsewhere. Weights, optimizer state and
    # checkpoints stay in high precision.
    float8: bool = False
    log_every_steps: int = 5
    # A rank that finishes no step for this many seconds ends the job, naming itself, its host, its last step
    # and the collective it waits in, and which rank stopped beating (train/watchdog.py); it is also the
    # process group's collective timeout. 0: no watchdog and torch's default timeout.
    hang_timeout_s: float = 600.0
    # A launch's lease on its run identity (ghostvis_core/store/lease.py) is taken over by another launch once its
    # heartbeat is older than this; its holder stops when its own renewal is half that old, and every commit it
    # makes is fenced by the lease's generation (ghostvis_core/store/fence.py).
    lease_expiry_s: float = 60.0
    # Seconds between a stop signal (SIGTERM, SIGINT, SIGUSR1, SIGUSR2: preemption, eviction, a time limit,
    # Ctrl-C) and the kill. torchrun waits this long for its ranks (--shutdown-timeout), Slurm signals this long
    # before the time limit (--signal) and a pod gets this long to stop (terminationGracePeriodSeconds): the
    # step in flight, the checkpoint commit and what follows it must fit (train/preemption.py).
    preempt_grace_s: float = 120.0


@dataclass(frozen=True)
class ParallelConfig:
    # ddp: every rank holds the whole model, gradients all-reduced; safetensors checkpoints by rank 0.
    # fsdp: FSDP2 shards weights, gradients and optimizer state over the ranks (per block and root);
    # each rank writes its shard of a torch.distributed.checkpoint (DCP) checkpoint.
    strategy: Literal["ddp", "fsdp"] = "ddp"


@dataclass(frozen=True)
class ContaminationConfig:
    # The decontamination gate (check no_eval_contamination, ghostvis_core/verify/audit/contamination.py): a
    # consumed training document and an evaluation item are contaminated when the 13-gram fingerprints
    # they share are more than this share of the smaller one's fingerprints (the overlap coefficient);
    # 0 fails on any shared fingerprint, as GPT-3 and Marin do.
    max_overlap: float = 0.5
    # Evaluation sets checked besides the known ones (validation shards, the shipped lm-eval tasks, the
    # benchmark and demo prompts): JSON Lines or Parquet files or folders of them (e.g. a harness_include
    # folder); one item per line or row: its string fields, plus choices[answer] for a multiple-choice
    # item. An item shorter than 13 words is matched whole (ghostvis_core/data/short_items.py).
    eval_sets: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageConfig:
    stage: str
    preset: str
    objective: Objective
    model: ModelConfig
    batch: BatchConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    contamination: ContaminationConfig = field(default_factory=ContaminationConfig)
    vision: VisionConfig | None = None
    dpo: DPOConfig | None = None
    grpo: GRPOConfig | None = None
    # What initialises this stage: an upstream stage's name (its final checkpoint), or a Hugging Face
    # Llama / Qwen2 checkpoint with its tokenizer: a local folder, s3://bucket/prefix or
    # hf://org/name[@revision] (ghostvis_core.run.hf.checkpoint_sources); None: random init.
    init_from: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape (lists, not tuples): what config.json, the launch spec and the run identity hold."""
        return json.loads(self.to_json())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageConfig:
        return _build(cls, data, "config")


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'batch': {'seq_len': 256}} -> {'batch.seq_len': 256} (MLflow params, Dagster metadata)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            out[name] = ",".join(":".join(str(v) for v in item.values()) for item in value)
        else:
            out[name] = value
    return out


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys in a nested dict; an unknown key is an error naming the valid ones."""
    data = json.loads(json.dumps(data))
    for dotted, value in overrides.items():
        node = data
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                where = ".".join(parts[:i]) or "config"
                valid = sorted(node) if isinstance(node, dict) else []
                raise GhostvisError(
                    f"unknown config key '{dotted}': '{part}' is not in {where} (valid keys there: {', '.join(valid)})"
                )
            if i == len(parts) - 1:
                node[part] = _parse_value(value)
            else:
                if node[part] is None:
                    raise GhostvisError(f"config key '{dotted}': section '{part}' is not set for this stage")
                node = node[part]
    return data


def parse_sets(items: list[str]) -> dict[str, str]:
    """`--set key=value` flags -> dotted overrides."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise GhostvisError(f"--set {item!r}: expected key=value, e.g. --set budget.steps=100")
        out[key] = value
    return out


def _parse_value(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _build(tp: Any, data: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise GhostvisError(f"config {path}: expected a mapping, got {data!r}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise GhostvisError(
                f"config {path}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}"
            )
        kwargs = {k: _build(hints[k], v, f"{path}.{k}") for k, v in data.items()}
        try:
            return tp(**kwargs)
        except TypeError as exc:
            raise GhostvisError(f"config {path}: {exc}") from None
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if data is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _build(inner[0], data, path)
    if origin is tuple:
        if not isinstance(data, (list, tuple)):
            raise GhostvisError(f"config {path}: expected a list, got {data!r}")
        return tuple(_build(args[0], item, f"{path}[{i}]") for i, item in enumerate(data))
    if origin is Literal:
        if data not in args:
            key, example = path.removeprefix("config."), args[0]
            if key.endswith("]"):  # an item of a list: the example sets the whole list
                key, example = key[: key.rindex("[")], json.dumps([args[0]])
            raise GhostvisError(
                f"config {path}: {data!r} is not one of {', '.join(map(str, args))}; set one of them "
                f"(e.g. --set {key}={example})"
            )
        return data
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)) or not math.isfinite(data):
            raise GhostvisError(f"config {_key(path)}: expected a finite number, got {data!r}; {_example(path, tp)}")
        return float(data)
    if tp in (int, str, bool) and not isinstance(data, tp) or (tp is int and isinstance(data, bool)):
        raise GhostvisError(f"config {_key(path)}: expected {tp.__name__}, got {data!r}; {_example(path, tp)}")
    return data


# What the types cannot say about single values: the range each numeric key must be in, as
# (test, what the test asks, an example). One table, checked by `check_ranges` when a tree is resolved.
RANGES: dict[str, tuple[typing.Callable[[float], bool], str, str]] = {
    "optim.lr": (lambda v: v > 0, "above 0", "3e-3"),
    "optim.muon_lr": (lambda v: v > 0, "above 0", "0.02"),
    "optim.min_lr_ratio": (lambda v: 0 <= v <= 1, "between 0 and 1", "0.1"),
    "optim.warmup_steps": (lambda v: v >= 0, "0 or more", "10"),
    "optim.weight_decay": (lambda v: v >= 0, "0 or more", "0.1"),
    "optim.beta1": (lambda v: 0 <= v < 1, "in [0, 1)", "0.9"),
    "optim.beta2": (lambda v: 0 <= v < 1, "in [0, 1)", "0.95"),
    "optim.muon_momentum": (lambda v: 0 <= v < 1, "in [0, 1)", "0.95"),
    "optim.grad_clip": (lambda v: v >= 0, "0 (off) or more", "1.0"),
    "budget.steps": (lambda v: v > 0, "above 0", "100"),
    "budget.tokens": (lambda v: v > 0, "above 0", "1000000"),
    "budget.tokens_per_param": (lambda v: v > 0, "above 0", "20"),
    "batch.grad_accum_steps": (lambda v: v > 0, "above 0", "1"),
    "batch.total_batch_tokens": (lambda v: v > 0, "above 0", "65536"),
    "eval.every_steps": (lambda v: v > 0, "above 0", "50"),
    "eval.val_tokens": (lambda v: v > 0, "above 0", "16384"),
    "checkpoint.every_steps": (lambda v: v > 0, "above 0", "100"),
    "checkpoint.keep_last": (lambda v: v > 0, "above 0", "2"),
    "runtime.log_every_steps": (lambda v: v > 0, "above 0", "5"),
}


def check_ranges(cfg: StageConfig) -> None:
    """Every set key of RANGES within its range; the message names the key, the range and a value to set."""
    values = flatten(cfg.to_dict())
    for key, (ok, wanted, example) in RANGES.items():
        value = values.get(key)
        if value is not None and not ok(value):
            raise GhostvisError(f"config {key}: {value!r} is not {wanted}; set it, e.g. --set {key}={example}")


def _key(path: str) -> str:
    """The dotted key of a path in the tree, as --set spells it ("config.optim.lr" -> "optim.lr")."""
    return path.removeprefix("config.")


def _example(path: str, tp: type) -> str:
    """The fix for a value of the wrong type: the key's example from RANGES, else one of its type."""
    key = _key(path)
    generic = {float: "1.0", int: "1", bool: "true", str: "name"}[tp]
    return f"set it, e.g. --set {key}={RANGES[key][2] if key in RANGES else generic}"
