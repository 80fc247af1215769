"""Which code references in the docs name nothing in the tree: a file that moved, a function that was renamed.

A reference is an inline code span (`...`, outside fenced blocks) of one of these shapes:

- a path: `ghostvis_core/run/train/trainer.py`, `train/feeds.py`, `verify/replay/`, `trainer.py`: it names a file
  (or, ending in "/", a folder) of the tree; a shortened path names one whose path ends with it;
- a path and a name: `trainer.py:train_step`, `test_resume.py::test_x`, and in prose "`train_step` in
  `trainer.py`" or "`trainer.py`, `train_step`": the name (or `Class.name`) is defined in that file;
- a dotted name: `presets.resolve`, `CheckpointManager.newest`, `ghostvis_core.run.train.objectives.OBJECTIVES`:
  its head is a module of the packages (by file stem, or dotted from the root) or a class defined in them, and
  the rest is defined there; a configuration key (`checkpoint.every_steps`, a field of plan/config.py's
  StageConfig section) resolves too, and so does a name from an installed package (`torch.cuda.synchronize`);
  a head that is none of these is a module that is gone.

Anything else (a metric such as `train/loss`, a store path with `<placeholders>`, a run's file such as
`spec.json`, a name from torch or the standard library) is not a reference to the tree and is not checked.
Names are read with `ast`, so nothing is imported.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ghostvis_core", "ghostvis_pipeline")
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".ruff_cache", ".pytest_cache", ".ghostvis", "mlruns"}
OLD_NAMES_DOC = "names.md"  # docs/names.md: the old -> new table for readers who know the old module names
OLD_NAME_CELL = re.compile(r"^\| `[^`]*` \|", re.M)
CHECKED_SUFFIXES = (".py", ".md")  # a bare file name with another suffix is a run's or a user's file
# The suffixes of a run's, a store's or a user's files (`model.safetensors`, `captions.jsonl`): not dotted names.
FILE_SUFFIXES = {"json", "jsonl", "yaml", "yml", "toml", "sh", "txt", "safetensors", "db", "xz", "gz", "png", "csv"}
# Heads of dotted names that are keys of data, not code: MLflow tags and safetensors metadata (`ghostvis.stage`),
# the keys of `ghostvis plan --json` (`memory.fit`), a stage's inputs.yaml (`inputs.reward_rules`), Dagster's run
# config (`ops.evaluation.config...`), its asset context (`context.log_event`) and Helm chart values.
DATA_KEY_HEADS = {"ghostvis", "memory", "inputs", "ops", "context", "runLauncher"}
SPAN = re.compile(r"`([^`\n]+)`")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"{IDENT}(\.{IDENT})+")
PATH_CHARS = re.compile(r"[A-Za-z0-9_./-]+")
PY_PATH = r"[A-Za-z0-9_./-]+\.py"
# Prose that pairs a name with its file: "`name` in `path.py`" and "`path.py`, `name`".
NAME_IN_FILE = re.compile(rf"`({IDENT})` in `({PY_PATH})`")
FILE_THEN_NAME = re.compile(rf"`({PY_PATH})`, `({IDENT})`")


@dataclass(frozen=True)
class Broken:
    """One reference that names nothing in the tree, with where it was written and why it does not resolve."""

    doc: str
    line: int
    ref: str
    why: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line} `{self.ref}`: {self.why}"


@functools.cache
def tree_files(root: Path = ROOT) -> tuple[str, ...]:
    """Every file of the tree as a path relative to the root, '/'-separated (no .git, virtualenv or caches)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        found.extend(Path(folder, f).relative_to(root).as_posix() for f in files)
    return tuple(sorted(found))


@functools.cache
def tree_dirs(root: Path = ROOT) -> frozenset[str]:
    """Every folder of the tree that holds a file, as a path relative to the root."""
    return frozenset("/".join(f.split("/")[:n]) for f in tree_files(root) for n in range(1, f.count("/") + 1))


def find_file(ref: str, root: Path = ROOT) -> list[str]:
    """The tree's files that `ref` names: exactly, or as the end of their path."""
    return [f for f in tree_files(root) if f == ref or f.endswith("/" + ref)]


def find_dir(ref: str, root: Path = ROOT) -> bool:
    ref = ref.rstrip("/")
    return any(d == ref or d.endswith("/" + ref) for d in tree_dirs(root))


@functools.cache
def defined_names(file: Path) -> frozenset[str]:
    """The names a Python file defines: top-level functions, classes and assignments, and `Class.member` for each
    class's methods, fields and `self.x =` attributes (nested classes too)."""
    tree = ast.parse(file.read_text())
    names: set[str] = set()

    def collect(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.If, ast.Try)):
                collect(node.body + node.orelse + getattr(node, "finalbody", []), prefix)
            for name in _bound(node):
                names.add(prefix + name)
            if isinstance(node, ast.ClassDef):
                collect(node.body, f"{prefix}{node.name}.")
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                        if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                            names.add(f"{prefix}{node.name}.{sub.attr}")

    collect(tree.body, "")
    return frozenset(names)


def _bound(node: ast.stmt) -> list[str]:
    """The names one statement binds: a function's or class's name, an assignment's targets."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign):
        targets = [node.target]
    else:
        return []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


@functools.cache
def class_bases(file: Path) -> dict[str, tuple[str, ...]]:
    """Class name -> the names of its bases, for the classes a Python file defines at top level."""
    tree = ast.parse(file.read_text())
    return {
        n.name: tuple(ast.unparse(b).rsplit(".", 1)[-1] for b in n.bases)
        for n in tree.body
        if isinstance(n, ast.ClassDef)
    }


def class_defines(cls: str, member: str, root: Path = ROOT, seen: frozenset[str] = frozenset()) -> bool:
    """Whether a package class (or one of its bases in the packages) defines `member`."""
    for f in package_classes(root).get(cls, ()):
        if f"{cls}.{member}" in defined_names(root / f):
            return True
        bases = class_bases(root / f).get(cls, ())
        if any(class_defines(b, member, root, seen | {cls}) for b in bases if b not in seen):
            return True
    return False


@functools.cache
def package_modules(root: Path = ROOT) -> dict[str, tuple[str, ...]]:
    """Module stem (and dotted module path from the root) -> the package files it may name."""
    modules: dict[str, list[str]] = {}
    for f in tree_files(root):
        if f.endswith(".py") and f.split("/")[0] in PACKAGES + ("tests", "benchmarks"):
            dotted = f[: -len(".py")].removesuffix("/__init__").replace("/", ".")
            for key in {dotted, dotted.rsplit(".", 1)[-1]}:
                modules.setdefault(key, []).append(f)
    return {k: tuple(v) for k, v in modules.items()}


@functools.cache
def package_classes(root: Path = ROOT) -> dict[str, tuple[str, ...]]:
    """Class name -> the package files that define it."""
    classes: dict[str, list[str]] = {}
    for f in tree_files(root):
        if f.endswith(".py") and f.split("/")[0] in PACKAGES:
            for name in defined_names(root / f):
                if "." not in name and name[:1].isupper():
                    classes.setdefault(name, []).append(f)
    return {k: tuple(v) for k, v in classes.items()}


@functools.cache
def config_keys(root: Path = ROOT) -> frozenset[str]:
    """`section.field` for every field of a section of StageConfig (plan/config.py), read with ast."""
    tree = ast.parse((root / "ghostvis_core/plan/config.py").read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    keys = set()
    for field in classes["StageConfig"].body:
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name):
            section = field.target.id
            keys.add(section)
            for name in re.findall(IDENT, ast.unparse(field.annotation)):
                for sub in classes[name].body if name in classes else []:
                    if isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                        keys.add(f"{section}.{sub.target.id}")
    return frozenset(keys)


def check_path(ref: str, root: Path = ROOT) -> str | None:
    """Why a path reference names nothing (None when it names a file or folder of the tree, or of an installed
    package its first part names, such as torch/...)."""
    if ref.endswith("/"):
        found = find_dir(ref, root)
    else:
        found = bool(find_file(ref, root)) or find_dir(ref, root)
    if found:
        return None
    head = ref.split("/")[0]
    ours = (root / head).exists()
    spec = importlib.util.find_spec(head) if head.isidentifier() and "/" in ref and not ours else None
    if spec is not None and spec.submodule_search_locations:
        base = Path(next(iter(spec.submodule_search_locations))).parent
        return None if (base / ref).exists() else f"no {ref} in the installed {head}"
    return f"no file or folder {ref} in the tree"


def check_name_in_file(path: str, name: str, root: Path = ROOT) -> str | None:
    files = [f for f in find_file(path, root) if f.endswith(".py")]
    if not files:
        return f"no file {path} in the tree"
    if any(_module_defines(f, name, root) for f in files):
        return None
    return f"{name} is not defined in {', '.join(files)}"


def check_dotted(ref: str, root: Path = ROOT) -> str | None:
    """Why a dotted name names nothing (None when it resolves or is not a reference to the tree)."""
    if ref in config_keys(root):
        return None
    parts = ref.split(".")
    modules, classes = package_modules(root), package_classes(root)
    for cut in range(len(parts) - 1, 0, -1):
        head, rest = ".".join(parts[:cut]), ".".join(parts[cut:])
        if head in modules:
            files = modules[head]
            if any(_module_defines(f, rest, root) for f in files):
                return None
            return f"{rest} is not defined in {', '.join(files)}"
    if parts[0] in classes:
        if class_defines(parts[0], ".".join(parts[1:]), root):
            return None
        return f"{parts[0]} ({', '.join(classes[parts[0]])}) and its bases define no {'.'.join(parts[1:])}"
    if parts[0] in {k.split(".")[0] for k in config_keys(root)}:
        return f"{parts[0]} is a configuration section (plan/config.py) without {'.'.join(parts[1:])}"
    if parts[0] in DATA_KEY_HEADS or importlib.util.find_spec(parts[0]) is not None:
        return None
    return f"{parts[0]} is no module or class of the packages, no configuration section and no installed package"


def _module_defines(file: str, rest: str, root: Path) -> bool:
    """Whether a module defines `rest` (`name` or `Class.member`, through the class's bases too)."""
    if rest in defined_names(root / file) or rest.split(".")[0] in _submodules(file, root):
        return True
    cls, _, member = rest.partition(".")
    return bool(member) and cls in defined_names(root / file) and class_defines(cls, member, root)


def _submodules(file: str, root: Path) -> set[str]:
    """A package's modules and subpackages, by name (for `data.loader` naming ghostvis_core/data/loader.py)."""
    if not file.endswith("__init__.py"):
        return set()
    return {p.stem for p in (root / file).parent.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}


def as_reference(span: str, root: Path = ROOT) -> tuple[str, str] | None:
    """What a code span references in the tree, as (kind, text): ("name", "path.py:name"), ("path", "a/b.py") or
    ("dotted", "module.name"); None when the span is no reference to the tree."""
    ref = span.removesuffix("()")
    if "::" in ref:
        path, _, name = ref.partition("::")
        return "name", f"{path}:{name.replace('::', '.')}"
    if not PATH_CHARS.fullmatch(ref.replace(":", "")) or ref.startswith((".", "/")) or "//" in ref or "..." in ref:
        return None
    if ":" in ref:
        return ("name", ref) if ref.partition(":")[0].endswith(".py") else None
    parts = ref.rstrip("/").split("/")
    if len(parts) == 1 and ref.endswith("/") or any(p.isupper() for p in parts) or _ignored(ref, root):
        return None  # a run's folder (`dcp/`), a placeholder (`DIR/vision/`) or what a script makes (gitignored)
    last = parts[-1]
    if "/" in ref and "." in last and last.split(".", 1)[1] not in FILE_SUFFIXES | {"py", "md"}:
        stem, _, name = last.partition(".")
        return "name", "/".join([*parts[:-1], stem + ".py"]) + ":" + name
    if (
        "/" in ref
        and (ref.endswith("/") or "." in last or (root / parts[0]).exists())
        or ref.endswith(CHECKED_SUFFIXES)
    ):
        return "path", ref
    if DOTTED.fullmatch(ref) and ref.rsplit(".", 1)[-1] not in FILE_SUFFIXES:
        return "dotted", ref
    return None


def check_ref(span: str, root: Path = ROOT) -> str | None:
    """Why one code span's reference names nothing in the tree; None when it resolves or is no reference."""
    found = as_reference(span, root)
    if found is None:
        return None
    kind, ref = found
    if kind == "name":
        path, _, name = ref.partition(":")
        return check_name_in_file(path, name, root)
    return check_path(ref, root) if kind == "path" else check_dotted(ref, root)


def _ignored(ref: str, root: Path) -> bool:
    """Whether .gitignore names this path: a folder that a script makes, such as benchmarks/gpu_wheels/."""
    ignore = root / ".gitignore"
    entries = {line.strip().rstrip("/") for line in ignore.read_text().splitlines()} if ignore.exists() else set()
    return ref.rstrip("/") in entries


def doc_spans(text: str) -> list[tuple[int, str]]:
    """(line number, reference) for every inline code span outside fenced code blocks, and a `path.py:name`
    reference for each name that the prose pairs with its file."""
    spans, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            spans.extend((number, m.group(1).strip()) for m in SPAN.finditer(line))
            spans.extend((number, f"{m.group(2)}:{m.group(1)}") for m in NAME_IN_FILE.finditer(line))
            spans.extend((number, f"{m.group(1)}:{m.group(2)}") for m in FILE_THEN_NAME.finditer(line))
    return spans


def broken_refs(docs: list[Path], root: Path = ROOT) -> list[Broken]:
    """Every reference in these markdown files that names nothing in the tree."""
    broken = []
    for doc in docs:
        text = doc.read_text()
        if doc.name == OLD_NAMES_DOC:  # its first column lists the names that are gone, on purpose
            text = OLD_NAME_CELL.sub("| |", text)
        for line, ref in doc_spans(text):
            why = check_ref(ref, root)
            if why:
                broken.append(
                    Broken(doc.relative_to(root).as_posix() if doc.is_relative_to(root) else str(doc), line, ref, why)
                )
    return broken


def project_docs(root: Path = ROOT) -> list[Path]:
    """README.md and every markdown file under docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]
