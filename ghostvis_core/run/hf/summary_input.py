"""summary.yaml: what the provider declares for the training-content summary and the model card, which
GhostVis cannot know from its ledger: who provides the model, its licence, the opt-out policy, the
measures against illegal content, the crawlers, and per source its category and licence. Validated on
read: an unknown key, a wrong type or an unknown category is refused, naming it and what is allowed.

    provider: Example Labs
    model_name: ghostvis-demo
    license: apache-2.0            # license, license_name, license_link: the Hub card's fields
    opt_out_policy: robots.txt and TDM-reservation headers honoured at crawl time
    illegal_content_measures: ...
    crawlers: ...
    sources:
      demo_prose: {category: public_dataset, licence: CC-BY-4.0, notes: ...}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ghostvis_core.errors import GhostvisError

SUMMARY_FILE = "summary.yaml"  # in GHOSTVIS_HOME
TEXT_FIELDS = (
    "provider",
    "model_name",
    "license",
    "license_name",
    "license_link",
    "opt_out_policy",
    "illegal_content_measures",
    "crawlers",
)
SOURCE_FIELDS = ("category", "licence", "notes")
CATEGORIES = ("public_dataset", "licensed", "web_crawl", "user_data", "synthetic", "other")


def _check_source(path: Path, name: str, entry: Any) -> dict[str, str]:
    where = f"{path}: sources.{name}"
    if not isinstance(entry, dict):
        raise GhostvisError(f"{where}: give a mapping with {', '.join(SOURCE_FIELDS)}")
    for key, value in entry.items():
        if key not in SOURCE_FIELDS:
            raise GhostvisError(f"{where}.{key}: unknown field; a source takes {', '.join(SOURCE_FIELDS)}")
        if not isinstance(value, str):
            raise GhostvisError(f"{where}.{key}: give text, not {type(value).__name__}")
    if entry.get("category", "other") not in CATEGORIES:
        raise GhostvisError(f"{where}.category: {entry['category']!r} is not one of {', '.join(CATEGORIES)}")
    return dict(entry)


def read_declared(path: Path, required: bool = False) -> dict[str, Any]:
    """The validated declarations of summary.yaml at `path` ({} when there is none and it is not `required`:
    a path the user named is)."""
    path = Path(path)
    if not path.exists():
        if required:
            raise GhostvisError(f"{path}: no such file; give the path of your summary.yaml")
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise GhostvisError(f"{path}: give a mapping of {', '.join(TEXT_FIELDS)} and sources")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "sources":
            if not isinstance(value, dict):
                raise GhostvisError(f"{path}: sources: give a mapping of source name -> {', '.join(SOURCE_FIELDS)}")
            out["sources"] = {str(n): _check_source(path, str(n), e) for n, e in value.items()}
        elif key in TEXT_FIELDS:
            if not isinstance(value, str):
                raise GhostvisError(f"{path}: {key}: give text, not {type(value).__name__}")
            out[key] = value
        else:
            raise GhostvisError(f"{path}: unknown field {key!r}; summary.yaml takes {', '.join(TEXT_FIELDS)}, sources")
    return out
