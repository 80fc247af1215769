"""Each post-pretraining objective on hand-built inputs whose answer is known: SFT assistant masking
and packing without leaks, the DPO loss by hand, the vision stack's shapes and frozen parts, and
the long-context RoPE change. (Mixture sampling is in test_loader.)"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from ghostvis_core.data.bpe_tokenizer import train_tokenizer
from ghostvis_core.data.chat import render_chat
from ghostvis_core.data.loader import Batch, Batcher, ChatRows, PreferenceRows
from ghostvis_core.data.shard_ref import ShardRef
from ghostvis_core.data.stream import SourceStream
from ghostvis_core.data.token_shard import list_column, write_token_shard
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.batch import IGNORE_INDEX
from ghostvis_core.plan.config import DPOConfig, ModelConfig, VisionConfig
from ghostvis_core.plan.presets import resolve
from ghostvis_core.run.model.gpt import GPT, apply_rope, rope_tables
from ghostvis_core.run.model.vision import VisionStack, frozen_fingerprint, splice_images
from ghostvis_core.run.train.objectives import DPOObjective, VisionAlignObjective

SMALL = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)


def small_gpt(vocab: int, seed: int = 0, **over) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(vocab_size=vocab, **{**SMALL, **over})).eval()


@pytest.fixture(scope="module")
def tok():
    text = ["The cat sat on the mat. What is two plus two? It is four. Say hello. Hello there!"] * 20
    return train_tokenizer(text, vocab_size=320)


def write_chat_shard(root: Path, convs: list[tuple[list[int], list[int]]]) -> ShardRef:
    path = root / "chat" / "chat-000.arrow"
    lens = [len(ids) for ids, _ in convs]
    write_token_shard(
        path,
        {
            "row": pa.array(range(len(convs)), pa.int64()),
            "tokens": list_column(lens, [t for ids, _ in convs for t in ids], np.uint16),
            "mask": list_column(lens, [m for _, mask in convs for m in mask], np.uint8),
        },
    )
    return ShardRef("chat/00000", "chat", "train", str(path), docs=len(convs), tokens=sum(lens))


# ---------------------------------------------------------------- SFT: assistant masking, packing


def test_render_chat_trains_assistant_content_and_its_eot_only(tok):
    msgs = [
        {"role": "system", "content": "Say hello."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four."},
    ]
    ids, mask = render_chat(tok, msgs)
    reply = tok.encode("It is four.")
    assert ids == [
        tok.bos,
        tok.special("<|system|>"),
        *tok.encode("Say hello."),
        tok.eot,
        tok.special("<|user|>"),
        *tok.encode("What is two plus two?"),
        tok.eot,
        tok.special("<|assistant|>"),
        *reply,
        tok.eot,
    ]
    assert mask == [0] * (len(ids) - len(reply) - 1) + [1] * (len(reply) + 1)


def _packed_batch(tmp_path, tok, convs: list[list[dict]]) -> Batch:
    ref = write_chat_shard(tmp_path, [render_chat(tok, c) for c in convs])
    rows = ChatRows(SourceStream("chat", [ref], 0), seq_len=64, seed=0, pad_id=tok.special("<|pad|>"))
    assert len(rows.plan(0)) == 1, "both conversations must pack into one row for this test"
    return Batcher([rows], [1.0]).batch([0])


def _token_losses(model: GPT, batch: Batch, doc_mask: bool = True) -> torch.Tensor:
    with torch.no_grad():
        return model(batch.inputs, batch.targets, doc_ids=batch.doc_ids if doc_mask else None, reduction="none")


def _reply_losses(model: GPT, batch: Batch, doc_mask: bool = True) -> list[torch.Tensor]:
    """Per conversation (in shard order, whatever the packing order), the losses of its targets."""
    losses = _token_losses(model, batch, doc_mask)[0]
    slots = sorted(range(len(batch.pieces)), key=lambda s: batch.pieces[s].tok_start)
    trained = batch.targets[0] != IGNORE_INDEX
    return [losses[trained & (batch.doc_ids[0] == s)] for s in slots]


def test_changing_a_user_token_leaves_the_loss_unchanged(tmp_path, tok):
    """A user token is never a target, and a packed neighbour never sees it; only the reply of its
    own conversation reads it (causal attention), which is how a prompt should work."""
    first = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "It is four."}]
    second = [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello there!"},
        {"role": "user", "content": "The cat sat on the mat."},
    ]  # a trailing user turn, no reply
    base = _packed_batch(tmp_path / "a", tok, [first, second])
    reply_tokens = len(tok.encode("It is four.")) + len(tok.encode("Hello there!")) + 2  # + their <|eot|>
    assert base.counts.loss_tokens == reply_tokens
    model = small_gpt(tok.vocab_size)
    loss = _reply_losses(model, base)

    def changed(conv: list[dict], turn: int) -> list[dict]:
        conv = [dict(m) for m in conv]
        conv[turn]["content"] = conv[turn]["content"].replace("cat", "dog").replace("two plus", "four plus")
        return conv

    # the trailing user turn of the second conversation: no reply's loss moves (the packing may put
    # the second conversation first, so the other one shifts: equal up to float rounding of RoPE)
    trailing = _packed_batch(tmp_path / "b", tok, [first, changed(second, 2)])
    assert (
        trailing.counts.real_tokens != base.counts.real_tokens
        and trailing.counts.loss_tokens == base.counts.loss_tokens
    )
    for new, old in zip(_reply_losses(model, trailing), loss):
        torch.testing.assert_close(new, old, rtol=0, atol=1e-5)

    # the first conversation's question: its own reply's loss moves, the packed neighbour's does not
    asked = _packed_batch(tmp_path / "c", tok, [changed(first, 0), second])
    new = _reply_losses(model, asked)
    assert asked.counts.loss_tokens == base.counts.loss_tokens
    torch.testing.assert_close(new[1], loss[1], rtol=0, atol=1e-5)
    assert not torch.allclose(new[0], loss[0], atol=1e-3)


def test_packed_attention_is_kept_inside_each_conversation(tmp_path, tok):
    """The same conversation alone in a row and packed after another gives the same per-token loss
    (positions need not restart for that: RoPE scores depend on relative position only)."""
    conv = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there!"}]
    other = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "It is four."}]
    alone = _packed_batch(tmp_path / "a", tok, [conv])
    packed = _packed_batch(tmp_path / "b", tok, [other, conv])
    model = small_gpt(tok.vocab_size)
    a = _reply_losses(model, alone)[0]
    torch.testing.assert_close(_reply_losses(model, packed)[1], a, rtol=0, atol=1e-5)
    # without the document mask, whichever conversation is packed second reads the first
    masked, leaky = _reply_losses(model, packed), _reply_losses(model, packed, doc_mask=False)
    assert any(not torch.allclose(m, x, atol=1e-3) for m, x in zip(masked, leaky))


# ---------------------------------------------------------------- DPO


class FixedLogprobs(torch.nn.Module):
    """A 'model' whose per-position log p(target) is given: row r sums to totals[r]."""

    def __init__(self, totals: list[float], length: int = 4):
        super().__init__()
        self.lp = torch.tensor(totals)[:, None].repeat(1, length) / length

    def forward(self, inputs, targets, reduction):
        assert reduction == "logprobs"
        return self.lp


def dpo(beta: float, ref: torch.nn.Module) -> DPOObjective:
    obj = DPOObjective.__new__(DPOObjective)  # the loss needs beta and the reference, not shards
    obj.dpo, obj.ref = DPOConfig(beta=beta), ref
    return obj


def test_dpo_loss_against_a_hand_computed_value():
    # rows: pair 0 chosen, rejected; pair 1 chosen, rejected (sequence log-probs)
    policy = FixedLogprobs([-10.0, -11.0, -5.0, -5.0])
    reference = FixedLogprobs([-12.0, -10.0, -5.0, -5.0])
    batch = Batch(torch.zeros(4, 4, dtype=torch.long), torch.zeros(4, 4, dtype=torch.long), [], 16, 0, 16)
    # pair 0: beta x ((-10 - -12) - (-11 - -10)) = 0.1 x (2 + 1) = 0.3 -> -log sigmoid(0.3) = 0.5543552
    # pair 1: equal margins -> -log sigmoid(0) = log 2 = 0.6931472
    loss = dpo(0.1, reference).loss_sum(policy, batch, "cpu")
    assert float(loss) == pytest.approx(0.5543552 + 0.6931472, abs=1e-6)
    # beta scales the implicit reward: at beta 1, pair 0 is -log sigmoid(3) = 0.0485874
    assert float(dpo(1.0, reference).loss_sum(policy, batch, "cpu")) == pytest.approx(0.0485874 + 0.6931472, abs=1e-6)


def test_dpo_reads_the_response_only_and_starts_at_log_2(tmp_path):
    # one pair: prompt [5, 6, 7], chosen [8, 9], rejected [10, 11, 12]
    path = tmp_path / "prefs" / "p.arrow"
    write_token_shard(
        path,
        {
            "row": pa.array([0], pa.int64()),
            "tokens": list_column([8], [5, 6, 7, 8, 9, 10, 11, 12], np.uint16),
            "prompt_len": pa.array([3], pa.int64()),
            "chosen_len": pa.array([2], pa.int64()),
        },
    )
    ref = ShardRef("prefs/00000", "prefs", "train", str(path), docs=1, tokens=8)
    batch = Batcher([PreferenceRows(SourceStream("prefs", [ref], 0), seq_len=8, seed=0, pad_id=0)], [1.0]).batch([0, 1])
    assert batch.inputs.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [5, 6, 7, 10, 11, 12, 0, 0]]
    assert batch.targets.tolist() == [[-1, -1, 8, 9, -1, -1, -1, -1], [-1, -1, 10, 11, 12, -1, -1, -1]]
    model = small_gpt(16)
    obj = dpo(0.1, model)
    logps = obj.sequence_logps(model, batch, "cpu")
    with torch.no_grad():
        lsm = torch.log_softmax(model(batch.inputs).float(), -1)
    by_hand = [lsm[0, 2, 8] + lsm[0, 3, 9], lsm[1, 2, 10] + lsm[1, 3, 11] + lsm[1, 4, 12]]
    torch.testing.assert_close(logps, torch.stack(by_hand), rtol=0, atol=1e-5)
    # the reference is the starting policy: every margin is 0, the loss per pair is log 2
    assert float(obj.loss_sum(model, batch, "cpu").detach()) == pytest.approx(math.log(2), abs=1e-6)


# ---------------------------------------------------------------- vision alignment


VCFG = VisionConfig(image_size=32, patch_size=4, d_vision=32, n_layers=1, n_heads=4, n_latents=6, resampler_layers=2)


def test_vision_stack_shapes():
    torch.manual_seed(0)
    stack = VisionStack(VCFG, d_model=64)
    images = torch.rand(3, 3, 32, 32)
    feats = stack.encoder(images)
    assert feats.shape == (3, (32 // 4) ** 2, 32)  # 64 patches of width d_vision
    latents = stack.resampler(feats)
    assert latents.shape == (3, 6, 32)  # n_latents whatever the number of patches
    assert stack.resampler(feats[:, :10]).shape == (3, 6, 32)
    assert stack(images).shape == (3, 6, 64)  # projected to the LM width
    assert [m.__class__.__name__ for m in stack.projector.net] == ["Linear", "GELU", "Linear"]


def test_splice_writes_image_embeddings_over_the_image_positions_in_order():
    x = torch.zeros(2, 5, 3)
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    emb = torch.arange(12, dtype=torch.float32).view(2, 2, 3)
    out = splice_images(x, mask, emb)
    assert out[0, 1:3].tolist() == emb[0].tolist() and out[1, 3:5].tolist() == emb[1].tolist()
    assert out[~mask].abs().sum() == 0
    with pytest.raises(ValueError, match="5 image positions for 2 images x 2 latents"):
        splice_images(x, mask.clone().index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(True)), emb)


def test_alignment_trains_resampler_and_projector_and_leaves_the_rest_bit_identical():
    model = small_gpt(40, seed=1)
    model.attach_vision(VCFG)
    VisionAlignObjective.prepare_model(None, model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("vision.resampler.", "vision.projector.")) for n in trainable)
    assert any(n.startswith("vision.resampler.latents") for n in trainable)
    frozen_before = frozen_fingerprint(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    # <|image|> is id 39 here: bos, 6 image positions, a 5-token caption
    inputs = torch.tensor([[1, *[39] * 6, 10, 11, 12, 13, 14]] * 2)
    targets = torch.full_like(inputs, IGNORE_INDEX)
    targets[:, 6:11] = inputs[:, 7:12]
    images = torch.rand(2, 3, 32, 32)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(3):
        loss = model(inputs, targets, images=images, image_mask=inputs == 39)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    assert frozen_fingerprint(model) == frozen_before
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
    assert {n.split(".")[1] for n in changed} == {"resampler", "projector"}


def test_frozen_fingerprint_sees_a_one_ulp_change():
    model = small_gpt(40)
    model.requires_grad_(False)
    h = frozen_fingerprint(model)
    with torch.no_grad():
        w = model.blocks[1].ffn.w2.weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))
    assert frozen_fingerprint(model) != h


# ---------------------------------------------------------------- context expansion: RoPE


def test_rope_scores_depend_only_on_relative_position():
    cfg = ModelConfig(vocab_size=8, **{**SMALL, "max_seq_len": 1024, "rope_base": 160000.0})
    cos, sin = rope_tables(cfg, 1024)
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, cfg.head_dim), torch.randn(1, 1, 1, cfg.head_dim)

    def score(m: int, n: int) -> float:
        return float(
            (apply_rope(q, cos[m : m + 1], sin[m : m + 1]) * apply_rope(k, cos[n : n + 1], sin[n : n + 1])).sum()
        )

    assert score(900, 890) == pytest.approx(score(10, 0), abs=1e-4)
    assert score(1000, 3) == pytest.approx(score(997, 0), abs=1e-4)
    assert score(10, 0) != pytest.approx(score(20, 0), abs=1e-3)


def test_a_larger_rope_base_slows_every_rotation_but_the_fastest():
    old = ModelConfig(vocab_size=8, **SMALL)
    new = ModelConfig(vocab_size=8, **{**SMALL, "rope_base": 160000.0})
    half = old.head_dim // 2
    angle_old = rope_tables(old, 1024)[0][1].acos()  # at position 1 the angle is the frequency
    angle_new = rope_tables(new, 1024)[0][1].acos()
    # the fastest pair turns one radian per position either way; the others as base^(-i/half)
    torch.testing.assert_close(angle_new, 160000.0 ** (-torch.arange(half) / half), rtol=0, atol=1e-3)
    torch.testing.assert_close(angle_new[0], angle_old[0], rtol=0, atol=0)
    assert (angle_new[1:] < angle_old[1:]).all()
    # the slowest pair: at base 160000 it turns less over 1024 positions than at 10000 over 256
    assert 1023 * angle_new[-1] < 255 * angle_old[-1]


def test_position_interpolation_maps_position_4p_onto_p():
    base = ModelConfig(vocab_size=8, **SMALL)
    scaled = ModelConfig(vocab_size=8, **{**SMALL, "rope_scaling": 4.0})
    cos, sin = rope_tables(base, 256)
    cos4, sin4 = rope_tables(scaled, 1024)
    assert torch.equal(cos4[0::4], cos) and torch.equal(sin4[0::4], sin)


def test_context_expansion_raises_the_context_and_keeps_the_shape():
    upstream = resolve("continued_pretrain", "tiny").to_dict()
    cfg = resolve("context_expansion", "tiny", upstream=upstream)
    assert (cfg.model.max_seq_len, cfg.model.rope_base, cfg.batch.seq_len) == (1024, 160000.0, 1024)
    assert (upstream["model"]["max_seq_len"], upstream["model"]["rope_base"]) == (256, 10000.0)
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden"):
        assert getattr(cfg.model, k) == upstream["model"][k]
    # the upstream weights load into the expanded model unchanged: RoPE has no parameters
    small_up = GPT(
        ModelConfig(
            **{**upstream["model"], "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128, "n_layers": 1}
        )
    )
    grown = GPT(
        ModelConfig(
            **{**cfg.model.__dict__, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128, "n_layers": 1}
        )
    )
    grown.load_state_dict(small_up.state_dict(), strict=True)
    x = torch.randint(0, 100, (1, 1024))
    assert torch.isfinite(grown(x[:, :-1], x[:, 1:])).all()
    with pytest.raises(GhostvisError, match=r"model.d_model=512 \(upstream continued_pretrain has 256\)"):
        resolve("context_expansion", "tiny", {"model.d_model": "512"}, upstream=upstream)
