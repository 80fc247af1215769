"""Every planted bug of tests/planted.py still applies to the code it mutates: its anchors are each once in
their function and the mutated source compiles. A refactor that moves an anchor fails here in a second,
not in the audit tests' end-to-end fixtures (which would then error rather than show their check fails)."""

from __future__ import annotations

import inspect

import pytest

import ghostvis_core.launch.start  # noqa: F401  (imported before planting, as tests.planted's run_scenarios does)
import ghostvis_core.run.train.loop  # noqa: F401
from tests.planted import BUGS, plant


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_the_bug_applies_and_changes_its_functions(bug, monkeypatch):
    functions = {(module, qualname) for module, qualname, _, _ in BUGS[bug]}
    before = {key: _function(*key) for key in functions}
    plant(bug, setter=monkeypatch.setattr)
    for key, old in before.items():
        new = _function(*key)
        assert new is not old and _compiled(new.__code__) != _compiled(old.__code__), f"{bug}: {key} unchanged"


def _function(module: str, qualname: str):
    obj = __import__(module, fromlist=["_"])
    for name in qualname.split("."):
        obj = getattr(obj, name)
    return inspect.unwrap(obj)


def _compiled(code) -> tuple:
    """A code object's instructions and constants, those of its nested functions and comprehensions included."""
    consts = tuple(_compiled(c) if inspect.iscode(c) else repr(c) for c in code.co_consts)
    return code.co_code, code.co_names, consts
