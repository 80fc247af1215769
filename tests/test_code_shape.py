"""The code's shape, checked statically with `ast`, so a drift fails here and not in review:

- functions stay short (at most 60 lines) and take at most 8 parameters (self/cls not counted);
- ghostvis_core imports only its own layer or lower ones (LAYERS), and never Dagster or
  ghostvis_pipeline (the library must run under plain torchrun), except dagster_pipes in track/pipes.py;
- ghostvis_pipeline uses no private `dagster._` module (they change without notice between releases);
- neither package reads the environment at import time (a module's behaviour must not depend on when
  it was first imported);
- outside ghostvis_core/store/ nobody reaches into a store (`.root`, `.path(`, `.s3`, `.bucket`, `.cache`,
  `.object_key(` on something named ...store) or asks which implementation it is (`isinstance(x, S3Store)`):
  everything goes through the `Store` protocol, in tests/ and benchmarks/ too (they use stores as a user's
  code does); and the store's modules import each other without a circle.

Every offender is listed in the failure message, as `file:line name: what`.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ghostvis_core", "ghostvis_pipeline")
SCRIPTS = ("tests", "benchmarks")  # held to the store rule only
MAX_LINES = 60
MAX_PARAMS = 8

# A module may import modules of its own layer or lower ones. "x.*" is the package x and everything in it.
# The layers are the packages of docs/architecture.md, bottom up: foundation, store, plan, data, demo, the run's
# records (runs/), run (model/track and the launcher renderings, then train, then hf and the trained-model loader,
# then the job's entry points), and on top the launch that plans a run (above the job: the job never plans) and
# verify.
LAYERS = {
    "ghostvis_core": 0,  # the package root: it is imported before any of its modules
    "ghostvis_core.errors": 0,
    "ghostvis_core.digest": 0,
    "ghostvis_core.counts": 0,
    "ghostvis_core.exit": 0,
    "ghostvis_core.store.*": 1,
    "ghostvis_core.identity": 1,
    "ghostvis_core.home": 1,
    "ghostvis_core.plan.*": 2,
    "ghostvis_core.data.*": 3,
    "ghostvis_core.demo.*": 4,
    "ghostvis_core.runs.*": 5,
    "ghostvis_core.run": 6,
    "ghostvis_core.run.model.*": 6,
    "ghostvis_core.run.ship_output": 6,
    "ghostvis_core.launch": 6,
    "ghostvis_core.launch.cluster.*": 6,
    "ghostvis_core.run.track.*": 6,
    "ghostvis_core.run.train.*": 7,
    "ghostvis_core.run.hf.*": 8,
    "ghostvis_core.run.trained_model": 8,
    "ghostvis_core.run.preflight": 9,
    "ghostvis_core.run.__main__": 9,
    "ghostvis_core.run.elastic_agent": 9,
    "ghostvis_core.run.tokenizer_training": 9,
    "ghostvis_core.launch.start": 10,
    "ghostvis_core.verify.*": 10,
}
# (importing module, imported top-level package) pairs allowed despite the no-Dagster rule
DAGSTER_ALLOWED = {("ghostvis_core.run.track.pipes", "dagster_pipes")}
ENV_READERS = {"environ", "environb", "getenv", "getenvb"}


def layer_of(module: str) -> int | None:
    if module in LAYERS:
        return LAYERS[module]
    for key, layer in LAYERS.items():
        if key.endswith(".*") and (module == key[:-2] or module.startswith(key[:-1])):
            return layer
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# ---------------------------------------------------------------- (a) function size


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    n = len(positional) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return n - 1 if positional and positional[0].arg in ("self", "cls") else n


def _functions(node: ast.AST, prefix: str = ""):
    """(qualified name, def node) for every def and async def, nested ones and methods included."""
    for child in ast.iter_child_nodes(node):
        name = prefix
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield name, child
            name += "."
        yield from _functions(child, name)


def function_problems(tree: ast.Module, where: str) -> list[str]:
    out = []
    for name, fn in _functions(tree):
        lines, params = fn.end_lineno - fn.lineno + 1, _params(fn)
        if lines > MAX_LINES:
            out.append(f"{where}:{fn.lineno} {name}: {lines} lines (max {MAX_LINES})")
        if params > MAX_PARAMS:
            out.append(f"{where}:{fn.lineno} {name}: {params} parameters (max {MAX_PARAMS})")
    return out


# ---------------------------------------------------------------- (b, c, d) imports


def _imports(tree: ast.Module, module: str, is_package: bool):
    """(line, imported module) for every import, those inside functions included. For `from x import y`
    this is x.y when that is one of the project's modules (`from ghostvis_core import presets`), else x."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x` in package p is p.x, `from ..y import x` is p's parent.y.x
                base = ".".join(filter(None, [package.rsplit(".", node.level - 1)[0], base]))
            for a in node.names:
                sub = f"{base}.{a.name}"
                yield node.lineno, sub if _is_project_module(sub) else base


def _is_project_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def layer_problems(tree: ast.Module, module: str, is_package: bool, where: str) -> list[str]:
    own = layer_of(module)
    if own is None:
        return [f"{where}:1 {module}: not in the layer map (add it to the layer map)"]
    out = []
    for line, target in _imports(tree, module, is_package):
        theirs = layer_of(target)
        if theirs is not None and theirs > own:
            out.append(f"{where}:{line} {module}: imports {target} (layer {theirs}) from layer {own}")
    return out


def dependency_problems(tree: ast.Module, module: str, is_package: bool, where: str) -> list[str]:
    out = []
    for line, target in _imports(tree, module, is_package):
        top = target.split(".")[0]
        if (top.startswith("dagster") or top == "ghostvis_pipeline") and (module, top) not in DAGSTER_ALLOWED:
            out.append(f"{where}:{line} {module}: imports {target} (ghostvis_core must not depend on it)")
    return out


def private_dagster_problems(tree: ast.Module, module: str, where: str) -> list[str]:
    """`import dagster._x...`, `from dagster._x... import y` and `from dagster import _x`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out += [
            f"{where}:{node.lineno} {module}: imports private {name}"
            for name in names
            if name.split(".")[0] == "dagster" and any(p.startswith("_") for p in name.split(".")[1:])
        ]
    return out


# ---------------------------------------------------------------- (e) environment read at import time


def _import_time_nodes(node: ast.AST):
    """Every node evaluated when the module is imported: all but function and lambda bodies (their
    decorators and default values are evaluated; class bodies are) and an `if __name__ == "__main__"` block."""
    for child in ast.iter_child_nodes(node):
        yield from _evaluated(child)


def _evaluated(node: ast.AST):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        evaluated = [*getattr(node, "decorator_list", []), *node.args.defaults, *node.args.kw_defaults]
        for expr in filter(None, evaluated):
            yield from _evaluated(expr)
    elif not _is_main_guard(node):
        yield node
        yield from _import_time_nodes(node)


def _is_main_guard(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'


def environment_problems(tree: ast.Module, module: str, where: str) -> list[str]:
    os_names, readers = {"os"}, set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and not node.level:
            readers |= {a.asname or a.name for a in node.names if a.name in ENV_READERS}
    out = []
    for node in _import_time_nodes(tree):
        os_attr = (
            isinstance(node, ast.Attribute)
            and node.attr in ENV_READERS
            and isinstance(node.value, ast.Name)
            and node.value.id in os_names
        )
        if os_attr or (isinstance(node, ast.Name) and node.id in readers):
            out.append(f"{where}:{node.lineno} {module}: reads {ast.unparse(node)} at import time")
    return out


# ---------------------------------------------------------------- (f) the store is used through its protocol

STORE_INTERNALS = {"root", "path", "s3", "bucket", "cache", "object_key"}
STORE_CLASSES = {"S3Store", "FolderStore"}


def _names_a_store(node: ast.AST) -> bool:
    """`store`, `home.store`, `self.store`, `ref_store`: an expression whose last name says it holds a store."""
    last = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return last == "store" or last.endswith("_store")


def store_use_problems(tree: ast.Module, module: str, where: str) -> list[str]:
    if module.startswith("ghostvis_core.store"):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in STORE_INTERNALS and _names_a_store(node.value):
            out.append((node.lineno, f"uses {ast.unparse(node)} (go through the Store protocol)"))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "isinstance"
            and len(node.args) == 2
            and STORE_CLASSES & {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
        ):
            out.append(
                (
                    node.lineno,
                    f"asks {ast.unparse(node)} (a store's kind is no caller's business: use the Store protocol)",
                )
            )
    return [f"{where}:{line} {module}: {what}" for line, what in sorted(out)]


def import_circles(package: str) -> list[str]:
    """Modules of `package` that import (directly or not) a module of it that imports them back."""
    folder = ROOT.joinpath(*package.split("."))
    modules = [module_name(p) for p in sorted(folder.rglob("*.py"))]
    out = []
    for mod in modules:
        path = ROOT.joinpath(*mod.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for target in sorted(_runtime_imports(path, mod)):
            if target.startswith(package + ".") and target != mod and mod in reachable(target):
                out.append(f"{mod} imports {target}, which imports {mod} back")
    return out


# ---------------------------------------------------------------- the checker


def check_source(source: str, module: str, where: str, is_package: bool = False) -> list[str]:
    """Every problem in one module's source; `module` (its dotted name) selects the package's rules."""
    tree = ast.parse(source, filename=where)
    out = function_problems(tree, where) + environment_problems(tree, module, where)
    out += store_use_problems(tree, module, where)
    if module.split(".")[0] == "ghostvis_core":
        out += layer_problems(tree, module, is_package, where)
        out += dependency_problems(tree, module, is_package, where)
    else:
        out += private_dagster_problems(tree, module, where)
    return out


def sources_in(folders: tuple[str, ...]) -> list[tuple[Path, str, str]]:
    """Every Python file below `folders`, in order: (its path, its text, its path in the repository)."""
    paths = [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]
    return [(path, path.read_text(encoding="utf-8"), str(path.relative_to(ROOT))) for path in paths]


def offenders() -> list[str]:
    out = []
    for path, text, where in sources_in(PACKAGES):
        out += check_source(text, module_name(path), where, path.name == "__init__.py")
    return out


def script_store_offenders() -> list[str]:
    """Tests and benchmarks that reach into a store: one that does tests or times what no user's code runs."""
    out = []
    for path, text, where in sources_in(SCRIPTS):
        out += store_use_problems(ast.parse(text, filename=where), module_name(path), where)
    return out


# The audit proves what the trainer did, so it must not run the trainer's code: nothing it imports, however
# indirectly, may be the loader, the objectives, the loop or the model (the records it reads are in runs/, a
# layer below the training package). A bug planted there is then caught, not repeated.
AUDIT_MAY_NOT_REACH = (
    "ghostvis_core.run.train.",
    "ghostvis_core.data.loader",
    "ghostvis_core.data.stream",
    "ghostvis_core.data.token_shard",
    "ghostvis_core.run.model",
)


@functools.cache
def _runtime_imports(path: Path, module: str) -> frozenset[str]:
    """Project modules a module imports when it runs (imports under `if TYPE_CHECKING:` do not run); parsed
    once per module for the session (the circle tests walk every module's imports from every module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    return frozenset(t for _, t in _imports(tree, module, path.name == "__init__.py") if _is_project_module(t))


def reachable(start: str) -> dict[str, str]:
    """Every project module `start` imports, directly or not: module -> the module that imports it."""
    seen, todo = {start: ""}, [start]
    while todo:
        mod = todo.pop()
        path = ROOT.joinpath(*mod.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for target in sorted(_runtime_imports(path, mod)):
            if target not in seen:
                seen[target] = mod
                todo.append(target)
    return seen


def test_the_audit_reaches_no_training_or_loader_code():
    problems = []
    for path in sorted((ROOT / "ghostvis_core" / "verify" / "audit").glob("*.py")):
        for target, via in reachable(module_name(path)).items():
            if target.startswith(AUDIT_MAY_NOT_REACH):
                problems.append(f"{module_name(path)} reaches {target} (imported by {via})")
    assert not problems, "\n".join(problems)


# The launch side and the audit read a run's records from runs/, never from the training package.
RECORD_READERS = ("ghostvis_core/launch", "ghostvis_core/verify/audit")


def training_imports(folders: tuple[str, ...]) -> list[str]:
    """Every import of a run/train/ module by a module below `folders`, as `file:line module: imports target`."""
    out = []
    for path, text, where in sources_in(folders):
        mod = module_name(path)
        for line, target in _imports(ast.parse(text), mod, path.name == "__init__.py"):
            if target.startswith("ghostvis_core.run.train"):
                out.append(f"{where}:{line} {mod}: imports {target}")
    return out


def test_the_launch_side_and_the_audit_import_no_training_module():
    assert sources_in(RECORD_READERS), "no module found below " + ", ".join(RECORD_READERS)
    assert training_imports(RECORD_READERS) == []


def test_the_training_import_finder_finds_a_planted_import(tmp_path, monkeypatch):
    (tmp_path / "ghostvis_core" / "launch").mkdir(parents=True)
    (tmp_path / "ghostvis_core" / "launch" / "x.py").write_text(
        "from ghostvis_core.runs.launch_spec import LaunchSpec\nfrom ghostvis_core.run.train.loop import train\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert training_imports(("ghostvis_core/launch",)) == [
        "ghostvis_core/launch/x.py:2 ghostvis_core.launch.x: imports ghostvis_core.run.train.loop"
    ]


def test_the_store_modules_import_each_other_without_a_circle():
    assert reachable("ghostvis_core.store").keys() >= {"ghostvis_core.store.folder", "ghostvis_core.store.s3"}
    assert import_circles("ghostvis_core.store") == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_imports_itself_back(package):
    assert import_circles(package) == []


def package_circles(package: str) -> list[str]:
    """Packages of `package` (each folder with an __init__.py) whose imports, lazy ones included, lead back to
    them through another package: `train` and `eval` importing each other is a circle even when no two
    modules are."""
    edges: dict[str, set[str]] = {}
    for path in sorted(ROOT.joinpath(*package.split(".")).rglob("*.py")):
        mod = module_name(path)
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for _, target in _imports(ast.parse(path.read_text(encoding="utf-8")), mod, path.name == "__init__.py"):
            there = _package_of(target)
            if there and there.startswith(package) and there != here and not here.startswith(there + "."):
                edges.setdefault(here, set()).add(there)
    out = []
    for start in sorted(edges):
        seen, todo = set(), sorted(edges[start])
        while todo:
            node = todo.pop()
            if node == start:
                out.append(f"{start} imports a package that imports {start} back")
                break
            if node not in seen:
                seen.add(node)
                todo += sorted(edges.get(node, ()))
    return out


def _package_of(module: str) -> str | None:
    path = ROOT.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return module
    return module.rpartition(".")[0] if path.with_suffix(".py").is_file() else None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_imports_itself_back(package):
    assert package_circles(package) == []


def test_code_shape():
    problems = offenders()
    assert not problems, f"{len(problems)} code-shape problem(s):\n" + "\n".join(problems)


def test_tests_and_benchmarks_use_stores_through_the_protocol():
    problems = script_store_offenders()
    assert not problems, f"{len(problems)} store use(s) outside the Store protocol:\n" + "\n".join(problems)


SYNTHETIC = (
    """
import os
from ghostvis_core.plan.config import flatten
from ghostvis_core.plan import presets
from ghostvis_core.run.train import loop


def long_one():
"""
    + "    x = 1\n" * 60
    + """

def just_short_enough():
"""
    + "    x = 1\n" * 59
    + """

class C:
    def many(self, a, b, c, d, e, f, g, h, i):
        return os.environ.get("X")

    def enough(self, a, b, c, d, e, f, *args, **kwargs):
        return a
"""
)


def test_the_checker_reports_exactly_the_planted_problems():
    problems = check_source(SYNTHETIC, "ghostvis_core.data.synthetic", "synthetic.py")
    assert problems == [
        "synthetic.py:8 long_one: 61 lines (max 60)",
        "synthetic.py:134 C.many: 9 parameters (max 8)",
        "synthetic.py:5 ghostvis_core.data.synthetic: imports ghostvis_core.run.train.loop (layer 7) from layer 3",
    ]


def test_the_job_may_not_import_the_planner():
    """The job only runs specs: its entry point is a layer below the launch side that plans a run."""
    source = "from ghostvis_core.launch.start import prepare_run\nfrom ghostvis_core.runs import launch_spec\n"
    assert check_source(source, "ghostvis_core.run.__main__", "main.py") == [
        "main.py:1 ghostvis_core.run.__main__: imports ghostvis_core.launch.start (layer 10) from layer 9"
    ]


def test_the_checker_reports_dagster_and_environment_problems():
    core = """
import os
import dagster_pipes
TIMEOUT = os.environ.get("T")


def f(level=os.getenv("L")):
    from ghostvis_pipeline import cli
    return os.environ["X"]
"""
    pipeline = "from dagster._core.storage.tags import X\nfrom dagster import asset, _check\n"
    assert check_source(core, "ghostvis_core.run.track.mlflow_run", "core.py") == [
        "core.py:4 ghostvis_core.run.track.mlflow_run: reads os.environ at import time",
        "core.py:7 ghostvis_core.run.track.mlflow_run: reads os.getenv at import time",
        "core.py:3 ghostvis_core.run.track.mlflow_run: imports dagster_pipes (ghostvis_core must not depend on it)",
        "core.py:8 ghostvis_core.run.track.mlflow_run: imports ghostvis_pipeline.cli "
        "(ghostvis_core must not depend on it)",
    ]
    assert check_source(core, "ghostvis_core.run.track.pipes", "pipes.py") == [  # dagster_pipes is allowed here
        "pipes.py:4 ghostvis_core.run.track.pipes: reads os.environ at import time",
        "pipes.py:7 ghostvis_core.run.track.pipes: reads os.getenv at import time",
        "pipes.py:8 ghostvis_core.run.track.pipes: imports ghostvis_pipeline.cli (ghostvis_core must not depend on it)",
    ]
    assert check_source(pipeline, "ghostvis_pipeline.demo", "demo.py") == [
        "demo.py:1 ghostvis_pipeline.demo: imports private dagster._core.storage.tags.X",
        "demo.py:2 ghostvis_pipeline.demo: imports private dagster._check",
    ]


def test_the_checker_reports_a_store_reached_into():
    source = """
def f(home, run, ref_store, other):
    a = home.store.root
    b = run.store.path("ledger")
    c = isinstance(ref_store, (S3Store, int))
    return home.store.fetch("ledger"), other.root, other.path
"""
    assert check_source(source, "ghostvis_pipeline.launchers.slurm", "slurm.py") == [
        "slurm.py:3 ghostvis_pipeline.launchers.slurm: uses home.store.root (go through the Store protocol)",
        "slurm.py:4 ghostvis_pipeline.launchers.slurm: uses run.store.path (go through the Store protocol)",
        "slurm.py:5 ghostvis_pipeline.launchers.slurm: asks isinstance(ref_store, (S3Store, int)) (a store's kind "
        "is no caller's business: use the Store protocol)",
    ]
    assert check_source(source, "ghostvis_core.store.s3", "s3.py") == []  # the store's own modules may


def test_the_circle_finder_finds_a_planted_circle(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text("from pkg.y import g\n")
    (pkg / "y.py").write_text("from pkg import z\n")
    (pkg / "z.py").write_text("import pkg.x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_circles("pkg") == [
        "pkg.x imports pkg.y, which imports pkg.x back",
        "pkg.y imports pkg.z, which imports pkg.y back",
        "pkg.z imports pkg.x, which imports pkg.z back",
    ]


def test_the_package_circle_finder_finds_a_planted_circle(tmp_path, monkeypatch):
    for folder in ("pkg", "pkg/a", "pkg/b", "pkg/c"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "pkg/a/x.py").write_text("def f():\n    from pkg.b import y\n")  # lazy imports count
    (tmp_path / "pkg/b/y.py").write_text("import pkg.c.z\n")
    (tmp_path / "pkg/c/z.py").write_text("from pkg.a.x import f\n")
    (tmp_path / "pkg/c/w.py").write_text("from pkg.c import z\n")  # within a package: no circle
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert package_circles("pkg") == [
        "pkg.a imports a package that imports pkg.a back",
        "pkg.b imports a package that imports pkg.b back",
        "pkg.c imports a package that imports pkg.c back",
    ]
