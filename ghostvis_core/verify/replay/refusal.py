"""The runs a replay cannot repeat bit for bit, refused by name instead of reported as a mismatch.

The replay runs on CPU in one process (steps.py): it repeats a CPU run's arithmetic exactly when the run's
gradients were combined by DDP over one or two ranks. It refuses
- a run trained on CUDA: GPU kernels (cuBLAS, flash attention) sum in other orders than the CPU's, so a CPU
  replay differs in the last bits and no tolerance would separate a small bug from that noise;
- FSDP (parallel.strategy=fsdp) on two or more ranks: gradients are reduce-scattered in shards and the
  optimizer steps on each rank's shard, saved as DCP; the replay repeats DDP's all-reduce only;
- more than two ranks: gloo's ring all-reduce adds three or more ranks' gradients chunk by chunk in an order
  the replay does not repeat (with two, a + b is the same either way);
- a run whose world size changed between resumes: each interval would need its own emulation;
- objectives whose step draws from the model itself or a second model (dpo's reference, rl's sampled
  rollouts), and float8 or compiled blocks, which the replay's model does not rebuild;
- asynchronous saves (checkpoint.async_save): DCP shards, where the replay compares safetensors checkpoints.
The Dagster check passes a refused run with its reason (nothing replayed is no fault of the run);
`ghostvis audit --replay K`, asked for a replay, exits 1 naming it.
"""

from __future__ import annotations

from ghostvis_core.verify.audit.invariants import StageRun

REPLAYABLE_OBJECTIVES = ("lm", "sft", "vision_align")
MAX_RANKS = 2


def refusal(run: StageRun) -> str | None:
    """Why the run cannot be replayed bit for bit (naming the setting to change), or None."""
    cfg, worlds = run.spec.config, sorted({p.world_size for p in run.chain})
    reasons = []
    if cfg.objective not in REPLAYABLE_OBJECTIVES:
        reasons.append(
            f"objective {cfg.objective}: its steps depend on a reference model or on sampled rollouts; the replay "
            f"repeats the objectives {', '.join(REPLAYABLE_OBJECTIVES)}"
        )
    if run.record.cuda_peak_memory_gb is not None:
        reasons.append("it trained on CUDA: a CPU replay differs in the last bits; replay a CPU run")
    if len(worlds) > 1:
        reasons.append(f"its segments trained on world sizes {worlds}: replay a run trained at one world size")
    elif worlds and worlds[0] > MAX_RANKS:
        reasons.append(
            f"it trained on {worlds[0]} ranks: gloo adds more than {MAX_RANKS} ranks' gradients in a ring order the "
            f"replay does not repeat; replay a run of at most {MAX_RANKS} ranks"
        )
    if cfg.parallel.strategy == "fsdp" and worlds and worlds[-1] > 1:
        reasons.append("parallel.strategy=fsdp: its sharded gradients and optimizer are not repeated; replay a ddp run")
    if cfg.checkpoint.async_save:
        reasons.append(
            "checkpoint.async_save: its checkpoints are DCP shards, the replay compares safetensors checkpoints; "
            "replay a run saved synchronously"
        )
    if cfg.runtime.float8 or cfg.runtime.compile == "on":
        reasons.append("float8 or compiled blocks (runtime.float8, runtime.compile=on) are not rebuilt by the replay")
    return "; ".join(reasons) or None
