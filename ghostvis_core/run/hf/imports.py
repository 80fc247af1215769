"""Import a Hugging Face Llama / Qwen2 checkpoint as the initial checkpoint of a stage.

Everything is checked from the files' headers before any weight is read (so before torchrun):
architecture, every expected tensor present with its shape, none unexpected, each file readable.
The weights are then written once into the store as an ordinary GhostVis checkpoint
(checkpoints/hf_import/<key>/step_000000000, key = hash of the source's content), with the
tokenizer from its tokenizer.json saved as a store tokenizer, so the trainer, the DPO reference and
every node load it exactly as they load an upstream stage's checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ghostvis_core.data.bpe_tokenizer import Tokenizer, save_tokenizer
from ghostvis_core.data.brought_tokenizer import read_tokenizer_file
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.config import ModelConfig
from ghostvis_core.run.hf.checkpoint_sources import local_copy
from ghostvis_core.run.hf.names import expected_shapes, from_hf, model_config
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.runs.lookup import Upstream
from ghostvis_core.store import Store
from ghostvis_core.store.layout import step_dir_name

IMPORT_STAGE = "hf_import"  # the "stage" of imported checkpoints in the store
INDEX_FILE = "model.safetensors.index.json"
# Buffers some older checkpoints carry; recomputed, never weights.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class HFCheckpoint:
    """A checked HF checkpoint folder: its model config and where each of its tensors is."""

    folder: Path
    model: ModelConfig
    files: dict[str, Path]  # tensor name -> the safetensors file holding it


def inspect_checkpoint(folder: Path, where: str) -> HFCheckpoint:
    """Config, tensor names and shapes checked against what the model needs (no weight is read)."""
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise GhostvisError(f"{where}: cannot read config.json ({exc})") from None
    cfg = model_config(hf, where)
    expected = expected_shapes(cfg)
    files, found = {}, {}
    for path in _weight_files(folder, where):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    found[name], files[name] = tuple(f.get_slice(name).get_shape()), path
        except (SafetensorError, OSError) as exc:
            raise GhostvisError(
                f"{where}: {path.name} is not a readable safetensors file ({exc}); it is corrupt or "
                "truncated: download it again"
            ) from None
    found = {k: v for k, v in found.items() if not k.endswith(IGNORED_SUFFIXES)}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [
        f"{k} has shape {found[k]}, expected {expected[k]}"
        for k in sorted(expected)
        if k in found and found[k] != expected[k]
    ]
    if missing or unexpected or wrong:
        parts = (
            (
                [
                    f"missing tensors {', '.join(missing[:8])}"
                    + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
                ]
                if missing
                else []
            )
            + ([f"unexpected tensors {', '.join(unexpected[:8])}"] if unexpected else [])
            + wrong[:8]
        )
        raise GhostvisError(
            f"{where}: the weights do not fit its config.json ({hf['architectures'][0]}, "
            f"{cfg.n_layers} layers, hidden {cfg.d_model}): {'; '.join(parts)}; the checkpoint is "
            "incomplete or its config.json belongs to another model: fix or re-download it"
        )
    return HFCheckpoint(folder, cfg, {k: files[k] for k in expected})


def _weight_files(folder: Path, where: str) -> list[Path]:
    if (folder / INDEX_FILE).is_file():
        names = sorted(set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values()))
    else:
        names = sorted(p.name for p in folder.glob("*.safetensors"))
    absent = [n for n in names if not (folder / n).is_file()]
    if absent or not names:
        raise GhostvisError(
            f"{where}: weight file(s) {', '.join(absent) or '*.safetensors'} missing; a checkpoint "
            "needs its safetensors weights (PyTorch .bin files are not read: convert them)"
        )
    return [folder / n for n in names]


def load_tensors(hc: HFCheckpoint) -> dict[str, torch.Tensor]:
    """The checked checkpoint's weights in GhostVis names; the count is checked against the model's."""
    hf: dict[str, torch.Tensor] = {}
    for path in sorted(set(hc.files.values())):
        with safe_open(str(path), framework="pt") as f:
            hf |= {k: f.get_tensor(k) for k in f.keys() if hc.files.get(k) == path}
    if len(hf) != len(expected_shapes(hc.model)):
        raise GhostvisError(
            f"checkpoint {hc.folder}: loaded {len(hf)} tensors, the model needs "
            f"{len(expected_shapes(hc.model))}; re-download it"
        )
    return from_hf(hf, hc.model)


@dataclass(frozen=True)
class Imported:
    upstream: Upstream
    tokenizer: Tokenizer


def import_checkpoint(store: Store, uri: str) -> Imported:
    """Fetch, check and (once per content) convert the checkpoint at `uri` into the store."""
    where = f"init_from {uri}"
    with local_copy(uri) as folder:
        hc = inspect_checkpoint(folder, where)
        tok = _save_tokenizer_of(store, hc)
        key = f"hf-{_content_digest(hc)}"
        step = step_dir_name(0)
        if not store.exists("checkpoint_marker", IMPORT_STAGE, key, step):
            _write_checkpoint(store, hc, key, step, uri)
    return Imported(Upstream(IMPORT_STAGE, key, store.uri_of("checkpoint", IMPORT_STAGE, key, step)), tok)


def import_tokenizer(store: Store, uri: str, special_tokens: dict[str, str] | None = None) -> Tokenizer:
    """The tokenizer of the HF checkpoint at `uri`, saved in the store, so the data can be tokenized
    as that model was trained before a stage starts from it (the `tokenizer` asset's `from_model`;
    `special_tokens` maps GhostVis's chat roles onto its tokens, ghostvis_core.data.brought_tokenizer)."""
    with local_copy(uri) as folder:
        return _save_tokenizer_of(store, inspect_checkpoint(folder, f"tokenizer from_model {uri}"), special_tokens)


def _save_tokenizer_of(store: Store, hc: HFCheckpoint, special_tokens: dict[str, str] | None = None) -> Tokenizer:
    path = hc.folder / "tokenizer.json"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise GhostvisError(
            f"checkpoint {hc.folder}: cannot read its tokenizer.json ({exc}); the folder needs one"
        ) from None
    tok = read_tokenizer_file(str(path), data, special_tokens, vocab_size=hc.model.vocab_size)
    save_tokenizer(tok, store)
    return tok


def _content_digest(hc: HFCheckpoint) -> str:
    h = hashlib.sha256((hc.folder / "config.json").read_bytes())
    for path in sorted(set(hc.files.values())) + [hc.folder / "tokenizer.json"]:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]


def _write_checkpoint(store: Store, hc: HFCheckpoint, key: str, step: str, uri: str) -> None:
    """model.safetensors + config.json ({stage, model}: what presets.resolve inherits) + COMPLETE, atomically."""
    final = store.writable("checkpoint", IMPORT_STAGE, key, step)
    tmp = final.parent / f".tmp-{step}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tensors = load_tensors(hc)  # tied: embed and lm_head are one tensor, which safetensors stores twice
        save_file(
            {
                k: v.clone() if k == "lm_head.weight" and hc.model.tie_embeddings else v.contiguous()
                for k, v in tensors.items()
            },
            str(tmp / "model.safetensors"),
        )
        (tmp / "config.json").write_text(
            json.dumps({"stage": IMPORT_STAGE, "source": uri, "model": asdict(hc.model)}, indent=2, sort_keys=True)
        )
        ckpt.write_marker(tmp, 0)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    store.publish("checkpoint", IMPORT_STAGE, key, step)


def load_hf_model(folder: str | Path) -> GPT:
    """A GhostVis GPT with the weights of the HF checkpoint in `folder` (checked as for a stage), in eval mode."""
    hc = inspect_checkpoint(Path(folder), f"checkpoint {folder}")
    model = GPT(hc.model)
    model.load_state_dict(load_tensors(hc), strict=True)
    return model.eval()
