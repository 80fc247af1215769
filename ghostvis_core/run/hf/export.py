"""Export a trained stage as a Hugging Face checkpoint: config.json, safetensors (sharded when large,
with model.safetensors.index.json), generation_config.json, tokenizer.json + tokenizer_config.json
(chat template), for a vision stage vision/ beside it, and what the model was trained on: the training
manifest (ghostvis_manifest.json, from the ledger) and the model card (README.md) rendered from it.

`python -m ghostvis_core.run.hf.export --store URI --stage sft --to DIR` does it in a process of its own:
what Dagster starts (the `export_model` job), so the Dagster process never loads a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import save_torch_state_dict

from ghostvis_core.data.bpe_tokenizer import Tokenizer
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.config import ModelConfig
from ghostvis_core.run.hf.manifest import build_manifest
from ghostvis_core.run.hf.names import hf_config, to_hf
from ghostvis_core.run.hf.summary_input import read_declared
from ghostvis_core.run.hf.tokenizer_json import save_hf_tokenizer
from ghostvis_core.run.hf.vision import save_vision
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.run.trained_model import load_from_store
from ghostvis_core.store import Store, open_store

MAX_SHARD_SIZE = "5GB"  # the Hub's convention; safetensors shards of at most this size


def export_model(model: GPT, tok: Tokenizer, out_dir: Path, *, max_shard_size: str | int = MAX_SHARD_SIZE) -> Path:
    """Write `model` (and `tok`) as a transformers checkpoint in `out_dir`; the weights keep their dtype."""
    cfg: ModelConfig = model.cfg
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("vision.")}
    tensors = to_hf(state, cfg)
    dtype = tensors["model.embed_tokens.weight"].dtype
    pad = tok.special("<|pad|>") if tok.has("<|pad|>") else None
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

    GenerationConfig(
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad if pad is not None else eos, do_sample=False
    ).save_pretrained(str(out_dir))


def export_run(
    store: Store, stage: str, run_key: str | None, out_dir: str | Path, licence: dict[str, Any] | None = None
) -> Path:
    """Export a completed run of `stage` in `store` (run_key None: the newest completed run) to `out_dir`,
    with its training manifest and model card (`licence`: summary.yaml's declarations, whose licence
    fields the card states)."""
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.run.hf.model_files import write_model_files

    trained = load_from_store(store, stage, run_key)
    with torch.no_grad():
        out = export_model(trained.model, trained.tok, Path(out_dir))
    write_model_files(out, build_manifest(store, Ledger.in_store(store), stage, trained.run_key), licence)
    return out


def main(argv: list[str] | None = None) -> int:
    """Export in this process; the folder's path on stdout's last line, a refusal on stderr (exit 2)."""
    ap = argparse.ArgumentParser(prog="python -m ghostvis_core.run.hf.export", description=__doc__)
    ap.add_argument("--store", required=True, help="the artifact store's URI (a folder or s3://bucket/prefix)")
    ap.add_argument("--stage", required=True)
    ap.add_argument("--run-key", help="the run to export (default: the stage's newest completed run)")
    ap.add_argument("--to", required=True, help="the destination folder")
    ap.add_argument("--summary", help="the provider's summary.yaml: the model card's licence fields")
    args = ap.parse_args(argv)
    try:
        licence = read_declared(Path(args.summary), required=True) if args.summary else None
        out = export_run(open_store(args.store), args.stage, args.run_key, args.to, licence)
    except GhostvisError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
