"""Planted bugs for tests/test_audit.py: each is a one-line mutation of a real function's source,
applied in the process (never an edited file), so the checks are shown to fail on the bugs they
exist for. Run in the rank processes as

    torchrun --standalone --nproc_per_node=2 -m tests.planted <scenarios.json>

where the file lists scenarios, [{"name", "bugs": "<bug>[,<bug>]" or null, "args": [<`ghostvis prepare`
args: stage, --preset, --set>]}], each planned as `ghostvis prepare` plans it and run on its spec one after
another by the same rank processes (`run_scenarios`), or in-process with
`plant(bug, setter)` (e.g. pytest's monkeypatch.setattr). A mutation whose anchor text is no longer in
the function fails loudly: update the anchor, not the check.
"""

from __future__ import annotations
import __future__

import argparse
import importlib
import inspect
import json
import os
import sys
import textwrap

REDUCED = "s.counts = s.counts + TokenCounts.from_list(reduced[1:])"
GATHER = "gathered = gather_objects((c.pieces, c.counts, c.rows, part.fed.records(*ids)), self.ctx)"

# the token figures divided by the step, except at the last step: the first step's figures, repeated
STALE = "s.counts if s.step == self.total_steps else TokenCounts.from_list([x // s.step for x in s.counts.as_list()])"

# bug -> [(module, function or Class.method, anchor text, replacement)]
BUGS: dict[str, list[tuple[str, str, str, str]]] = {
    # the trainer's figures (MLflow, run record, metadata) summed on rank 0 only; the ledger right
    "rank0_counters": [
        ("ghostvis_core.run.train.trainer", "Trainer.account_step", REDUCED, "s.counts = s.counts + step_counts")
    ],
    # rank 0 only everywhere: also the ledger part takes rank 0's pieces, counts and rows only
    "rank0_everywhere": [
        ("ghostvis_core.run.train.trainer", "Trainer.account_step", REDUCED, "s.counts = s.counts + step_counts"),
        ("ghostvis_core.run.train.checkpoint_manager", "CheckpointManager.commit", GATHER, GATHER + "[:1]"),
    ],
    # only the last micro-batch of a step counted (figures and consumption)
    "last_micro_batch_only": [
        (
            "ghostvis_core.run.train.trainer",
            "Trainer.account_step",
            "step_counts = TokenCounts.total(b.counts for b in batches)",
            "step_counts = batches[-1].counts",
        ),
        (  # the micro-batch is still fed (digests, rollouts) but only the last one's consumption is recorded
            "ghostvis_core.run.train.trainer",
            "Trainer.train_step",
            "            self.part.feed(s.step + 1, b)\n",
            "            self.part.feed(s.step + 1, b) if m == len(batches) - 1 else "
            "(self.part.fed.expect(s.step + 1, b), self.part.rollouts.add(s.step + 1, b))\n",
        ),
    ],
    # micro-batch 0 trained and counted twice (in place of micro-batch 1)
    "micro_batch_0_twice": [
        (
            "ghostvis_core.run.train.objectives",
            "Objective.step_batches",
            "micro_batch_rows(first_row, m, rank, plan)",
            "micro_batch_rows(first_row, max(0, m - 1), rank, plan)",
        )
    ],
    # a resume rewinds the loader to the start of the current shard (row 0: the smoke run is in each
    # source's first shard)
    "resume_rewinds": [
        (
            "ghostvis_core.run.train.setup",
            "_starting_state",
            "        return checkpoints.load_model(resume, model)\n",
            "        state = checkpoints.load_model(resume, model)\n"
            "        state.loader.rows = 0\n"
            "        return state\n",
        )
    ],
    # the last ledger part is never published to the store's ledger
    "last_part_unpublished": [
        (
            "ghostvis_core.run.train.checkpoint_manager",
            "CheckpointManager._save_and_publish",
            "        self.publish_parts(only=path)\n",
            "        if step < self.spec.plan.steps:\n            self.publish_parts(only=path)\n",
        )
    ],
    # the split filter dropped: validation shards selected for training
    "split_filter_dropped": [
        ("ghostvis_core.launch.start", "select_shards", "        if r.split != split:\n            continue\n", "")
    ],
    # the source's validation shards merged into its train stream under a `train` label
    "validation_merged_into_train": [
        (
            "ghostvis_core.run.train.objectives",
            "Objective.__init__",
            "{s.source: spec.train_shards[s.source] for s in recipe}",
            "{s.source: spec.train_shards[s.source] + tuple(ShardRef(**{**r.__dict__, 'split': 'train'}) for r in "
            "spec.val_shards.get(s.source, ())) for s in recipe}",
        )
    ],
    # a row recorded as consumed but never trained: every row 2 mod 4 is fed row 3's content in its place
    # (row 3 trained twice); the rows, pieces and counts recorded are the plan's
    "row_fed_in_place_of_another": [
        (
            "ghostvis_core.data.loader",
            "Batcher.batch",
            "inputs=torch.from_numpy(np.stack([r.inputs for r in got])),\n"
            "            targets=torch.from_numpy(np.stack([r.targets for r in got])),",
            "inputs=torch.from_numpy(np.stack([self.row(g + (g % 4 == 2)).inputs for g in rows])),\n"
            "            targets=torch.from_numpy(np.stack([self.row(g + (g % 4 == 2)).targets for g in rows])),",
        )
    ],
    # the ranks' row offsets swapped in the shared row arithmetic: each rank reads the other's rows, the
    # totals and ranges are unchanged
    "ranks_swapped": [
        (
            "ghostvis_core.data.loader",
            "micro_batch_rows",
            "(micro * plan.world_size + rank)",
            "(micro * plan.world_size + (plan.world_size - 1 - rank))",
        )
    ],
    # lm targets equal to the inputs (the model learns to copy, not to predict): every count is unchanged
    "targets_are_inputs": [
        (
            "ghostvis_core.data.loader",
            "LMRows.row",
            "return Row(t[:-1], t[1:], pieces, real=L, pad=0)",
            "return Row(t[:-1], t[:-1].copy(), pieces, real=L, pad=0)",
        )
    ],
    # sft: loss on every token of a chat, not only the assistant's
    "chat_mask_ignored": [
        (
            "ghostvis_core.data.loader",
            "ChatRows.row",
            "tgt = np.where(mask[1:n] > 0, ids[1:n], IGNORE_INDEX)",
            "tgt = ids[1:n]",
        )
    ],
    # sft: packed chats attend to each other (every position in document 0); every count is unchanged
    "chat_doc_ids_dropped": [
        ("ghostvis_core.data.loader", "ChatRows.row", "doc_ids[pos : pos + n] = slot", "doc_ids[pos : pos + n] = 0")
    ],
    # images fed to the wrong rows: a micro-batch's images rotated by one
    "images_rotated": [
        (
            "ghostvis_core.data.loader",
            "Batcher.batch",
            "images=[im for r in got for im in r.images],",
            "images=[im for r in got for im in r.images][1:] + [im for r in got for im in r.images][:1],",
        )
    ],
    # MLflow's token chart stays at the first step's figures until the last point, which is right
    # (a chart reading 512, 512, 512, 2048)
    "mlflow_history_stale": [
        (
            "ghostvis_core.run.train.trainer",
            "Trainer.token_metrics",
            "**s.counts.as_metrics(),",
            f"**({STALE}).as_metrics(),",
        )
    ],
    # the model trains on the rows after the planned ones, while the ledger records the planned rows and the
    # input hook digests the planned batch: every record is the plan's, only the weights differ
    "fed_other_rows_than_recorded": [
        (
            "ghostvis_core.run.train.trainer",
            "Trainer.train_step",
            "loss_sum = self.objective.loss_sum(self.parallel.forward_module, b, ctx.device)",
            "loss_sum = self.objective.loss_sum(self.parallel.forward_module, "
            "self.objective.batcher.batch([g + 1 for g in b.rows]), ctx.device)",
        ),
        (
            "ghostvis_core.run.train.feeds",
            "FedLog.received",
            "got = Received((_host(inputs), _host(targets), _host(doc_ids)))",
            "got = Received((_host(batch.inputs), _host(batch.targets), _host(batch.doc_ids)))",
        ),
    ],
    # step 3's optimizer step skipped (its gradients computed and dropped); every count and record unchanged
    "optimizer_step_skipped_once": [
        (
            "ghostvis_core.run.train.trainer",
            "Trainer.train_step",
            "        self.optimizer.step()\n",
            "        self.optimizer.step() if s.step != 2 else None\n",
        )
    ],
    # step 1's second micro-batch on rank 0 trained with 1.5 x its loss; the logged loss and counts unchanged
    "one_micro_batch_loss_scaled": [
        (
            "ghostvis_core.run.train.trainer",
            "Trainer.train_step",
            "(loss_sum * scale.to(loss_sum.dtype)).backward()",
            "(loss_sum * scale.to(loss_sum.dtype) * (1.5 if (s.step, m, ctx.rank) == (0, 1, 0) else 1.0)).backward()",
        )
    ],
    # not a bug: the run stops (every rank) right after its first checkpoint, to be resumed
    "stop_after_first_checkpoint": [
        (
            "ghostvis_core.run.train.trainer",
            "Trainer.commit",
            "        self.part = self._new_part()\n",
            "        __import__('os')._exit(3)\n",
        )
    ],
}


def mutate(module: str, qualname: str, edits: list[tuple[str, str]], setter=setattr) -> None:
    """Re-define `module.qualname` from its source with each (anchor, replacement) of `edits` applied,
    and rebind every module that imported the old function by name."""
    mod = importlib.import_module(module)
    owner = mod
    for name in qualname.split(".")[:-1]:
        owner = getattr(owner, name)
    name = qualname.split(".")[-1]
    old = getattr(owner, name)
    source = inspect.getsource(old)
    for anchor, replacement in edits:
        if source.count(anchor) != 1:
            raise AssertionError(f"planted bug: {anchor!r} is not once in {module}.{qualname}; update tests/planted.py")
        source = source.replace(anchor, replacement)
    code = compile(
        textwrap.dedent(source),
        f"<planted {module}.{qualname}>",
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    local: dict = {}
    exec(code, vars(mod), local)
    new = local[name]
    setter(owner, name, new)
    for other in list(sys.modules.values()):
        for attr, value in list(vars(other).items()) if other is not None else []:
            if value is old and other is not owner:
                setter(other, attr, new)


def plant(bugs: str, setter=setattr) -> None:
    """Apply the named bugs (comma-separated keys of BUGS); edits of one function are applied together."""
    by_function: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for bug in bugs.split(","):
        for module, qualname, anchor, replacement in BUGS[bug]:
            by_function.setdefault((module, qualname), []).append((anchor, replacement))
    for (module, qualname), edits in by_function.items():
        mutate(module, qualname, edits, setter=setter)


def scenario_spec(args: list[str], key: str, store, rank: int) -> list[str]:
    """The scenario's `ghostvis prepare` arguments planned on rank 0, as `ghostvis prepare` plans them (this harness
    is the run's launcher as well as its ranks), into the job's `--spec URI`, which the other ranks read from
    torchrun's store under `key`; a refusal ends the scenario on every rank."""
    if rank == 0:
        from ghostvis_core.errors import GhostvisError
        from ghostvis_core.launch.start import prepare_run
        from ghostvis_core.plan.config import parse_sets
        from ghostvis_core.store import open_store

        prepare = argparse.ArgumentParser(prog="ghostvis prepare")
        prepare.add_argument("stage")
        prepare.add_argument("--preset", required=True)
        prepare.add_argument("--set", dest="sets", action="append", default=[])
        asked = prepare.parse_args(args)
        try:
            spec = prepare_run(asked.stage, preset=asked.preset, overrides=parse_sets(asked.sets))
            told = open_store(spec.store).uri_of("run_spec", spec.stage, spec.run_key)
        except GhostvisError as exc:
            told = f"error: {exc}"
        store.set(key, told)
    told = store.get(key).decode()
    if told.startswith("error: "):
        raise SystemExit(f"scenario not planned: {told}")
    return ["--spec", told]


def run_scenarios(scenarios: list[dict]) -> int:
    """Each scenario's training run in turn, in this rank process, with its bugs planted for that run only
    (undone before the next): one launch pays torch's, MLflow's and transformers' imports once for all of
    them. Rank 0 plans each run (`scenario_spec`) and prints `scenario <name>` before it, so its output names
    which run is whose. The first run that fails ends the launch with its exit code.

    Each run gets a process group of its own, its keys under their own prefix of torchrun's store: the ranks
    leave a run at different times (rank 0 goes on to register the model), and a group made again on the
    same keys would meet the last run's stale addresses. The run's own setup finds the group made."""
    import pytest
    import torch.distributed as dist

    import ghostvis_core.launch.start  # noqa: F401  (what the mutations patch must be imported first)
    import ghostvis_core.run.train.loop  # noqa: F401
    from ghostvis_core.run.__main__ import main

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for i, scenario in enumerate(scenarios):
        args = scenario_spec(scenario["args"], f"scenario-{i}-spec", store, rank)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"scenario-{i}", store), rank=rank, world_size=world)
        if rank == 0:
            print(f"scenario {scenario['name']}", flush=True)
        with pytest.MonkeyPatch.context() as patches:
            if scenario["bugs"]:
                plant(scenario["bugs"], setter=patches.setattr)
            code = main(args)
        if code:
            return code
    return 0


if __name__ == "__main__":
    assert len(sys.argv) == 2, "usage: -m tests.planted <scenarios.json>"
    sys.exit(run_scenarios(json.loads(open(sys.argv[1]).read())))
