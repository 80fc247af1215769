"""The model card of an export (README.md, with the Hugging Face Hub's YAML metadata block): the lineage,
the data table and the evaluation figures, each rendered from the training manifest
(ghostvis_core/run/hf/manifest.py), the licence fields the user declared (summary.yaml's `license`,
`license_name`, `license_link`), and the manifest's file name and sha256.

Every line but the licence fields is generated, so `ghostvis verify-model` re-renders the card from the
shipped manifest and the card's own licence fields and names the first line that differs.
"""

from __future__ import annotations

from typing import Any

import yaml

from ghostvis_core.errors import GhostvisError
from ghostvis_core.run.hf.manifest import MANIFEST_FILE

CARD_FILE = "README.md"
LICENSE_FIELDS = ("license", "license_name", "license_link")  # the Hub's metadata keys a user declares
DIGEST_KEY = "ghostvis_manifest_sha256"


def _metadata(manifest: dict[str, Any], digest: str, licence: dict[str, Any]) -> str:
    meta: dict[str, Any] = {k: licence[k] for k in LICENSE_FIELDS if licence.get(k)}
    meta.setdefault("license", "other")
    meta |= {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["ghostvis", *[s["stage"] for s in manifest["stages"]]],
        "datasets": sorted({src["source"] for s in manifest["stages"] for src in s["sources"]}),
        DIGEST_KEY: digest,
    }
    return "---\n" + yaml.safe_dump(meta, sort_keys=True) + "---\n"


def _lineage(manifest: dict[str, Any]) -> list[str]:
    out = [
        "| stage | run | MLflow run | steps | real tokens | pad tokens | loss tokens | cropped tokens | Merkle root |"
    ]
    out.append("|" + "---|" * 9)
    for s in manifest["stages"]:
        t = s["tokens"]
        out.append(
            f"| {s['stage']} | {s['run_key']} | {s['mlflow_run_id']} | {s['steps']} | {t['real_tokens']} | "
            f"{t['pad_tokens']} | {t['loss_tokens']} | {t['cropped_tokens']} | {s['merkle']['root'][:16]} |"
        )
    return out


def _data(manifest: dict[str, Any]) -> list[str]:
    out = ["| stage | source | kind | domains | shards | raw rows | tokens | epochs | dropped docs |", "|" + "---|" * 9]
    for s in manifest["stages"]:
        for src in s["sources"]:
            epochs = max((sh["epochs"] for sh in src["shards"]), default=0)
            dropped = sum(d["docs"] for d in src["dropped"].values())
            out.append(
                f"| {s['stage']} | {src['source']} | {src['kind']} | {', '.join(src['domains'])} | "
                f"{len(src['shards'])} | {src['rows_read']} | {src['tokens']} | {epochs} | {dropped} |"
            )
    return out


def _evaluation(manifest: dict[str, Any]) -> list[str]:
    out = ["| stage | figure | before | after |", "|---|---|---|---|"]
    for s in manifest["stages"]:
        e = s["evaluation"]
        if e.get("val_loss") is not None:
            out.append(f"| {s['stage']} | validation loss | {e['val_loss_start']} | {e['val_loss']} |")
        for name, ba in e.get("evidence", {}).items():
            out.append(f"| {s['stage']} | {name} | {ba['before']} | {ba['after']} |")
    return out


def render_card(manifest: dict[str, Any], digest: str, licence: dict[str, Any] | None = None) -> str:
    """The card's text for this manifest (whose sha256 is `digest`) and the declared licence fields."""
    model = manifest["model"]
    return "\n".join(
        [
            _metadata(manifest, digest, licence or {}),
            f"# {model['stage']} ({model['run_key']})",
            "",
            "Trained with GhostVis. Every figure below is read from the training manifest "
            f"`{MANIFEST_FILE}` beside the weights (sha256 `{digest}`), which GhostVis built from its "
            "token ledger: check both with `ghostvis verify-model <this folder>`.",
            "",
            "## Lineage",
            "",
            *_lineage(manifest),
            "",
            "## Training data",
            "",
            *_data(manifest),
            "",
            "## Evaluation",
            "",
            *_evaluation(manifest),
            "",
            "## Licence",
            "",
            f"License: {(licence or {}).get('license') or 'other'} (declared by the model's provider).",
            "",
        ]
    )


def card_metadata(text: str) -> dict[str, Any]:
    """The card's YAML metadata block."""
    if not text.startswith("---\n") or "\n---\n" not in text[4:]:
        raise GhostvisError(f"{CARD_FILE}: no metadata block (a first line '---'); re-export the model")
    block = text[4 : text.index("\n---\n", 4) + 1]
    meta = yaml.safe_load(block)
    if not isinstance(meta, dict):
        raise GhostvisError(f"{CARD_FILE}: its metadata block is not a mapping; re-export the model")
    return meta


def card_licence(text: str) -> dict[str, str]:
    """The licence fields the card declares (what the user set), to re-render it from the manifest."""
    meta = card_metadata(text)
    return {k: str(meta[k]) for k in LICENSE_FIELDS if meta.get(k) is not None}
