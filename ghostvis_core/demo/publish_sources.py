"""The embedded demo sources, published under the home as if remote: each gets a manifest with file://
URLs, so the pipeline downloads, verifies and tokenizes them exactly as it does a user's source."""

from __future__ import annotations

from ghostvis_core.data.shard_manifest import Manifest, manifest_for_files
from ghostvis_core.demo.corpus import TEXT_SOURCES, build_text_source
from ghostvis_core.demo.tasks import REWARD_RULES, TASK_SOURCES, build_task_source
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home

# source -> kind, in the order the demo registers them
DEMO_SOURCES: dict[str, str] = {**{s: "text" for s in TEXT_SOURCES}, **TASK_SOURCES}


def publish_demo_source(home: Home, source: str) -> Manifest:
    """Build a demo source under <home>/sources/<source>/ once; its manifest has file:// URLs."""
    out = home.sources / source
    manifest_path = out / "manifest.json"
    if manifest_path.exists():
        return Manifest.load(manifest_path)
    if source not in DEMO_SOURCES:
        raise GhostvisError(f"unknown demo source '{source}'; demo sources are: {', '.join(DEMO_SOURCES)}")
    files = build_text_source(source, out) if source in TEXT_SOURCES else build_task_source(source, out)
    manifest = manifest_for_files(source, DEMO_SOURCES[source], files)
    manifest.reward = REWARD_RULES.get(source, "")
    manifest.save(manifest_path)  # last: a source without its manifest is rebuilt
    return manifest
