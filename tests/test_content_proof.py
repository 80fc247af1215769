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
    pixels = np.arange(12, dtype=np.float32).reshape(3, 2, 2) / 11
    raw_pixels = np.array([3, 2, 2], dtype="<i8").tobytes() + pixels.astype("<f4").tobytes()
    assert digest.image_digest(pixels) == hashlib.blake2b(raw_pixels, digest_size=8).hexdigest()
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


# ---- the digest is taken at the model's input (issue 43) ------------------------------------------


def probed_model(vision=None):
    """A tiny GPT (with a vision stack when `vision`, a VisionConfig, is given) with the content-proof
    hooks, and the FedLog it reports to."""
    import torch

    from ghostvis_core.plan.config import ModelConfig
    from ghostvis_core.run.model.gpt import GPT
    from ghostvis_core.run.train.feeds import FedLog, watch_model_inputs

    torch.manual_seed(0)
    model = GPT(
        ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32, max_seq_len=8)
    )
    if vision is not None:
        model.attach_vision(vision)
    log = FedLog()
    watch_model_inputs(model, lambda: log)
    return model, log


def planned_batch(rows: list[int], images: list[bytes] = ()):
    """A micro-batch as the plan made it: rows of 4 ids, targets shifted by one."""
    import torch

    from ghostvis_core.counts import TokenCounts
    from ghostvis_core.data.loader import Batch

    inputs = torch.tensor([[g, g + 1, g + 2, g + 3] for g in rows])
    return Batch(inputs, inputs + 1, [], TokenCounts(), rows=rows, images=list(images))


def expected_digest(batch, image_digests: list[str] = ()) -> str:
    """What the audit rebuilds from the token files for these rows: the digest of the planned tensors."""
    rows = [digest.row_digest(i.numpy(), t.numpy()) for i, t in zip(batch.inputs, batch.targets)]
    return digest.micro_digest(rows, list(image_digests))


def micro_digests(log, step: int) -> list[str]:
    """The micro-batch digests the ledger's feed record of `step` holds."""
    return next(r.micro_digests for r in log.records("p0", "r", 0) if r.step == step)


def test_the_digest_is_of_what_reaches_the_model_and_only_training_feeds_are_recorded():
    model, log = probed_model()
    model(planned_batch([1, 2]).inputs)  # no micro-batch announced (validation, generation): not recorded
    assert log.steps == {}
    batch = planned_batch([3, 4])
    log.expect(7, batch)
    model(batch.inputs, batch.targets, reduction="sum")
    model(batch.inputs, batch.targets, reduction="sum")  # a second forward of the step is not a second feed
    assert log.steps[7]["micro_rows"] == [[3, 4]] and micro_digests(log, 7) == [expected_digest(batch)]
    (fed,) = log.records("p0", "r", 0)
    assert (fed.part_id, fed.rank, fed.step, fed.micro_rows) == ("p0", 0, 7, [[3, 4]])
    assert fed.step_digest == digest.step_digest([expected_digest(batch)])


def test_a_batch_edited_after_planning_or_never_fed_no_longer_matches_the_plan():
    """The trainer announces the planned rows 4-5; the model receives rows 5-6 (a batch swapped after
    planning), then an edited target: the recorded digests are of what the model saw, not the plan."""
    model, log = probed_model()
    planned, fed = planned_batch([4, 5]), planned_batch([5, 6])
    log.expect(1, planned)
    model(fed.inputs, fed.targets)
    edited = planned_batch([4, 5])
    edited.targets[0, 3] = 0
    log.expect(2, planned)
    model(edited.inputs, edited.targets)
    log.expect(3, planned)  # announced, never given to the model
    log.expect(3, planned)
    model(planned.inputs, planned.targets)
    assert log.steps[1]["micro_rows"] == [[4, 5]]  # the rows the plan says...
    assert micro_digests(log, 1) == [expected_digest(fed)] != [expected_digest(planned)]  # ...not their content
    assert micro_digests(log, 2) != [expected_digest(planned)]
    assert micro_digests(log, 3) == [expected_digest(planned)]  # one micro-batch recorded, not two


def png(color: tuple[int, int, int], size: int = 12) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (size, size), color).save(out, format="PNG")
    return out.getvalue()


def test_images_are_digested_at_the_image_encoder_and_a_swapped_image_is_caught():
    """The trainer's decoding and the audit's own (rebuild.pixels) give the same pixels; the digest is of
    what the encoder receives, so an image swapped after planning (the plan's red image announced, a blue
    one fed) no longer matches the audit's digest of the planned micro-batch, while the rows still do."""
    from ghostvis_core.plan.config import VisionConfig
    from ghostvis_core.run.model.vision import decode_images
    from ghostvis_core.verify.audit.rebuild import pixels

    model, log = probed_model(VisionConfig(image_size=8, patch_size=4, d_vision=8, n_layers=1, n_heads=2, n_latents=2))
    red, blue = png((200, 10, 10)), png((10, 10, 200))
    assert np.array_equal(decode_images([red], 8)[0].numpy(), pixels(red, 8))  # resized 12 -> 8 by both
    batch = planned_batch([0], [red])
    batch.inputs[0, :2] = 31  # the image's two latent positions
    audit = expected_digest(batch, [digest.image_digest(pixels(red, 8))])
    for step, fed in ((1, red), (2, blue)):
        log.expect(step, batch)
        model(batch.inputs, batch.targets, images=decode_images([fed], 8), image_mask=batch.inputs == 31)
    model(batch.inputs, images=decode_images([blue], 8), image_mask=batch.inputs == 31)  # not announced: not recorded
    assert log.steps[1]["image_hashes"] == [[digest.image_digest(pixels(red, 8))]]
    assert micro_digests(log, 1) == [audit]
    assert log.steps[2]["row_digests"] == log.steps[1]["row_digests"] and micro_digests(log, 2) != [audit]
    assert log.steps[2]["image_hashes"] == [[digest.image_digest(decode_images([blue], 8)[0].numpy())]]


@pytest.mark.e2e
@pytest.mark.parametrize("stage", stage_names())
def test_the_audit_rebuilds_exactly_the_rows_the_loader_builds(demo_home, stage):
    """Every row a smoke run of the stage reads (and a stretch beyond, into later epochs for the small
    chat, preference and caption sources): inputs, targets, document ids, images (and their decoded pixels)
    and spans equal."""
    from ghostvis_core.launch.start import prepare_run
    from ghostvis_core.run.model.vision import decode_images
    from ghostvis_core.run.train.objectives import build_objective
    from ghostvis_core.verify.audit.rebuild import pixels

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
        if spec.config.vision is not None:  # the trainer's decoding and the audit's give the same pixels
            size = spec.config.vision.image_size
            assert all(np.array_equal(decode_images([im], size)[0].numpy(), pixels(im, size)) for im in got.images)
        assert [(p.shard_id, p.epoch, p.tok_start, p.tok_end) for p in want.pieces] == list(got.spans), (stage, g)
