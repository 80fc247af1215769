"""The GPU fast path's pieces, checked on CPU: packed documents attended as variable-length
sequences (SDPA per document, what flash-attn's varlen kernel computes) and through FlexAttention's
document block mask give the loss (and gradients) of the dense document mask they replace, which
kernel runs when, and the chunked cross-entropy equals the plain one. (FlexAttention has no CPU
backward in PyTorch 2.13: its gradients are checked on a GPU by benchmarks/gpu_check.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ghostvis_core.plan.batch import IGNORE_INDEX
from ghostvis_core.plan.config import ModelConfig
from ghostvis_core.run.model import gpt
from ghostvis_core.run.model.gpt import FLASH_ATTN, FLEX, GPT, SDPA, DocSpans, attention_kernel, lm_loss

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=32)


def packed_batch():
    """Two rows of 24 positions, each packing documents of uneven lengths and a padded tail (id -1)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (2, 25), generator=g)
    doc_ids = torch.tensor([[0] * 5 + [1] * 11 + [2] * 6 + [-1] * 2, [0] * 13 + [1] * 1 + [2] * 10])
    targets = x[:, 1:].clone()
    targets[0, -2:] = IGNORE_INDEX
    return x[:, :-1], targets, doc_ids


def dense_mask_loss(model: GPT, x, targets, doc_ids):
    """The reference: every position attends to earlier positions of its own document through a
    dense (B, 1, T, T) boolean mask, the way attention was computed before the varlen path."""
    h = model.embed(x)
    t = x.shape[1]
    cos, sin = model._rope(t, x.device)
    mask = ((doc_ids[:, :, None] == doc_ids[:, None, :]) & torch.ones(t, t, dtype=torch.bool).tril())[:, None]
    for block in model.blocks:
        a = block.attn
        n = block.attn_norm(h)
        q = a.wq(n).view(2, t, a.n_heads, a.hd)
        k, v = a.wkv(n).view(2, t, 2, a.n_kv, a.hd).unbind(2)
        q, k = gpt.apply_rope(q, cos[:t], sin[:t]), gpt.apply_rope(k, cos[:t], sin[:t])
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        ).transpose(1, 2)
        h = h + a.wo(y.reshape(2, t, -1))
        h = h + block.ffn(block.ffn_norm(h))
    logits = model.lm_head(model.norm(h)).float()
    return F.cross_entropy(logits.view(-1, CFG.vocab_size), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def test_doc_spans_are_the_runs_of_equal_ids_per_row():
    _, _, doc_ids = packed_batch()
    spans = DocSpans.from_doc_ids(doc_ids, SDPA)
    assert spans.bounds == ((0, 5), (5, 16), (16, 22), (22, 24), (24, 37), (37, 38), (38, 48))
    assert spans.cu_seqlens.tolist() == [0, 5, 16, 22, 24, 37, 38, 48] and spans.cu_seqlens.dtype == torch.int32
    assert spans.max_len == 13


def test_packed_documents_take_the_varlen_path_with_the_dense_mask_loss_and_grads(monkeypatch):
    torch.manual_seed(0)
    model = GPT(CFG)
    x, targets, doc_ids = packed_batch()
    calls = []
    original = gpt.varlen_attention  # counted on the way through, not replaced
    monkeypatch.setattr(gpt, "varlen_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    varlen = model(x, targets, doc_ids=doc_ids)
    assert len(calls) == CFG.n_layers  # every block took the per-document path
    varlen.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    dense = dense_mask_loss(model, x, targets, doc_ids)
    dense.backward()
    assert float(varlen) == pytest.approx(float(dense), rel=1e-6)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)


def test_the_kernel_for_packed_documents_by_device_and_precision(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
    monkeypatch.setattr(gpt, "flash_attn_varlen_func", None)
    assert attention_kernel(cpu, half=False) == SDPA  # FlexAttention has no CPU backward
    assert attention_kernel(cuda, half=True) == FLEX  # no flash-attn wheel: FlexAttention
    monkeypatch.setattr(gpt, "flash_attn_varlen_func", object())  # installed
    assert attention_kernel(cuda, half=True) == FLASH_ATTN
    assert attention_kernel(cuda, half=False) == FLEX  # flash-attn takes half inputs only
    assert attention_kernel(cpu, half=True) == SDPA


def test_flex_block_mask_matches_the_dense_mask_and_the_per_document_kernel():
    """A row where the same id comes back after another document: two documents, for every kernel."""
    g = torch.Generator().manual_seed(3)
    doc_ids = torch.tensor([[4] * 6 + [7] * 9 + [4] * 5 + [-1] * 4, [0] * 24])
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    runs = starts.cumsum(1)
    t = doc_ids.shape[1]
    dense = ((runs[:, :, None] == runs[:, None, :]) & torch.ones(t, t, dtype=torch.bool).tril())[:, None]
    q = torch.randn(2, t, 4, 8, generator=g)
    k, v = (torch.randn(2, t, 2, 8, generator=g) for _ in range(2))
    flex = gpt.varlen_attention(q, k, v, DocSpans.from_doc_ids(doc_ids, FLEX), gqa=True)
    per_doc = gpt.varlen_attention(q, k, v, DocSpans.from_doc_ids(doc_ids, SDPA), gqa=True)
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=dense, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(flex, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(per_doc, ref, rtol=1e-5, atol=1e-6)


def test_through_flex_the_model_gives_the_dense_mask_loss(monkeypatch):
    """The model as a GPU without flash-attn runs it (forward: FlexAttention has no CPU backward)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    x, targets, doc_ids = packed_batch()
    kernels = []
    original = gpt.varlen_attention
    monkeypatch.setattr(gpt, "attention_kernel", lambda device, half: FLEX)
    monkeypatch.setattr(
        gpt, "varlen_attention", lambda q, k, v, docs, gqa: kernels.append(docs.kernel) or original(q, k, v, docs, gqa)
    )
    with torch.no_grad():
        flex = model(x, targets, doc_ids=doc_ids)
        dense = dense_mask_loss(model, x, targets, doc_ids)
    assert kernels == [FLEX] * CFG.n_layers
    assert float(flex) == pytest.approx(float(dense), rel=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none", "logprobs"])
def test_chunked_cross_entropy_equals_the_plain_one_with_its_grads(reduction):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 10, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 10), generator=g)
    targets[1, 3:6] = IGNORE_INDEX
    plain = lm_loss(h, w, targets, reduction)  # 30 positions x 50 logits: one chunk
    weights = torch.randn(plain.shape, generator=g)
    plain_grads = torch.autograd.grad((plain * weights).sum(), (h, w))
    chunked = lm_loss(h, w, targets, reduction, chunk_elements=7 * 50)  # 7 positions per chunk: 5 chunks
    chunked_grads = torch.autograd.grad((chunked * weights).sum(), (h, w))
    torch.testing.assert_close(chunked, plain)
    for a, b in zip(chunked_grads, plain_grads):
        torch.testing.assert_close(a, b)
    logits = (h @ w.T).reshape(-1, 50)
    if reduction in ("mean", "sum", "none"):
        reference = F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction=reduction)
        torch.testing.assert_close(plain.reshape(reference.shape), reference)
