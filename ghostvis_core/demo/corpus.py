"""The embedded demo text corpus: built from the Python standard library, so it needs no network.

Two sources, written as Parquet shards with the FineWeb-Edu columns, so the rest of the pipeline
treats them exactly like downloaded data:

- `demo_prose`: English prose. The docstrings of every stdlib module (read with `ast`, never by
  importing the module), one document per module, plus the `pydoc` help topics (one per topic).
- `demo_code`: Python source files of the stdlib, one file per document.

Each source holds out 8% of its documents as validation, independently, yet the two overlap: a
module's docstrings are both a prose document and part of its code. So after the split, a training
document of either source that shares any 13-gram fingerprint with a validation document of either
source, or with a shipped evaluation item, is dropped (ghostvis_core/data/decontaminate.py; stricter
than the gate's `contamination.max_overlap`). The generated task data (demo/tasks.py) shares no
13-word run with stdlib text (tests/test_demo_corpus.py checks both directions).

The build is deterministic (sorted directory walks, a fixed seed, no timestamps), so the same
Python installation always yields byte-identical shards, and hence the same tokenizer and ledger.
"""

from __future__ import annotations

import ast
import hashlib
import io
import os
import random
import sys
import sysconfig
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ghostvis_core.data.decontaminate import HeldOut, drop_shared, held_out
from ghostvis_core.demo.columns import demo_schema
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store.files import replacing

TEXT_SOURCES = ("demo_prose", "demo_code")

SEED = 1337
DEMO_TRAIN_SHARDS = 4
VAL_FRACTION = 0.08
MIN_VAL_DOCS = 20
ROW_GROUP_SIZE = 1000

PROSE_MIN_BYTES = 200
PROSE_MAX_BYTES = 20 * 1024
CODE_MIN_BYTES = 500
CODE_MAX_BYTES = 48 * 1024
CODE_CAP_BYTES = 3 * 1024 * 1024

# Tests, IDE/demo apps and third-party packages are not "the stdlib" we want to learn from.
_EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "turtledemo", "__pycache__"})
# Generated at build time from machine-specific paths; they would make the corpus differ between
# two installations of the same Python version.
_EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")
# Already the source of the pydoc topics in demo_prose; as code it is one 750 KB string literal.
_TOPICS_FILE = "pydoc_data/topics.py"

SCHEMA = demo_schema("text", "id", "dump", "url", "file_path", "language", "language_score", "token_count")


@dataclass(frozen=True)
class _Doc:
    text: str
    url: str
    file_path: str


def build_text_source(source: str, out_dir: Path) -> list[tuple[Path, str]]:
    """Write the shards of one demo text source into out_dir; return [(path, split)] with split in
    {"train","validation"}, train shards first, sorted by name. Training documents that share a
    fingerprint with held-out text are dropped (module docstring)."""
    languages = {"demo_prose": "en", "demo_code": "python"}
    if source not in languages:
        raise GhostvisError(
            f"unknown demo text source {source!r}; the embedded demo sources are {', '.join(TEXT_SOURCES)}"
        )
    train, val = _split(source)
    train = drop_shared(train, lambda d: d.text, _held_out())
    shards = [(f"{i:05d}.parquet", "train", train[i::DEMO_TRAIN_SHARDS]) for i in range(DEMO_TRAIN_SHARDS)]
    shards.append(("val_00000.parquet", "validation", val))

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, split, shard_docs in shards:
        path = out_dir / name
        _write_shard(path, source, languages[source], shard_docs)
        written.append((path, split))
    return written


@cache
def _split(source: str) -> tuple[tuple[_Doc, ...], tuple[_Doc, ...]]:
    """(train, validation) documents of a source before decontamination. Cached per process: each
    source's build needs the other's validation documents, and reading the stdlib prose is slow."""
    docs = _dedupe(_prose_docs() if source == "demo_prose" else _code_docs())
    random.Random(SEED).shuffle(docs)
    n_val = max(MIN_VAL_DOCS, round(VAL_FRACTION * len(docs)))
    return tuple(docs[n_val:]), tuple(docs[:n_val])


@cache
def _held_out() -> HeldOut:
    """What no training document of either source may share a fingerprint with: the validation
    documents of both sources (docstrings are in the code and in the prose) and the shipped evaluation items."""
    return held_out(d.text for source in TEXT_SOURCES for d in _split(source)[1])


# --- shared helpers ---------------------------------------------------------------------------


def _stdlib_files() -> list[tuple[str, str]]:
    """(path relative to the stdlib root, text) of every stdlib .py file we use, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith(_EXCLUDED_PREFIXES))
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith(_EXCLUDED_PREFIXES):
                continue
            path = Path(dirpath) / name
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
            files.append((path.relative_to(root).as_posix(), text))
    return files


def _parse(text: str) -> ast.Module | None:
    with warnings.catch_warnings():  # invalid escape sequences in old modules are not our concern
        warnings.simplefilter("ignore")
        try:
            return ast.parse(text)
        except SyntaxError:
            return None


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def _pack(units: list[tuple[str, str]], limit: int, sep: str) -> list[tuple[str, str]]:
    """Greedily join consecutive (anchor, text) units into pieces of at most `limit` bytes.

    Each piece keeps the anchor of its first unit, so its url points at where it starts.
    """
    pieces: list[tuple[str, list[str]]] = []
    sep_size, size = _nbytes(sep), 0
    for anchor, text in units:
        n = _nbytes(text)
        if pieces and size + sep_size + n <= limit:
            pieces[-1][1].append(text)
            size += sep_size + n
        else:
            pieces.append((anchor, [text]))
            size = n
    return [(anchor, sep.join(parts)) for anchor, parts in pieces]


def _url(scheme: str, rel: str, anchor: str) -> str:
    return f"{scheme}://{rel}" + (f"#{anchor}" if anchor else "")


def _dedupe(docs: list[_Doc]) -> list[_Doc]:
    """Drop exact duplicate texts: the id is a hash of the text and must be unique."""
    seen: set[str] = set()
    unique = []
    for doc in docs:
        if doc.text not in seen:
            seen.add(doc.text)
            unique.append(doc)
    return unique


def _write_shard(path: Path, source: str, language: str, docs: list[_Doc]) -> None:
    """Write atomically: a reader never sees a half-written shard under the final name."""
    dump = "python-{}.{}.{}-stdlib".format(*sys.version_info[:3])
    texts = [d.text for d in docs]
    table = pa.table(
        {
            "text": texts,
            "id": [f"{source}:" + hashlib.sha1(t.encode("utf-8")).hexdigest()[:16] for t in texts],
            "dump": [dump] * len(docs),
            "url": [d.url for d in docs],
            "file_path": [d.file_path for d in docs],
            "language": [language] * len(docs),
            "language_score": [1.0] * len(docs),
            "token_count": [-1] * len(docs),  # the reference gpt2 count needs a download
        },
        schema=SCHEMA,
    )
    with replacing(path) as tmp:
        pq.write_table(table, tmp, row_group_size=ROW_GROUP_SIZE, compression="zstd")


# --- demo_prose -------------------------------------------------------------------------------


def _prose_docs() -> list[_Doc]:
    """One document per module (its docstrings under qualified-name headings), one per pydoc topic."""
    docs = []
    for rel, text in _stdlib_files():
        tree = _parse(text)
        if tree is None:
            continue
        module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        sections = [("", ast.get_docstring(tree) or "")] + _docstrings(tree, "")
        units = [("", f"# {module}")]
        for anchor, doc in sections:
            if doc:
                first, *rest = doc.split("\n\n")
                heading = f"## {anchor}\n\n" if anchor else ""  # headings stay with their first paragraph
                units += [(anchor, heading + first), *((anchor, p) for p in rest)]
        for anchor, piece in _pack(units, PROSE_MAX_BYTES, "\n\n"):
            if _nbytes(piece) >= PROSE_MIN_BYTES:
                docs.append(_Doc(piece, _url("stdlib", rel, anchor), rel))

    from pydoc_data.topics import topics  # a plain dict of strings; importing it runs no code

    for name in sorted(topics):  # one document per topic, whatever its length
        if _nbytes(topics[name]) >= PROSE_MIN_BYTES:
            docs.append(_Doc(topics[name], f"pydoc://topics/{name}", _TOPICS_FILE))
    return docs


# The nodes a def can be under: statements and the clauses that hold statement lists. Expressions never
# hold a def, so the walk skips them (they are most of a module's nodes).
_STATEMENT_NODES = (ast.stmt, ast.excepthandler, ast.match_case)


def _docstrings(node: ast.AST, prefix: str) -> list[tuple[str, str]]:
    """(qualified name, docstring) of every class and function under node, in source order."""
    found = []
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, _STATEMENT_NODES):
            continue
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            qualname = prefix + child.name
            doc = ast.get_docstring(child)
            if doc:
                found.append((qualname, doc))
            inner = qualname + ("." if isinstance(child, ast.ClassDef) else ".<locals>.")
            found += _docstrings(child, inner)
        else:
            found += _docstrings(child, prefix)
    return found


# --- demo_code --------------------------------------------------------------------------------


def _code_docs() -> list[_Doc]:
    """Whole source files in a seeded order up to the cap; big files cut at top-level defs."""
    files = [(rel, text) for rel, text in _stdlib_files() if rel != _TOPICS_FILE and _nbytes(text) >= CODE_MIN_BYTES]
    random.Random(SEED).shuffle(files)
    docs, total = [], 0
    for rel, text in files:
        size = _nbytes(text)
        if total + size > CODE_CAP_BYTES:
            continue
        total += size
        pieces = [("", text)] if size <= CODE_MAX_BYTES else _split_code(text)
        docs += [_Doc(piece, _url("stdlib", rel, anchor), rel) for anchor, piece in pieces]
    return docs


def _split_code(text: str) -> list[tuple[str, str]]:
    """Cut a large file before top-level def/class statements (with their decorators and the
    comment lines just above) into pieces of at most CODE_MAX_BYTES; a block that alone is too
    big is cut at line boundaries."""
    # Only \n, \r\n and \r end a line for ast; str.splitlines would also split at \f and friends.
    lines = io.StringIO(text, newline="").readlines()
    tree = _parse(text)
    starts = [(0, "")]
    for node in tree.body if tree else []:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            while start > starts[-1][0] and lines[start - 1].lstrip().startswith("#"):
                start -= 1
            if start > starts[-1][0]:
                starts.append((start, node.name))
    units = []
    bounds = [s for s, _ in starts[1:]] + [len(lines)]
    for (start, anchor), end in zip(starts, bounds):
        block = "".join(lines[start:end])
        if _nbytes(block) <= CODE_MAX_BYTES:
            units.append((anchor, block))
        else:
            # pieces starting inside the block point at their line: #L<n>, as code browsers do
            units += [(anchor if i == start else f"L{i + 1}", lines[i]) for i in range(start, end)]
    return _pack(units, CODE_MAX_BYTES, "")
