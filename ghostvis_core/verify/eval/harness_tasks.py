"""The lm-evaluation-harness tasks GhostVis runs, and the files they read: which tasks run by default, the
digest of the task folders (part of the evaluation's identity) and the held-out cloze data. Kept apart from
`harness.py`, which imports lm_eval, datasets and torch: the Dagster process reads these names when
it loads the definitions, and imports the harness only when an evaluation runs.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from ghostvis_core.data.eval_texts import LM_EVAL_TASKS_DIR
from ghostvis_core.errors import GhostvisError

TASKS_DIR = LM_EVAL_TASKS_DIR
CLOZE_TASK, CLOZE_FILE = "ghostvis_cloze", "heldout_cloze.jsonl"  # the task and the file it reads from held_out_dir
DEFAULT_TASKS = ("ghostvis_capitals", "ghostvis_arithmetic", CLOZE_TASK)


def task_files_digest(include: Sequence[str] = ()) -> str:
    """sha256 over the task folders' files (names and bytes): a changed task or data file changes it."""
    h = hashlib.sha256()
    for root in (TASKS_DIR, *(Path(p).expanduser().resolve() for p in include)):
        for f in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


_WORD = re.compile(r"(?<= )([A-Za-z][A-Za-z_]{2,})\b")


def cloze_items(texts: Iterable[str], limit: int, min_chars: int = 120, max_chars: int = 400) -> list[dict[str, str]]:
    """LAMBADA-style items from paragraphs of held-out text: each passage is cut before the last word
    (3+ letters, after a space) that already appeared in it, which is the target (with its space)."""
    items: list[dict[str, str]] = []
    for text in texts:
        for para in re.split(r"\n\s*\n", text):
            para = para.strip()
            if len(items) >= limit:
                return items
            if min_chars <= len(para) <= max_chars:
                for m in reversed(list(_WORD.finditer(para))):
                    if m.start() >= min_chars // 2 and re.search(rf"\b{m.group(1)}\b", para[: m.start()]):
                        items.append({"context": para[: m.start() - 1], "target": " " + m.group(1)})
                        break
    return items


def cloze_jsonl(texts_by_source: dict[str, Iterable[str]], per_source: int = 10) -> str:
    """The cloze task's data file (JSON Lines, saved as CLOZE_FILE in its held_out_dir): up to
    `per_source` items from each held-out source's text."""
    rows = [item for source in sorted(texts_by_source) for item in cloze_items(texts_by_source[source], per_source)]
    if not rows:
        raise GhostvisError(
            f"ghostvis_cloze: the held-out sources {sorted(texts_by_source)} have no paragraph "
            f"to cut; drop ghostvis_cloze from harness_tasks or add validation text"
        )
    return "".join(json.dumps(r) + "\n" for r in rows)
