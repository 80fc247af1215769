"""Reading earlier materializations' metadata and formatting Markdown tables for the UI."""

from __future__ import annotations

from typing import Any

from dagster import AssetKey

from ghostvis_core.errors import GhostvisError


def latest_metadata(context, asset: str) -> dict[str, Any]:
    """Metadata of the newest materialization of `asset` (raw values), or a clear error."""
    return newest_metadata(context.instance, asset)


def newest_metadata(instance, asset: str) -> dict[str, Any]:
    """latest_metadata outside an asset: from the Dagster instance itself."""
    md = newest_metadata_or_none(instance, asset)
    if md is None:
        raise GhostvisError(f"asset `{asset}` has never been materialized; materialize it first")
    return md


def newest_metadata_or_none(instance, asset: str) -> dict[str, Any] | None:
    """The newest materialization's metadata as raw values (the one reader of it), None when there is none."""
    event = instance.get_latest_materialization_event(AssetKey(asset))
    if event is None or event.asset_materialization is None:
        return None
    return {k: getattr(v, "value", v) for k, v in event.asset_materialization.metadata.items()}


def materializations(instance, key: AssetKey, page: int = 1000) -> list:
    """Every materialization record of an asset (all partitions), newest first, read page by page."""
    out, cursor = [], None
    while True:
        result = instance.fetch_materializations(key, limit=page, cursor=cursor)
        out += result.records
        if not result.has_more:
            return out
        cursor = result.cursor


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table whose every row stays one row: a cell's `|` would start a new column and a
    line break end the table (a sampled completion holds both), so `|` is escaped and line breaks
    become spaces."""
    lines = ["| " + " | ".join(md_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(md_cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def md_cell(value: Any) -> str:
    """One table cell: integers with thousands separators, one line, `|` escaped."""
    text = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
    return " ".join(text.replace("|", "\\|").split())
