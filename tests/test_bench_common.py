"""benchmarks/_common.py's work folder, which every benchmark that writes homes and logs shares: removed
once the benchmark measured, kept (and named) when it failed, when --keep, or when the user named it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import _common as C  # noqa: E402


def test_a_benchmark_s_work_folder_goes_when_it_measured_and_stays_when_it_failed_or_was_kept(tmp_path, capsys):
    with C.work_folder("unit") as measured:
        (measured / "log").write_text("ok")
    assert not measured.exists()

    with pytest.raises(C.BenchError), C.work_folder("unit", what=" (log)") as failed:
        (failed / "log").write_text("why")
        raise C.BenchError("the demo failed")
    assert (failed / "log").read_text() == "why"
    assert f"kept {failed} (log)" in capsys.readouterr().out

    with C.work_folder("unit", keep=True) as kept:
        pass
    named = tmp_path / "mine"
    with C.work_folder("unit", path=named) as wd:
        assert wd == named
    assert kept.is_dir() and named.is_dir()
    for folder in (failed, kept):
        shutil.rmtree(folder)


def test_every_benchmark_uses_only_what_common_has():
    """A benchmark runs only by hand or in `make bench`, so a name that left _common (C.workdir did, for
    work_folder) would break it silently: every `C.<name>` in benchmarks/ must be defined there."""
    import ast

    used = {
        (path.name, node.attr)
        for path in sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "C"
    }
    assert len({name for name, _ in used}) >= 10  # the benchmarks that import _common as C
    assert sorted((name, attr) for name, attr in used if not hasattr(C, attr)) == []


@pytest.mark.parametrize(
    "bench, args, result",
    [
        ("short_items.py", ["--docs", "2000", "--words", "50"], "documents_found=2 planted=2"),
        ("trace_speed.py", ["--shards", "100", "--runs", "2"], "doc_runs=2 doc_hits=16"),
    ],
)
def test_the_quick_benchmarks_measure_at_a_small_size(bench, args, result):
    """The two benchmarks that build their data in seconds run whole at a small size, through their own
    command line: a reader they call that changed shape (the ledger's typed records) breaks them here."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / bench), *args], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert result in proc.stdout.splitlines()[-1]
