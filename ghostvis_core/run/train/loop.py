"""The training loop shared by every stage, top to bottom: `setup` builds the Trainer (resumed from its
newest committed checkpoint, if any), then one optimizer step, its progress line, the held-out evaluation
and the checkpoint repeat until the budget's last step (or a preemption: train/preemption.py; a hang ends the
job from the watchdog: train/watchdog.py), and `finish` writes the RunResult. Each step is a
Trainer method (trainer.py); the checkpoints are its CheckpointManager's (checkpoint_manager.py)."""

from __future__ import annotations

from ghostvis_core.run.train.dist import DistContext
from ghostvis_core.run.train.setup import setup
from ghostvis_core.run.train.timeline import COMPLETED, end_reason
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.run_result import RunResult
from ghostvis_core.store.lease import Lease


def train(spec: LaunchSpec, ctx: DistContext, lease: Lease | None = None) -> RunResult:
    """Train a stage to its last step (resuming where its newest checkpoint left off); `lease`: rank 0's hold on
    the run identity, which fences its commits (setup.setup)."""
    trainer = setup(spec, ctx, lease)
    try:
        trainer.begin()
        trainer.timeline.training()
        while trainer.state.step < trainer.total_steps:
            trainer.train_step()
            metrics = trainer.progress()
            metrics.update(trainer.evaluate())
            trainer.log(metrics)
            trainer.checkpoint()  # also raises Preempted, once its checkpoint is committed
    except BaseException as exc:
        trainer.timeline.end_safely(trainer.store, end_reason(exc), trainer.state.step)
        raise
    finally:
        trainer.watchdog.stop()
        trainer.preemption.restore()
    result = trainer.finish()
    trainer.timeline.end_safely(trainer.store, COMPLETED, trainer.state.step)
    return result
