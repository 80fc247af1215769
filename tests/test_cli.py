"""The `ghostvis` command: `ledger --run` (what one run consumed) and `init` (a home a plain
`dagster` command can use). Fast tests build a two-part ledger by hand; the e2e ones read a copy
of the smoke demo home, or run Dagster on a brand-new folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ghostvis_core.counts import TokenCounts
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import PartRow
from ghostvis_core.data.ledger.summaries import merge_ranges, run_consumption
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_pipeline.cli import main as cli_main
from tests.conftest import run_cli
from tests.ledger_rows import consumption, piece, write

RUN = "pretrain-abc-r1"


def _part(step_first: int, step_last: int, segment: int, prev: str, real: int) -> PartRow:
    return PartRow(
        f"{RUN}.s{segment:03d}.p{step_last:09d}", prev, RUN, "", "pretrain", segment, step_first, step_last, 0, 0,
        **TokenCounts(real, 0, real, 0).as_dict(), micro_batch_size=2, seq_len=8, world_size=2 if segment == 0 else 1,
        grad_accum_steps=1, tokens_per_step=32, planned_tokens=128,
    )  # fmt: skip


@pytest.fixture
def two_segment_home(tmp_path, monkeypatch) -> Path:
    """A ledger with one run: segment 0 (2 ranks) steps 1..2, resumed as segment 1 (1 rank) steps 3..4;
    32 tokens a step, half from each of two shards."""
    ledger = Ledger.in_store(Home(tmp_path).store)
    first = _part(1, 2, 0, "", 64)
    write(ledger, first, [piece("a/0", (0, 32), (0, 3), source="a"), piece("b/0", (0, 32), (0, 2), source="b")])
    second = _part(3, 4, 1, first.part_id, 64)
    write(ledger, second, [piece("a/0", (32, 64), (2, 5), source="a"), piece("b/0", (32, 64), (1, 4), source="b")])
    monkeypatch.setenv("GHOSTVIS_HOME", str(tmp_path))
    return tmp_path


def test_run_consumption_joins_touching_parts_and_keeps_segments(two_segment_home):
    c = run_consumption(Ledger.in_store(Home(two_segment_home).store), RUN)
    assert (c.stage, c.steps, c.parts, c.counts.real_tokens, c.consumed_tokens) == ("pretrain", 4, 2, 128, 128)
    assert [(s.segment, s.first_step, s.last_step, s.world_size, s.real_tokens) for s in c.segments] == [
        (0, 1, 2, 2, 64),
        (1, 3, 4, 1, 64),
    ]
    assert [(r.shard_id, r.tok_start, r.tok_end, r.row_start, r.row_end, r.parts) for r in c.ranges] == [
        ("a/0", 0, 64, 0, 5, 2),
        ("b/0", 0, 64, 0, 4, 2),
    ]
    assert [(r.shard_id, r.tokens) for r in c.shards] == [("a/0", 64), ("b/0", 64)]
    flat = c.as_dict()  # what --json prints: the four figures flat, the lists as objects
    assert list(flat)[7:13] == ["real_tokens", "pad_tokens", "loss_tokens", "cropped_tokens", "overlap_tokens",
                                "consumed_tokens"]  # fmt: skip
    assert flat["ranges"][0] == {"source": "a", "shard_id": "a/0", "split": "train", "epoch": 0, "tok_start": 0,
                                 "tok_end": 64, "row_start": 0, "row_end": 5, "tokens": 64, "parts": 2}  # fmt: skip


def test_merge_ranges_keeps_an_overlap_visible():
    part = _part(1, 2, 0, "", 64)
    rows = consumption(part, [piece("a/0", (0, 32), (0, 3)), piece("a/0", (16, 48), (1, 4))])  # 16 tokens read twice
    assert [(r.tok_start, r.tok_end, r.parts) for r in merge_ranges(rows)] == [(0, 32, 1), (16, 48, 1)]


def test_ledger_run_json_and_text(two_segment_home, capsys):
    assert cli_main(["ledger", "--run", RUN, "--json"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["run_key"] == RUN and sum(r["tokens"] for r in c["shards"]) == c["real_tokens"] == 128
    assert cli_main(["ledger", "--run", RUN]) == 0
    out = capsys.readouterr().out
    assert "real_tokens 128, pad_tokens 0, loss_tokens 128, cropped_tokens 0" in out
    assert "3..4" in out and "0..64" in out  # segment 1's steps; a range joined over both parts


def test_ledger_run_unknown_is_a_one_line_error(two_segment_home, capsys):
    assert cli_main(["ledger", "--run", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "ghostvis: error: unknown stage or run key 'nope'; stages: pretrain,"
    )
    assert RUN in err
    assert cli_main(["ledger", "--run", "pretrain-zzz-r9"]) == 2
    assert f"known run keys of pretrain: {RUN}" in capsys.readouterr().err
    # a stage with no completed run (no RUN_COMPLETE record) names the asset and its unfinished run
    assert cli_main(["ledger", "--run", "pretrain"]) == 2
    assert (
        "materialize the `pretrain` asset (or pass one of its unfinished run keys: pretrain-abc-r1)"
        in capsys.readouterr().err
    )
    with pytest.raises(GhostvisError, match="no run 'pretrain-zzz-r9'"):
        run_consumption(Ledger.in_store(Home(two_segment_home).store), "pretrain-zzz-r9")


def test_init_is_idempotent(tmp_path, monkeypatch, capsys):
    home = tmp_path / "fresh"
    monkeypatch.setenv("GHOSTVIS_HOME", str(home))
    monkeypatch.setenv("DAGSTER_HOME", "unset")  # recorded, so the value init sets is undone after the test
    monkeypatch.delenv("DAGSTER_HOME")  # unset: the Dagster folder defaults to $GHOSTVIS_HOME/dagster
    assert cli_main(["init"]) == 0
    out = capsys.readouterr().out
    assert (home / "dagster" / "dagster.yaml").is_file()
    assert f"export GHOSTVIS_HOME={home}" in out and f"export DAGSTER_HOME={home / 'dagster'}" in out
    assert "dagster asset materialize --select shard_manifest -m ghostvis_pipeline.definitions" in out
    (home / "dagster" / "dagster.yaml").write_text("# mine\n")
    assert cli_main(["init"]) == 0
    assert "kept the existing one" in capsys.readouterr().out
    assert (home / "dagster" / "dagster.yaml").read_text() == "# mine\n"  # never overwritten


# ---------------------------------------------------------------- end to end


@pytest.mark.e2e
def test_ledger_run_pretrain_json_adds_up_on_the_demo_home(home_copy):
    c = json.loads(run_cli(["ghostvis", "ledger", "--run", "pretrain", "--json"], home_copy).stdout)
    assert c["stage"] == "pretrain" and c["real_tokens"] > 0
    assert sum(r["tokens"] for r in c["shards"]) == c["real_tokens"]  # pretraining: real = shard tokens read
    assert sum(s["real_tokens"] for s in c["segments"]) == c["real_tokens"]
    assert sum(r["tokens"] for r in c["ranges"]) == c["consumed_tokens"] == c["real_tokens"]
    proc = run_cli(["ghostvis", "ledger", "--run", "nope"], home_copy, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("ghostvis: error: unknown stage or run key 'nope'")
    assert c["run_key"] in proc.stderr


@pytest.mark.e2e
def test_init_then_plain_dagster_materialize_on_a_fresh_home(tmp_path):
    home = tmp_path / "fresh"  # does not exist yet: neither does DAGSTER_HOME (home/dagster)
    proc = run_cli(["ghostvis", "init"], home)
    assert (home / "dagster" / "dagster.yaml").is_file() and "export DAGSTER_HOME=" in proc.stdout
    proc = run_cli(
        ["dagster", "asset", "materialize", "--select", "shard_manifest", "-m", "ghostvis_pipeline.definitions"], home
    )
    assert "BetaWarning" not in proc.stderr and "DeprecationWarning" not in proc.stderr
    assert (home / "sources").is_dir()
