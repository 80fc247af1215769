"""The content proof (issue 24): the digest format, and the audit's own row rule against the loader's.

The audit rebuilds every row from the token files with code of its own (ghostvis_core/verify/audit/rebuild.py);
these tests hold the two implementations to the same rows, position by position, for every stage of the
demo, so a difference is a bug in one of them, found here rather than as a failed check.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from ghostvis_core import digest
from ghostvis_core.home import Home
from ghostvis_core.plan.stages import stage_names
from ghostvis_core.verify.audit.rebuild import Mixture, PlannedRows, micro_rows


def test_the_digest_format_is_blake2b_of_little_endian_int64_as_documented():
    inputs, targets, doc_ids = np.array([5, 6, 7]), np.array([6, 7, -1]), np.array([0, 0, 1])
    raw = np.array([5, 6, 7, 6, 7, -1], dtype="<i8").tobytes()
    assert digest.row_digest(inputs, targets) == hashlib.blake2b(raw, digest_size=8).hexdigest()
    with_docs = raw + np.array([0, 0, 1], dtype="<i8").tobytes()
    assert digest.row_digest(inputs, targets, doc_ids) == hashlib.blake2b(with_docs, digest_size=8).hexdigest()
    assert digest.image_hash(b"png") == hashlib.sha256(b"png").hexdigest()[:16]
    a, b = digest.row_digest(inputs, targets), digest.row_digest(targets, inputs)
    assert (
        digest.micro_digest([a, b], ["00ff00ff00ff00ff"])
        == hashlib.blake2b(
            bytes.fromhex(a) + bytes.fromhex(b) + bytes.fromhex("00ff00ff00ff00ff"), digest_size=8
        ).hexdigest()
    )
    assert digest.step_digest([a, b]) == hashlib.blake2b(bytes.fromhex(a + b), digest_size=8).hexdigest()
    assert digest.row_digest(inputs, targets) != digest.row_digest(inputs, np.array([6, 7, 8]))


def test_the_audit_mixture_gives_each_source_its_share_and_agrees_with_the_loader():
    from ghostvis_core.plan.mixture import MixtureSchedule

    audit, loader = Mixture([0.7, 0.2, 0.1]), MixtureSchedule([0.7, 0.2, 0.1])
    assert audit.counts == [700, 200, 100]
    assert audit.rows_before(1000) == [700, 200, 100] and audit.rows_before(2500) == [1750, 500, 250]
    assert [audit.locate(g) for g in range(3000)] == [loader.locate(g) for g in range(3000)]
    thirds = Mixture([1, 1, 1])  # 1000 / 3: the remainder row goes to the first source
    assert thirds.counts == [334, 333, 333]


def test_micro_batch_rows_tile_a_step_once_across_ranks():
    per_step = 2 * 3 * 2  # micro_batch_size 2, world 3, grad_accum 2
    rows = sorted(g for m in range(2) for r in range(3) for g in micro_rows(per_step, m, r, 2, 3))
    assert rows == list(range(per_step, 2 * per_step))
    assert micro_rows(0, 1, 2, 2, 3) == [10, 11]


@pytest.mark.e2e
@pytest.mark.parametrize("stage", stage_names())
def test_the_audit_rebuilds_exactly_the_rows_the_loader_builds(demo_home, stage):
    """Every row a smoke run of the stage reads (and a stretch beyond, into later epochs for the small
    chat, preference and caption sources): inputs, targets, document ids, images and spans equal."""
    from ghostvis_core.run.launch import prepare_run
    from ghostvis_core.run.train.objectives import build_objective

    h = Home(demo_home)
    spec = prepare_run(stage, preset="smoke", home=h)
    loader = build_objective(spec, spec.config).batcher
    audit = PlannedRows(h.store, spec.to_dict())
    n_rows = spec.plan.steps * spec.plan.batch.rows_per_step
    for g in range(0, 3 * n_rows + 7):
        want, got = loader.row(g), audit.row(g)
        assert np.array_equal(want.inputs, got.inputs) and np.array_equal(want.targets, got.targets), (stage, g)
        assert (want.doc_ids is None) == (got.doc_ids is None), (stage, g)
        assert want.doc_ids is None or np.array_equal(want.doc_ids, got.doc_ids), (stage, g)
        assert want.images == got.images, (stage, g)
        assert [(p.shard_id, p.epoch, p.tok_start, p.tok_end) for p in want.pieces] == list(got.spans), (stage, g)
