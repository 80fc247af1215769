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
