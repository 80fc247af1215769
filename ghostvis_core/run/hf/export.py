"""Export a trained stage as a Hugging Face checkpoint: config.json, safetensors (sharded when large,
with model.safetensors.index.json), generation_config.json, tokenizer.json + tokenizer_config.json
(chat template) and, for a vision stage, vision/ beside it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict

from ghostvis_core.plan.config import ModelConfig
from ghostvis_core.data.tokenizer import Tokenizer
from ghostvis_core.run.train.trained import load_stage
from ghostvis_core.home import Home
from ghostvis_core.run.hf.names import hf_config, to_hf
from ghostvis_core.run.hf.tokenizer_json import save_hf_tokenizer
from ghostvis_core.run.hf.vision import save_vision
from ghostvis_core.run.model.gpt import GPT

MAX_SHARD_SIZE = "5GB"  # the Hub's convention; safetensors shards of at most this size


def export_model(model: GPT, tok: Tokenizer, out_dir: Path, *, max_shard_size: str | int = MAX_SHARD_SIZE) -> Path:
    """Write `model` (and `tok`) as a transformers checkpoint in `out_dir`; the weights keep their dtype."""
    cfg: ModelConfig = model.cfg
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("vision.")}
    tensors = to_hf(state, cfg)
    dtype = tensors["model.embed_tokens.weight"].dtype
    pad = tok.special("<|pad|>") if "<|pad|>" in tok.enc.special_tokens_set else None
    config = hf_config(cfg, bos=tok.bos, eos=tok.eot, pad=pad, dtype=dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_torch_state_dict(tensors, out_dir, max_shard_size=max_shard_size, metadata={"format": "pt"})
    _save_generation_config(out_dir, bos=tok.bos, eos=tok.eot, pad=pad)
    save_hf_tokenizer(tok, out_dir, cfg.max_seq_len)
    if model.vision is not None:
        save_vision(model.vision, cfg.d_model, tok.special("<|image|>"), out_dir)
    return out_dir


def _save_generation_config(out_dir: Path, *, bos: int, eos: int, pad: int | None) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad if pad is not None else eos,
                     do_sample=False).save_pretrained(str(out_dir))


def export_run(home: Home, stage: str, run_key: str | None, out_dir: str | Path) -> Path:
    """Export a completed run of `stage` (run_key None: the newest completed run) to `out_dir`."""
    trained = load_stage(home, stage, run_key)
    with torch.no_grad():
        return export_model(trained.model, trained.tok, Path(out_dir))
