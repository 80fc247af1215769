"""Identities: what an artifact is made of, as a short hash, and what code makes it.

An artifact's identity hashes the inputs that decide its content (resolved config, tokenizer id,
content hashes of the data it reads, upstream identities) and nothing about where it lives: no
path, URI, host, timestamp or launcher, so a moved store or another region finds the same
identities (docs/invariants.md, invariant 7). Each identity is saved in the store (artifact kind
"identity") beside what it made, so a later run can say which input changed.

A code version hashes the source of the modules that make an artifact: the entry modules and every
ghostvis_core module they import, directly or not. The hash is taken over the syntax tree without
docstrings, so comments, docstrings and formatting never make an artifact look out of date, and
nobody has to remember to bump a constant.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from ghostvis_core.errors import GhostvisError
from ghostvis_core.store.files import atomic_write

PACKAGE_ROOT = Path(__file__).resolve().parent
PACKAGE = PACKAGE_ROOT.name
CODE_VERSIONS = PACKAGE_ROOT / "__pycache__" / "ghostvis_code_versions.json"


def digest(value: Any, length: int = 16) -> str:
    """A short sha256 of a JSON-able value (keys sorted), the same on every host."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:length]


def changed_inputs(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted names of the inputs that differ between two identities (what made one stale)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            out += changed_inputs(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else str(key))
        return out
    return [] if old == new else [prefix or "(value)"]


@functools.cache
def code_version(*entry_modules: str) -> str:
    """Hash of the normalized source of `entry_modules` and every ghostvis_core module they import.

    Parsing the package is paid by every Dagster process and every `--stage` launch, so the
    result is kept in CODE_VERSIONS (beside Python's own bytecode cache) with the size and modification time of
    each file it read, and reused while none of them changed: the same test Python uses for a .pyc. A new
    import reaches a new file only by changing a file already listed."""
    name = ",".join(sorted(entry_modules))
    cached = _cached_versions().get(name)
    if cached and all(_stat(f) == seen for f, seen in cached["files"].items()):
        return cached["version"]
    files = [f.relative_to(PACKAGE_ROOT).as_posix() for f in sorted(_closure(tuple(entry_modules)))]
    version = digest([[f, _normalized(PACKAGE_ROOT / f)] for f in files], 12)
    _save_version(name, {"files": {f: _stat(f) for f in files}, "version": version})
    return version


def _cached_versions() -> dict[str, Any]:
    try:
        return json.loads(CODE_VERSIONS.read_text())
    except (OSError, ValueError):
        return {}


def _save_version(name: str, entry: dict[str, Any]) -> None:
    """Add one code version to CODE_VERSIONS; a read-only install (or a concurrent writer) only costs a recount."""
    try:
        atomic_write(CODE_VERSIONS, json.dumps({**_cached_versions(), name: entry}, sort_keys=True))
    except OSError:
        pass


def _stat(relative: str) -> list[int] | None:
    """[size, mtime_ns] of a package file, None if it is gone."""
    try:
        st = (PACKAGE_ROOT / relative).stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    base = PACKAGE_ROOT.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> set[str]:
    """ghostvis_core modules a file imports anywhere (also inside functions), submodules included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] == PACKAGE}


@functools.cache
def _closure(entry_modules: tuple[str, ...]) -> frozenset[Path]:
    seen: set[Path] = set()
    todo = list(entry_modules)
    while todo:
        path = _module_file(todo.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        todo += sorted(_imports(path))
    if not seen:
        raise GhostvisError(
            f"code_version: none of {', '.join(entry_modules)} is a {PACKAGE} module; name the "
            "modules that make the artifact"
        )
    return frozenset(seen)


@functools.cache
def _normalized(path: Path) -> str:
    """The module's syntax tree without docstrings: what it does, not how it is written down."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, annotate_fields=False, include_attributes=False)
