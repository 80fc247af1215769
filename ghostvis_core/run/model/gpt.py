"""Decoder-only LM: RoPE, RMSNorm, SwiGLU, grouped-query attention.

Attention goes through flash-attn when it is installed and the kernel's inputs (q, k, v: bf16
under autocast even when the residual stream is fp32) are CUDA half precision, else through PyTorch
SDPA. Packed rows can carry `doc_ids` so attention never crosses a document boundary (SFT packs
conversations; pretraining lets documents see each other), never through a dense T x T mask: the
kernel that attends them is named by `attention_kernel` (flash-attn's varlen kernel, PyTorch's
FlexAttention with a block mask of the documents, or SDPA per document) and recorded by the run.
The loss is computed in chunks of positions (`LOSS_CHUNK_ELEMENTS`), so fp32 logits over the whole
vocabulary exist for one chunk at a time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from ghostvis_core.plan.batch import IGNORE_INDEX
from ghostvis_core.plan.config import ModelConfig, VisionConfig
from ghostvis_core.plan.model_shape import LOSS_CHUNK_ELEMENTS

try:  # optional, GPU only
    from flash_attn import flash_attn_func, flash_attn_varlen_func  # type: ignore
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_func = flash_attn_varlen_func = None


FLASH_ATTN, FLEX, SDPA = "flash-attn", "flex", "sdpa-per-document"
_HALF = (torch.float16, torch.bfloat16)


def attention_kernel(device: torch.device, half: bool) -> str:
    """The kernel that attends packed documents: flash-attn's varlen kernel on a CUDA device with half
    precision inputs when flash-attn is installed (it has no wheel for every CUDA and PyTorch pair),
    else FlexAttention on CUDA, and one SDPA call per document on CPU (PyTorch 2.13 has no CPU
    backward for FlexAttention, its CPU eager form materializes the T x T scores, and compiling it for
    the CPU is slow for every new shape)."""
    if device.type != "cuda":
        return SDPA
    return FLASH_ATTN if half and flash_attn_varlen_func is not None else FLEX


def _half(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in _HALF


def _attention_is_half(x: torch.Tensor) -> bool:
    """Whether q, k, v will be half precision: the residual's dtype, or autocast's on its device."""
    t = x.device.type
    return x.dtype in _HALF or (torch.is_autocast_enabled(t) and torch.get_autocast_dtype(t) in _HALF)


@dataclass(frozen=True)
class DocSpans:
    """Packed documents for one kernel: for the varlen kernels, offsets into the flattened (B*T)
    positions; for FlexAttention only the block mask in which a position sees the earlier positions
    of its document (no per-batch ints, which a compiled block would recompile for)."""

    kernel: str
    cu_seqlens: torch.Tensor | None = None  # int32, (n_docs + 1,): where each document starts, then B*T
    bounds: tuple[tuple[int, int], ...] = ()  # the same offsets as (start, end) pairs, on the host
    max_len: int = 0
    block_mask: BlockMask | None = None

    @classmethod
    def from_doc_ids(cls, doc_ids: torch.Tensor, kernel: str) -> DocSpans:
        """A document is a run of equal ids within a row; rows never share a document."""
        b, t = doc_ids.shape
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        if kernel == FLEX:
            return cls(kernel, block_mask=_document_block_mask(starts.cumsum(1), compiled=doc_ids.is_cuda))
        offsets = [*starts.flatten().nonzero().flatten().tolist(), b * t]
        bounds = tuple(zip(offsets[:-1], offsets[1:]))
        cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=doc_ids.device)
        return cls(kernel, cu_seqlens, bounds, max(e - s for s, e in bounds))


def _document_block_mask(runs: torch.Tensor, compiled: bool) -> BlockMask:
    """Causal within each document, `runs` (B, T) numbering each row's documents: the same id twice
    in a row, apart, is two documents, as for the varlen kernels. Built once per micro-batch, compiled on
    CUDA: the compiled build is several times faster than the eager one (benchmarks/gpu_check.py)."""
    b, t = runs.shape

    def same_document_causal(bi, h, q, kv):
        return (runs[bi, q] == runs[bi, kv]) & (q >= kv)

    return create_block_mask(same_document_causal, b, None, t, t, device=runs.device, _compile=compiled)


def _flex(q, k, v, block_mask: BlockMask, gqa: bool) -> torch.Tensor:
    """FlexAttention on (B, heads, T, head_dim): compiled on CUDA (the eager form materializes the
    scores); inside a block that torch.compile is already tracing, the plain function, which the block's
    graph compiles; eager elsewhere (the tests' CPU parity checks, forward only)."""
    fn = _compiled_flex() if q.is_cuda and not torch.compiler.is_compiling() else flex_attention
    return fn(q, k, v, block_mask=block_mask, enable_gqa=gqa)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def varlen_attention(q, k, v, docs: DocSpans, gqa: bool) -> torch.Tensor:
    """Causal attention within each document; q, k, v: (B, T, heads, head_dim)."""
    b, t = q.shape[:2]
    if docs.kernel == FLEX:
        return _flex(*(x.transpose(1, 2) for x in (q, k, v)), docs.block_mask, gqa).transpose(1, 2)
    qf, kf, vf = (x.reshape(b * t, *x.shape[2:]) for x in (q, k, v))
    if docs.kernel == FLASH_ATTN:
        y = flash_attn_varlen_func(
            qf, kf, vf, docs.cu_seqlens, docs.cu_seqlens, docs.max_len, docs.max_len, causal=True
        )
    else:  # PyTorch's own: one SDPA call per document, no T x T mask
        y = torch.cat(
            [
                F.scaled_dot_product_attention(
                    qf[s:e].transpose(0, 1),
                    kf[s:e].transpose(0, 1),
                    vf[s:e].transpose(0, 1),
                    is_causal=True,
                    enable_gqa=gqa,
                ).transpose(0, 1)
                for s, e in docs.bounds
            ]
        )
    return y.view(b, t, *y.shape[1:])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(cfg: ModelConfig, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, head_dim/2); rope_scaling > 1 interpolates positions."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    pos = torch.arange(seq_len, device=device, dtype=torch.float32) / cfg.rope_scaling
    freqs = torch.outer(pos, inv_freq)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, T, H, D); rotate pairs (first half, second half)
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, self.n_heads * self.hd, bias=cfg.qkv_bias)
        self.wkv = nn.Linear(cfg.d_model, 2 * self.n_kv * self.hd, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.hd, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, docs: DocSpans | None = None, kv_cache=None):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.hd)
        k, v = self.wkv(x).view(b, t, 2, self.n_kv, self.hd).unbind(2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        gqa = self.n_kv != self.n_heads
        if docs is not None:
            y = varlen_attention(q, k, v, docs, gqa)
        elif flash_attn_func is not None and _half(q):  # the dtype the kernel sees, not the residual's
            y = flash_attn_func(q, k, v, causal=kv_cache is None or t > 1)
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if (kv_cache is None or t > 1) and k.shape[2] == t:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:  # decoding with a cache: attend to all past
                mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - t)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            y = y.transpose(1, 2)
        return self.wo(y.reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg)

    def forward(self, x, cos, sin, docs: DocSpans | None = None, kv_cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, docs, kv_cache)
        return x + self.ffn(self.ffn_norm(x))


class KVCache:
    """Per-layer growing key/value tensors for sampling."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        return self.k, self.v

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[1]


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(
                f"model shape: d_model={cfg.d_model} must divide by n_heads={cfg.n_heads}, "
                f"and n_heads by n_kv_heads={cfg.n_kv_heads}"
            )
        self.cfg = cfg
        self.grad_checkpointing = False
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.vision = None  # a VisionStack once attach_vision() is called (vision_alignment onwards)
        self._rope_len = 0
        self.reset_parameters()

    def attach_vision(self, vcfg: VisionConfig) -> None:
        from ghostvis_core.run.model.vision import VisionStack

        self.vision = VisionStack(vcfg, self.cfg.d_model)

    def reset_parameters(self):
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith("wo.weight") or name.endswith("w2.weight"):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, std=std)

    def _rope(self, seq_len: int, device):
        if seq_len > self._rope_len or self._cos.device != device:
            n = max(seq_len, self.cfg.max_seq_len)
            self._cos, self._sin = rope_tables(self.cfg, n, device)
            self._rope_len = n
        return self._cos, self._sin

    def hidden(self, idx=None, *, embeds=None, doc_ids=None, kv_caches=None, start_pos: int = 0):
        """Final hidden states. `embeds` lets a caller splice image embeddings into the sequence."""
        x = self.embed(idx) if embeds is None else embeds
        t = x.shape[1]
        cos, sin = self._rope(start_pos + t, x.device)
        cos, sin = cos[start_pos : start_pos + t], sin[start_pos : start_pos + t]
        docs = None
        if doc_ids is not None:
            docs = DocSpans.from_doc_ids(doc_ids, attention_kernel(x.device, _attention_is_half(x)))
        for i, block in enumerate(self.blocks):
            cache = kv_caches[i] if kv_caches is not None else None
            if self.grad_checkpointing and self.training:
                x = checkpoint(block, x, cos, sin, docs, use_reentrant=False)
            else:
                x = block(x, cos, sin, docs, cache)
        return self.norm(x)

    def compile_blocks(self) -> None:
        """torch.compile each block in place (the unit FSDP gathers, so both compose)."""
        for block in self.blocks:
            block.compile()

    def embed_inputs(self, idx, images=None, image_mask=None):
        """Token embeddings, with image embeddings written over the expanded <|image|> positions."""
        x = self.embed(idx)
        if images is not None and images.shape[0]:
            from ghostvis_core.run.model.vision import splice_images

            x = splice_images(x, image_mask, self.vision(images))
        return x

    def forward(self, idx=None, targets=None, *, doc_ids=None, images=None, image_mask=None, reduction: str = "mean"):
        """Logits; or with targets, the cross-entropy over targets != IGNORE_INDEX (reduction mean,
        sum or none), or reduction="logprobs": log p(target) per position (0 where ignored)."""
        h = self.hidden(embeds=self.embed_inputs(idx, images, image_mask), doc_ids=doc_ids)
        if targets is None:
            return self.lm_head(h)
        return lm_loss(h, self.lm_head.weight, targets, reduction)

    @torch.no_grad()
    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        stop_tokens: tuple[int, ...] = (),
        generator=None,
        images: tuple[torch.Tensor, int] | None = None,
        vocab: int | None = None,
    ) -> list[int]:
        """KV-cached sampling of one continuation of `prompt`, ending after any stop token; greedy at temperature 0
        (generate_rows)."""
        return self.generate_rows(
            prompt,
            [generator],
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            images=images,
            vocab=vocab,
            ends=lambda row: row[-1] in stop_tokens,
        )[0]

    @torch.no_grad()
    def generate_rows(
        self,
        prompt: list[int],
        generators: list[torch.Generator | None],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        images: tuple[torch.Tensor, int] | None = None,
        vocab: int | None = None,
        ends: Callable[[list[int]], bool] = lambda row: False,
    ) -> list[list[int]]:
        """KV-cached sampling of one continuation of `prompt` per generator, as one batch (the rows share the
        prompt's cache and are decoded together: a group of rl completions costs about one completion's steps).
        Row i draws from generators[i] alone, so it samples what it would on its own. A row ends after a token
        for which `ends(row so far)` holds (a stop token; an rl completion's closed answer line); all end at
        max_new_tokens or the model's context. Greedy at temperature 0.
        `images`: (pixels, the placeholder id), filling the prompt's (already expanded) placeholder positions.
        `vocab`: the tokenizer's size; ids from it up are the padding rows of a vocabulary padded past the
        tokenizer's (531 -> 576) and are never drawn (a drawn one cannot be decoded). Runs in eval mode, then
        restores the caller's mode: a training loop that samples mid-run must stay in training mode."""
        was_training = self.training
        self.eval()
        try:
            device = self.embed.weight.device
            caches = [KVCache() for _ in self.blocks]
            x = torch.tensor([prompt] * len(generators), device=device)
            rows: list[list[int]] = [[] for _ in generators]
            live = set(range(len(generators)))
            pos = 0
            for _ in range(max_new_tokens):
                first = images is not None and pos == 0
                mask = (x == images[1]) if first else None
                embeds = self.embed_inputs(x, images[0] if first else None, mask)
                h = self.hidden(embeds=embeds, kv_caches=caches, start_pos=pos)
                pos += x.shape[1]
                logits = self.lm_head(h[:, -1]).float()[..., :vocab]
                for i in sorted(live):
                    rows[i].append(_pick(logits[i : i + 1], temperature, top_k, generators[i]))
                    if ends(rows[i]):
                        live.discard(i)
                if not live or pos >= self.cfg.max_seq_len:
                    break
                x = torch.tensor([[row[-1]] for row in rows], device=device)  # an ended row's input is ignored
            return rows
        finally:
            self.train(was_training)


def _target_nll(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position, in fp32, for one chunk of positions."""
    logits = F.linear(h, weight).float()
    return torch.logsumexp(logits, -1) - logits.gather(-1, targets.clamp_min(0)[:, None]).squeeze(-1)


def lm_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    reduction: str = "mean",
    chunk_elements: int = LOSS_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Cross-entropy of the lm_head over targets != IGNORE_INDEX (reduction mean, sum, none) or
    reduction="logprobs" (log p(target) per position, 0 where ignored), chunk by chunk of positions:
    a chunk's logits are recomputed in the backward pass, so only one chunk's exist at a time."""
    flat_h, flat_t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    rows = max(1, chunk_elements // weight.shape[0])
    if flat_h.shape[0] <= rows:
        nll = _target_nll(flat_h, weight, flat_t)
    else:
        nll = torch.cat(
            [
                checkpoint(_target_nll, flat_h[i : i + rows], weight, flat_t[i : i + rows], use_reentrant=False)
                for i in range(0, flat_h.shape[0], rows)
            ]
        )
    keep = flat_t != IGNORE_INDEX
    nll = nll * keep
    if reduction == "logprobs":
        return (-nll).view(targets.shape)
    if reduction == "none":
        return nll.view(targets.shape)
    if reduction == "sum":
        return nll.sum()
    if reduction == "mean":
        return nll.sum() / keep.sum()
    raise ValueError(f"lm_loss reduction must be mean, sum, none or logprobs, got '{reduction}'")


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> int:
    """The next token from last-position logits: argmax at temperature 0, else (top-k) sampling."""
    if temperature <= 0:
        return int(logits.argmax(-1))
    logits = logits / temperature
    if top_k:
        v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
        logits[logits < v[:, [-1]]] = -float("inf")
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
