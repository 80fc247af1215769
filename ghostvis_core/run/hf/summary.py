"""`ghostvis summary --stage S`: the public summary of a model's training content, in the three parts the
EU AI Office's template for general-purpose models asks for, every figure from the model's training
manifest (so from the ledger, over every stage of its lineage):

- general: the model, and per modality what it was trained on (text: tokens and documents; image:
  images and their caption tokens), a document read by two stages counted in each;
- sources: every source by the category the provider declared, its domains, tokens and its share of
  all trained tokens;
- processing: what tokenization removed per reason (exact duplicates, near duplicates, empty text, ...)
  and the sets decontamination compared the training data against.

What GhostVis cannot know (provider, licences, opt-out policy, measures against illegal content,
crawlers, each source's category) comes from summary.yaml (ghostvis_core/run/hf/summary_input.py) and
is marked as declared.
"""

from __future__ import annotations

from typing import Any

from ghostvis_core.run.hf.manifest import add_dropped

IMAGE_KINDS = ("image_caption",)  # source kinds whose documents are images (with a caption)


def source_totals(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per source over the lineage's stages: kind, domains, tokens and raw rows read."""
    out: dict[str, dict[str, Any]] = {}
    for stage in manifest["stages"]:
        for src in stage["sources"]:
            t = out.setdefault(src["source"], {"kind": src["kind"], "domains": set(), "tokens": 0, "rows": 0})
            t["domains"] |= set(src["domains"])
            t["tokens"] += src["tokens"]
            t["rows"] += src["rows_read"]
    return out


def general(manifest: dict[str, Any], declared: dict[str, Any], totals: dict[str, dict]) -> dict[str, Any]:
    text = [t for t in totals.values() if t["kind"] not in IMAGE_KINDS]
    images = [t for t in totals.values() if t["kind"] in IMAGE_KINDS]
    modalities: dict[str, dict[str, int]] = {
        "text": {"tokens": sum(t["tokens"] for t in text), "documents": sum(t["rows"] for t in text)}
    }
    if images:
        modalities["image"] = {"images": sum(t["rows"] for t in images), "tokens": sum(t["tokens"] for t in images)}
    return {
        "model": manifest["model"],
        "stages": [s["stage"] for s in manifest["stages"]],
        "tokenizer_id": manifest["tokenizer_id"],
        "provider": declared.get("provider"),
        "model_name": declared.get("model_name"),
        "modalities": modalities,
        "tokens": sum(t["tokens"] for t in totals.values()),
    }


def sources(declared: dict[str, Any], totals: dict[str, dict]) -> list[dict[str, Any]]:
    everything = sum(t["tokens"] for t in totals.values())
    mine = declared.get("sources", {})
    return [
        {
            "source": name,
            "category": mine.get(name, {}).get("category", "undeclared"),
            "kind": t["kind"],
            "domains": sorted(t["domains"]),
            "tokens": t["tokens"],
            "share": round(t["tokens"] / everything, 6) if everything else 0.0,
            "licence": mine.get(name, {}).get("licence"),
        }
        for name, t in sorted(totals.items(), key=lambda kv: (-kv[1]["tokens"], kv[0]))
    ]


def processing(manifest: dict[str, Any], declared: dict[str, Any]) -> dict[str, Any]:
    removed: dict[str, dict[str, int]] = {}
    for stage in manifest["stages"]:
        for src in stage["sources"]:
            add_dropped(removed, src["dropped"])
    return {
        "removed": dict(sorted(removed.items())),
        "decontamination": [{"stage": s["stage"], **s["decontamination"]} for s in manifest["stages"]],
        "opt_out_policy": declared.get("opt_out_policy"),
        "illegal_content_measures": declared.get("illegal_content_measures"),
        "crawlers": declared.get("crawlers"),
    }


def build_summary(manifest: dict[str, Any], declared: dict[str, Any]) -> dict[str, Any]:
    """The three parts, from the manifest and the provider's declarations (summary.yaml)."""
    totals = source_totals(manifest)
    return {
        "general": general(manifest, declared, totals),
        "sources": sources(declared, totals),
        "processing": processing(manifest, declared),
    }


def _declared(value: Any) -> str:
    return f"{value} (declared)" if value else "not declared (summary.yaml)"


def render_markdown(summary: dict[str, Any]) -> str:
    """The summary as Markdown: one heading per part, a table per list of figures."""
    g, p = summary["general"], summary["processing"]
    out = [f"# Training content summary: {g['model']['stage']} ({g['model']['run_key']})", "", "## 1. General", ""]
    out += [f"- provider: {_declared(g['provider'])}", f"- model name: {_declared(g['model_name'])}"]
    out += [f"- stages: {', '.join(g['stages'])}", f"- tokenizer: {g['tokenizer_id']}", f"- tokens: {g['tokens']}"]
    for modality, figures in g["modalities"].items():
        out.append(f"- {modality}: " + ", ".join(f"{v} {k}" for k, v in figures.items()))
    out += ["", "## 2. Sources", "", "| source | category | kind | domains | tokens | share | licence |"]
    out.append("|---|---|---|---|---|---|---|")
    for s in summary["sources"]:
        out.append(
            f"| {s['source']} | {s['category']} | {s['kind']} | {', '.join(s['domains'])} | {s['tokens']} | "
            f"{s['share']} | {s['licence'] or 'undeclared'} |"
        )
    out += ["", "## 3. Processing", "", "| removed because | documents | tokens |", "|---|---|---|"]
    out += [f"| {reason} | {n['docs']} | {n['tokens']} |" for reason, n in p["removed"].items()] or [
        "| nothing | 0 | 0 |"
    ]
    out.append("")
    for d in p["decontamination"]:
        sets = ", ".join(d["eval_sets"] + [f"validation of {v}" for v in d["validation_sources"]]) or "none"
        out.append(f"- decontamination of {d['stage']}: compared with {sets} (max overlap {d['max_overlap']})")
    out += [f"- opt-out policy: {_declared(p['opt_out_policy'])}"]
    out += [f"- illegal content: {_declared(p['illegal_content_measures'])}", f"- crawlers: {_declared(p['crawlers'])}"]
    return "\n".join(out) + "\n"
