"""Docstrings and comments say what and why: no issue numbers (a history, not a reason) and no timings measured
on some machine (they go stale; docs/architecture.md's table of fixed costs and benchmarks/ output hold them).
Quoted text is left out: an example message may show a time ("heartbeat 4 s ago")."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ghostvis_core", "ghostvis_pipeline")
ISSUE = re.compile(r"\bissues? ?#?\d+", re.I)
TIMING = re.compile(r"(?<![\w.])\d+(\.\d+)? ?(ms|s)\b(?!')")  # not k8s, H100s or "rank 1's"
QUOTED = re.compile(r"\"[^\"]*\"|(?<!\w)'[^']*'(?!\w)")  # an apostrophe ("rank 0's") opens no quote


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every docstring line of a Python source."""
    lines = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                lines.extend((node.body[0].lineno + i, line) for i, line in enumerate(doc.splitlines()))
    return sorted(lines)


def offenders(source: str) -> list[tuple[int, str]]:
    """(line, text) of the comment or docstring lines that cite an issue or a measured timing."""
    return [(n, text) for n, text in prose(source) if ISSUE.search(text) or TIMING.search(QUOTED.sub("", text))]


def test_package_docstrings_and_comments_cite_no_issue_and_no_measured_timing():
    files = [f for package in PACKAGES for f in sorted((ROOT / package).rglob("*.py"))]
    found = [f"{f.relative_to(ROOT)}:{n}: {text.strip()}" for f in files for n, text in offenders(f.read_text())]
    assert len(files) > len(PACKAGES)
    assert not found, "say what and why; move the figure to docs/ or benchmark output:\n" + "\n".join(found)


def test_an_issue_number_and_a_timing_are_found_and_a_quoted_example_is_not():
    source = (
        '"""Matched whole (issue 43)."""\n'
        "def f():\n"
        '    """The heartbeat\'s age: \'heartbeat 4 s ago\'."""\n'
        "    x = 1  # importing it costs ~1.5 s\n"
        "    y = 2  # every timeout/8 seconds, in 1 MiB blocks, on k8s and H100s, rank 1's error\n"
    )
    assert offenders(source) == [(1, "Matched whole (issue 43)."), (4, "# importing it costs ~1.5 s")]
