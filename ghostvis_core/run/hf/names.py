"""The one mapping between GhostVis's model and transformers' Llama / Qwen2: config fields and tensor names.

GhostVis fuses k|v (`wkv`) and gate|up (`w13`) into one matmul each; HF keeps them apart, so those
tensors are split on export and concatenated on import (exact: a copy, no arithmetic)."""

from __future__ import annotations

from typing import Any

import torch

from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.config import ModelConfig

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def architecture(cfg: ModelConfig) -> str:
    """Llama has no q/k/v-only bias (its attention_bias also biases o_proj): such a model is a Qwen2."""
    return "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"


def hf_config(cfg: ModelConfig, *, bos: int, eos: int, pad: int | None, dtype: torch.dtype) -> dict[str, Any]:
    """config.json: transformers' own serialization, plus the legacy rope_theta / rope_scaling /
    torch_dtype keys older readers (vLLM, llama.cpp's converter) look for."""
    from transformers import LlamaConfig, Qwen2Config

    arch = architecture(cfg)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scaling != 1.0:
        rope = {"rope_type": "linear", "rope_theta": cfg.rope_base, "factor": cfg.rope_scaling}
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        intermediate_size=cfg.ffn_hidden,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=rope,
        hidden_act="silu",
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype=str(dtype).removeprefix("torch."),
        architectures=[arch],
    )
    hf = (Qwen2Config if arch == "Qwen2ForCausalLM" else LlamaConfig)(**kwargs).to_dict()
    hf["rope_theta"] = cfg.rope_base
    if cfg.rope_scaling != 1.0:
        hf["rope_scaling"] = {"rope_type": "linear", "type": "linear", "factor": cfg.rope_scaling}
    hf["torch_dtype"] = hf["dtype"]
    return hf


def model_config(hf: dict[str, Any], where: str) -> ModelConfig:
    """A GhostVis ModelConfig from an HF config.json; anything GhostVis's model cannot compute exactly is refused."""
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise GhostvisError(
            f"{where}: architecture {archs or 'missing'} is not supported; GhostVis imports "
            f"{' or '.join(ARCHITECTURES)} checkpoints (convert the model to one of them first)"
        )
    arch = archs[0]
    heads = hf["num_attention_heads"]
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']} (GhostVis's MLP is SwiGLU: silu)")
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        problems.append(f"head_dim={hf['head_dim']} != hidden_size/num_attention_heads")
    if hf.get("mlp_bias") or (arch == "LlamaForCausalLM" and hf.get("attention_bias")):
        problems.append("mlp_bias/attention_bias=true (GhostVis has no bias on o_proj or the MLP)")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=true (GhostVis attends to the whole context)")
    rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "linear"):
        problems.append(f"rope_type={kind} (GhostVis supports default and linear RoPE scaling)")
    if problems:
        raise GhostvisError(
            f"{where}: {arch} with {'; '.join(problems)} cannot be imported exactly; "
            "use a checkpoint without these settings"
        )
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        rope_base=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=float(rope.get("factor", 1.0)) if kind == "linear" else 1.0,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
    )


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this model holds, by name, with its shape."""
    d, hd, kv = cfg.d_model, cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (cfg.n_heads * hd, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, cfg.n_heads * hd),
            p + "mlp.gate_proj.weight": (cfg.ffn_hidden, d),
            p + "mlp.up_proj.weight": (cfg.ffn_hidden, d),
            p + "mlp.down_proj.weight": (d, cfg.ffn_hidden),
        }
        if cfg.qkv_bias:
            out |= {
                p + "self_attn.q_proj.bias": (cfg.n_heads * hd,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return out


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """GhostVis text-model tensors -> HF names (the vision stack is not part of it)."""
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layers):
        g, p = f"blocks.{i}.", f"model.layers.{i}."
        k, v = state[g + "attn.wkv.weight"].chunk(2, dim=0)
        gate, up = state[g + "ffn.w13.weight"].chunk(2, dim=0)
        out |= {
            p + "input_layernorm.weight": state[g + "attn_norm.weight"],
            p + "post_attention_layernorm.weight": state[g + "ffn_norm.weight"],
            p + "self_attn.q_proj.weight": state[g + "attn.wq.weight"],
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": state[g + "attn.wo.weight"],
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": state[g + "ffn.w2.weight"],
        }
        if cfg.qkv_bias:
            kb, vb = state[g + "attn.wkv.bias"].chunk(2, dim=0)
            out |= {
                p + "self_attn.q_proj.bias": state[g + "attn.wq.bias"],
                p + "self_attn.k_proj.bias": kb,
                p + "self_attn.v_proj.bias": vb,
            }
    return {k: v.detach().cpu().clone() for k, v in out.items()}  # own storage: chunks are views of one tensor


def from_hf(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors (already checked against expected_shapes) -> GhostVis's state dict."""
    out = {
        "embed.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
        "lm_head.weight": hf["model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"],
    }
    for i in range(cfg.n_layers):
        g, p = f"blocks.{i}.", f"model.layers.{i}."
        out |= {
            g + "attn_norm.weight": hf[p + "input_layernorm.weight"],
            g + "ffn_norm.weight": hf[p + "post_attention_layernorm.weight"],
            g + "attn.wq.weight": hf[p + "self_attn.q_proj.weight"],
            g + "attn.wkv.weight": torch.cat([hf[p + "self_attn.k_proj.weight"], hf[p + "self_attn.v_proj.weight"]]),
            g + "attn.wo.weight": hf[p + "self_attn.o_proj.weight"],
            g + "ffn.w13.weight": torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]),
            g + "ffn.w2.weight": hf[p + "mlp.down_proj.weight"],
        }
        if cfg.qkv_bias:
            out |= {
                g + "attn.wq.bias": hf[p + "self_attn.q_proj.bias"],
                g + "attn.wkv.bias": torch.cat([hf[p + "self_attn.k_proj.bias"], hf[p + "self_attn.v_proj.bias"]]),
            }
    return out
