"""What the planner knows of the model without building it: parameter counts from the shape, and how
many logit elements the loss holds at once (the memory plan and the model's chunked loss share it)."""

from __future__ import annotations

from ghostvis_core.plan.config import ModelConfig

# Logit elements (positions x vocabulary) the loss holds at once: 64M, i.e. 256 MB in fp32, and their
# bf16 copy and gradient; a larger batch is computed chunk by chunk, each chunk's logits recomputed
# in the backward pass instead of kept.
LOSS_CHUNK_ELEMENTS = 1 << 26


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from the shape alone (the planner uses this for 7B without building it).

    non_embedding is the N of 6ND: every parameter that does matmul work per token, i.e. all but
    the input embedding table (the lm_head counts, tied or not).
    """
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * cfg.n_heads * hd + d * 2 * cfg.n_kv_heads * hd + cfg.n_heads * hd * d
    attn += (cfg.n_heads + 2 * cfg.n_kv_heads) * hd if cfg.qkv_bias else 0
    ffn = 3 * d * cfg.ffn_hidden
    layers = cfg.n_layers * (attn + ffn + 2 * d) + d
    table = cfg.vocab_size * d
    total = layers + table * (1 if cfg.tie_embeddings else 2)
    return {"total": total, "non_embedding": layers + table, "embedding": table}
