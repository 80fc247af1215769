"""The demo's sft and rl models exported with their training manifest and model card: verify-model passes,
and fails naming the first difference for a changed figure (manifest, card) or token file; a document's
inclusion proof checks against the shipped manifest alone; the MLflow tag carries the manifest's sha256;
`ghostvis summary` equals the ledger by DuckDB queries written here; the README's "What your model was trained
on" commands run as written from an empty folder (on a copy of the demo home) and say what the ledger says."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from ghostvis_core.run.hf.inclusion import check_proof
from ghostvis_core.run.hf.model_files import write_model_files
from ghostvis_core.run.hf.register import MANIFEST_TAG, stage_model
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.lookup import newest_completed_run
from tests.conftest import DEMO_COMMAND, copy_home, run_cli
from tests.readme_walks import readme_blocks, walk
from tests.test_trace import replayed_document

LICENCE = "license: apache-2.0\nlicense_link: https://example.org/LICENSE\nprovider: Example Labs\n"


@pytest.fixture(scope="module")
def readme_walk(demo_home, module_tmp) -> tuple[Path, str]:
    """The README's "What your model was trained on" commands, run as written by bash in an empty folder with
    its summary.yaml, except their first, `ghostvis demo --preset smoke`: the session's demo home, which that
    very command built, is copied in as its home instead. (the folder, the commands' stdout)"""
    (declared,), (commands,) = readme_blocks("trained-on")
    demo = " ".join(DEMO_COMMAND)
    assert demo in commands.splitlines(), commands
    workdir = module_tmp("trained-on") / "walk"
    copy_home(demo_home, workdir / "my-home")
    _, out = walk(workdir, {"summary.yaml": declared}, commands.replace(f"{demo}\n", "", 1))
    return workdir, out


@pytest.fixture(scope="module")
def exported(demo_home, readme_walk, tmp_path_factory) -> dict[str, Path]:
    """The demo's rl model exported by `ghostvis export` (the README walk's), and its sft model the way the
    export job does (`python -m ghostvis_core.run.hf.export --summary`), with a summary.yaml declaring a
    licence. The manifest is the ledger's whatever summary.yaml says, and the walk's home is a copy of the
    demo home: the rl model's manifest is the demo home's."""
    out = tmp_path_factory.mktemp("exports")
    (out / "summary.yaml").write_text(LICENCE)
    args = ["--store", str(demo_home / "store"), "--stage", "sft", "--to", str(out / "sft")]
    run_cli(
        [sys.executable, "-m", "ghostvis_core.run.hf.export", *args, "--summary", str(out / "summary.yaml")], demo_home
    )
    return {"sft": out / "sft", "rl": readme_walk[0] / "rl-model"}


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / "ghostvis_manifest.json").read_text())


def verify(folder: Path, home: Path, *store: str):
    return run_cli(["ghostvis", "verify-model", str(folder), *store], home, check=False)


def copy_export(src: Path, dest: Path) -> Path:
    dest.mkdir()
    for name in ("ghostvis_manifest.json", "README.md"):
        (dest / name).write_bytes((src / name).read_bytes())
    return dest


def ledger_sql(home: Path, sql: str, params: list | None = None) -> list[tuple]:
    """A query over the demo ledger's Parquet files (tables as views named by their folders)."""
    db, root = duckdb.connect(), home / "store" / "ledger"
    for table in ("parts", "consumption", "feeds", "shards"):
        db.execute(
            f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{root}/{table}/**/*.parquet', union_by_name=true)"
        )
    return db.execute(sql, params or []).fetchall()


@pytest.mark.parametrize("stage", ["sft", "rl"])
def test_the_export_carries_a_manifest_and_card_that_verify_against_the_store(exported, demo_home, stage):
    folder = exported[stage]
    manifest, card = manifest_of(folder), (folder / "README.md").read_text()
    digest = hashlib.sha256((folder / "ghostvis_manifest.json").read_bytes()).hexdigest()
    assert card.startswith("---\n") and f"ghostvis_manifest_sha256: {digest}\n" in card
    head = manifest["stages"][-1]
    assert manifest["model"] == {"stage": stage, "run_key": head["run_key"]}
    assert head["run_key"] == newest_completed_run(Home(demo_home).store, stage).run_key
    for s in manifest["stages"]:  # each stage's figures and leaves, by queries of the ledger's files
        real, pad, loss, cropped, steps = ledger_sql(
            demo_home,
            "SELECT sum(real_tokens), sum(pad_tokens), sum(loss_tokens), sum(cropped_tokens), max(step_last) "
            "FROM parts WHERE run_key = ?",
            [s["run_key"]],
        )[0]
        assert s["tokens"] == {"real_tokens": real, "pad_tokens": pad, "loss_tokens": loss, "cropped_tokens": cropped}
        assert s["steps"] == steps and real > 0
        leaves = ledger_sql(demo_home, "SELECT count(*) FROM feeds WHERE run_key = ?", [s["run_key"]])[0][0]
        assert s["merkle"]["leaves"] == leaves > 0
        assert f"| {s['stage']} | {s['run_key']} |" in card
    assert [s["stage"] for s in manifest["stages"]][-2:] == (
        ["vision_alignment", "sft"] if stage == "sft" else ["dpo", "rl"]
    )
    for store in ([], ["--store", str(demo_home / "store")]):
        proc = verify(folder, demo_home, *store)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"consistent (manifest sha256 {digest}, {len(manifest['stages'])} stages)" in proc.stdout


def test_a_changed_figure_fails_verify_model_naming_it(exported, demo_home, tmp_path):
    src = exported["rl"]
    manifest = manifest_of(src)
    real = manifest["stages"][-1]["tokens"]["real_tokens"]
    forged = json.loads(json.dumps(manifest))
    forged["stages"][-1]["tokens"]["real_tokens"] = real + 1

    alone = copy_export(src, tmp_path / "manifest_only")  # the manifest changed, the card not
    (alone / "ghostvis_manifest.json").write_text(json.dumps(forged, indent=2, sort_keys=True) + "\n")
    proc = verify(alone, demo_home)
    assert proc.returncode == 1 and "README.md: ghostvis_manifest_sha256 is" in proc.stdout

    both = tmp_path / "both"  # manifest and card forged together: only the ledger tells
    both.mkdir()
    write_model_files(both, forged)
    assert verify(both, demo_home).returncode == 0
    proc = verify(both, demo_home, "--store", str(demo_home / "store"))
    assert proc.returncode == 1
    assert (
        f"ghostvis_manifest.json stages[{len(manifest['stages']) - 1}].tokens.real_tokens: "
        f"the manifest says {real + 1}, the ledger {real}" in proc.stdout
    )

    card = copy_export(src, tmp_path / "card")  # one figure of the card's lineage table
    text = (card / "README.md").read_text()
    line = next(n for n, ln in enumerate(text.splitlines(), 1) if ln.startswith("| rl | rl-"))
    (card / "README.md").write_text(text.replace(f" | {real} | ", f" | {real + 5} | ", 1))
    proc = verify(card, demo_home)
    assert proc.returncode == 1 and f"README.md line {line}: " in proc.stdout and str(real + 5) in proc.stdout

    shards = copy_export(src, tmp_path / "sums")  # a source's tokens no longer its shards' sum
    forged = json.loads(json.dumps(manifest))
    forged["stages"][0]["sources"][0]["shards"][0]["tokens"] += 7
    write_model_files(shards, forged)
    proc = verify(shards, demo_home)
    source = manifest["stages"][0]["sources"][0]
    assert proc.returncode == 1
    assert (
        f"(pretrain {source['source']}): tokens {source['tokens']}, but its shards sum to {source['tokens'] + 7}"
        in proc.stdout
    )


def test_one_changed_token_in_a_token_file_fails_verify_model_naming_it(exported, home_copy):
    manifest = manifest_of(exported["sft"])
    shard = manifest["stages"][-1]["sources"][0]["shards"][0]
    path = (home_copy / "store" / "shards" / "tokens" / manifest["tokenizer_id"] / shard["shard_id"]).with_name(
        shard["shard_id"].split("/")[1]
    ) / f"{shard['content_sha256']}.arrow"
    table = pa.ipc.open_file(pa.BufferReader(path.read_bytes())).read_all()
    docs = table.column("tokens").to_pylist()
    docs[0][0] = (docs[0][0] + 1) % 4096
    changed = table.set_column(1, "tokens", pa.array(docs, type=table.schema.field("tokens").type))
    with pa.ipc.new_file(str(path), changed.schema) as w:  # the token file replaced in place
        w.write_table(changed)
    proc = verify(exported["sft"], home_copy, "--store", str(home_copy / "store"))
    assert proc.returncode == 1
    assert f"token file {path} of shard {shard['shard_id']} (read by sft): sha256 " in proc.stdout
    assert f"the ledger recorded {shard['token_sha256']}; re-materialize tokenized_shards partition" in proc.stdout


def test_a_document_s_inclusion_is_proven_against_the_manifest_alone(exported, demo_home):
    shard_id, row = replayed_document(Ledger.in_store(Home(demo_home).store))
    manifest = manifest_of(exported["rl"])
    proc = run_cli(
        ["ghostvis", "trace", "--doc", f"{shard_id}:{row}", "--model", str(exported["rl"]), "--json"], demo_home
    )
    report = json.loads(proc.stdout)
    plain = json.loads(
        run_cli(["ghostvis", "trace", "--doc", f"{shard_id}:{row}", "--json", "--no-models"], demo_home).stdout
    )
    trained = {h["stage"] for h in plain["trained_by"]}
    assert {"pretrain", "reasoning_mix"} <= trained
    assert {s["stage"] for s in report["stages"] if s["trained"]} == trained
    for s in report["stages"]:
        assert s["trained"] == (s["proof"] is not None)
        if s["proof"]:
            assert s["fed_rows"] == sum(h["stage"] == s["stage"] for h in plain["trained_by"])
            assert check_proof(manifest, s["proof"]) is None
            forged = json.loads(json.dumps(s["proof"]))
            forged["row_digests"][0][0] = "0" * 16
            assert "the proof reaches root" in check_proof(manifest, forged)
            forged = {**s["proof"], "global_row": -1}
            assert "global row -1 is not in micro-batch" in check_proof(manifest, forged)
    # the text form of a yes is asserted on the README walk's output
    val = run_cli(["ghostvis", "trace", "--doc", "demo_prose/val_00000:0", "--model", str(exported["rl"])], demo_home)
    assert [ln.split()[-1] for ln in val.stdout.splitlines()[2:]] == ["no"] * len(manifest["stages"])


def test_the_registered_model_version_is_tagged_with_the_manifest_s_sha256(exported, demo_home):
    store = Home(demo_home).store
    key = manifest_of(exported["sft"])["model"]["run_key"]
    tags = stage_model(LaunchSpec.read(store, "sft", key), store).tags
    assert tags[MANIFEST_TAG] == hashlib.sha256((exported["sft"] / "ghostvis_manifest.json").read_bytes()).hexdigest()


def lineage_runs(home: Path, run_key: str) -> list[str]:
    out = [run_key]
    while True:
        parent = ledger_sql(home, "SELECT DISTINCT parent_run_key FROM parts WHERE run_key = ?", [out[-1]])
        if not parent or not parent[0][0]:
            return out
        out.append(parent[0][0])


def test_the_summary_of_rl_equals_the_ledger(demo_home, tmp_path):
    (tmp_path / "summary.yaml").write_text(
        "provider: Example Labs\nsources:\n  demo_prose: {category: web_crawl, licence: CC-BY-4.0}\n"
    )
    proc = run_cli(
        ["ghostvis", "summary", "--stage", "rl", "--format", "json", "--summary", str(tmp_path / "summary.yaml")],
        demo_home,
    )
    summary = json.loads(proc.stdout)
    runs = lineage_runs(demo_home, newest_completed_run(Home(demo_home).store, "rl").run_key)
    marks = ",".join("?" * len(runs))
    tokens = dict(
        ledger_sql(
            demo_home,
            f"SELECT source, sum(tok_end - tok_start) FROM consumption WHERE run_key IN ({marks}) GROUP BY source",
            runs,
        )
    )
    docs = dict(
        ledger_sql(
            demo_home,
            "SELECT source, count(*) FROM (SELECT DISTINCT source, run_key, shard_id, "
            "unnest(range(row_start, row_end)) "
            f"FROM consumption WHERE run_key IN ({marks})) GROUP BY source",
            runs,
        )
    )
    kinds = dict(ledger_sql(demo_home, "SELECT DISTINCT source, kind FROM shards"))
    total = sum(tokens.values())
    assert {s["source"]: s["tokens"] for s in summary["sources"]} == tokens and len(tokens) == 7
    assert {s["source"]: s["share"] for s in summary["sources"]} == {k: round(v / total, 6) for k, v in tokens.items()}
    g = summary["general"]
    assert g["tokens"] == total and g["provider"] == "Example Labs"
    images = [s for s in tokens if kinds[s] == "image_caption"]
    assert g["modalities"]["text"] == {
        "tokens": sum(v for s, v in tokens.items() if s not in images),
        "documents": sum(v for s, v in docs.items() if s not in images),
    }
    assert g["modalities"]["image"] == {
        "images": sum(docs[s] for s in images),
        "tokens": sum(tokens[s] for s in images),
    }
    prose = next(s for s in summary["sources"] if s["source"] == "demo_prose")
    assert prose["category"] == "web_crawl" and prose["licence"] == "CC-BY-4.0"
    assert [d["stage"] for d in summary["processing"]["decontamination"]][-1] == "rl"
    # the Markdown form is asserted on the README walk's output


def test_the_card_states_the_users_licence_and_nothing_else_of_its_own(exported, demo_home, tmp_path):
    """The licence fields are the user's, in the card only: the manifest (whose sha256 the MLflow tag
    carries, checked above) is the ledger's whatever summary.yaml says."""
    card = (exported["sft"] / "README.md").read_text()
    assert "\nlicense: apache-2.0\n" in card and "\nlicense_link: https://example.org/LICENSE\n" in card
    assert "License: apache-2.0 (declared by the model's provider)." in card
    assert "Example Labs" not in (exported["sft"] / "ghostvis_manifest.json").read_text()
    out = copy_export(exported["sft"], tmp_path / "sft")
    (out / "README.md").write_text(card.replace("license: apache-2.0\n", "license: mit\n"))
    proc = verify(out, demo_home)  # the metadata's licence and the body's licence line must agree
    assert (
        proc.returncode == 1
        and "License: apache-2.0 (declared" in proc.stdout
        and 'renders "License: mit (' in proc.stdout
    )
    (out / "README.md").write_text(card.replace("apache-2.0", "mit"))
    assert verify(out, demo_home).returncode == 0  # the user's field: re-rendered as the card states it
    (out / "README.md").write_text(card.replace("- demo_chat\n", "- demo_web\n"))
    proc = verify(out, demo_home)
    assert proc.returncode == 1 and "'- demo_web'; the manifest renders '- demo_chat'" in proc.stdout


def lineage_tokens(home: Path, stage: str) -> dict[str, int]:
    """Per source, the tokens the newest `stage` run's lineage consumed, by a query of the ledger's files."""
    runs = lineage_runs(home, newest_completed_run(Home(home).store, stage).run_key)
    sql = f"SELECT source, sum(tok_end - tok_start) FROM consumption WHERE run_key IN ({','.join('?' * len(runs))}) "
    return dict(ledger_sql(home, sql + "GROUP BY source", runs))


def test_the_readme_walk_exports_verifies_traces_and_summarizes_the_rl_model(readme_walk, demo_home):
    workdir, out = readme_walk
    folder = workdir / "rl-model"
    manifest, card = manifest_of(folder), (folder / "README.md").read_text()
    digest = hashlib.sha256((folder / "ghostvis_manifest.json").read_bytes()).hexdigest()
    assert "\nlicense: apache-2.0\n" in card  # summary.yaml, copied into the home, reached the card
    consistent = f"rl-model: consistent (manifest sha256 {digest}, {len(manifest['stages'])} stages)"
    assert f"{consistent}\n" in out  # the folder alone
    assert f"{consistent}; every figure, Merkle root and token file matches the store {workdir}/my-home/store\n" in out

    # the README's document is a yes exactly for the stages whose consumption holds its row, by the ledger's files
    shard_id, row = re.search(r"--doc (\S+):(\d+) --model", readme_blocks("trained-on")[1][0]).groups()
    runs = [s["run_key"] for s in manifest["stages"]]
    trained = ledger_sql(
        demo_home,
        "SELECT DISTINCT stage FROM consumption WHERE shard_id = ? AND row_start <= ? AND row_end > ? "
        f"AND run_key IN ({','.join('?' * len(runs))})",
        [shard_id, int(row), int(row), *runs],
    )
    assert {s for (s,) in trained} == {"pretrain", "reasoning_mix"}  # as the README says
    stages = [s["stage"] for s in manifest["stages"]]
    answers = {ln.split()[0]: ln.split()[1] for ln in out.splitlines() if ln.split()[:1] and ln.split()[0] in stages}
    assert answers == {s: "yes:" if s in {"pretrain", "reasoning_mix"} else "no" for s in stages}
    assert out.count("proof checks against the manifest") == 2 and "proof FAILS" not in out
    assert f"model rl ({manifest['model']['run_key']}), manifest sha256 {digest}\n" in out

    tokens = lineage_tokens(demo_home, "rl")
    md = out[out.index("# Training content summary: rl ") :]
    assert [ln for ln in md.splitlines() if ln.startswith("## ")] == [
        "## 1. General",
        "## 2. Sources",
        "## 3. Processing",
    ]
    assert "\n- provider: Example Labs (declared)\n- model name: ghostvis-demo (declared)\n" in md
    assert f"\n- tokens: {sum(tokens.values())}\n" in md
    for source, category, licence in (("demo_prose", "public_dataset", "CC-BY-4.0"), ("demo_code", "licensed", "MIT")):
        (row,) = [ln for ln in md.splitlines() if ln.startswith(f"| {source} |")]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert (cells[1], cells[4], cells[6]) == (category, str(tokens[source]), licence), row
