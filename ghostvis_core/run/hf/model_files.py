"""The two files an export adds beside the weights to say what the model was trained on: the training
manifest (ghostvis_core/run/hf/manifest.py) and the model card rendered from it (card.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ghostvis_core.run.hf.card import CARD_FILE, render_card
from ghostvis_core.run.hf.manifest import MANIFEST_FILE, manifest_bytes, manifest_sha256
from ghostvis_core.store.files import atomic_write


def write_model_files(out_dir: Path, manifest: dict[str, Any], licence: dict[str, Any] | None = None) -> str:
    """Write ghostvis_manifest.json and README.md into `out_dir`; the manifest's sha256."""
    digest = manifest_sha256(manifest)
    atomic_write(out_dir / MANIFEST_FILE, manifest_bytes(manifest))
    atomic_write(out_dir / CARD_FILE, render_card(manifest, digest, licence).encode())
    return digest
