"""Bad input, one at a time, on a home that already holds a registered source, its downloaded shards
and a committed checkpoint: each case is refused with its exit code and a first line naming the thing
and the fix, and every file of the home is byte for byte what it was before (issue 44).

One small home for the module (two text shards listed from a folder, shard_manifest and raw_shards
materialized in process, one checkpoint of a tiny model, one MLflow run in its mlflow.db); no torchrun, no
network."""

from __future__ import annotations

import dataclasses
import shutil
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ghostvis_core.data.normalize_shard import normalize_shard
from ghostvis_core.data.shard_manifest import ShardEntry, fetch_shard
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.plan.config import ModelConfig
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.run.train.checkpoint_manager import CheckpointManager
from ghostvis_core.run.train.dist import DistContext
from ghostvis_core.store.files import sha256_file
from ghostvis_core.store.folder import FolderStore
from ghostvis_pipeline import cli

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16)
TEXTS = {"a": ["first document", "second one"], "b": ["third document"]}


def files_of(root: Path) -> dict[str, str]:
    """Every file under `root` by its content hash: what a refused input must leave as it was."""
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def write_parquet(path: Path, columns: dict, schema: pa.Schema | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)
    return path


def run_manifest(home: Path, remote: list[dict], selection: str = "shard_manifest", tags=None):
    """shard_manifest (and raw_shards when selected) in process, on an ephemeral Dagster instance."""
    from dagster import DagsterInstance, materialize

    from ghostvis_pipeline.assets.data import raw_shards, shard_manifest
    from ghostvis_pipeline.resources import GhostvisHome

    with DagsterInstance.ephemeral() as instance:
        config = {"ops": {"shard_manifest": {"config": {"sources": [], "remote": remote}}}}
        first = materialize(
            [shard_manifest],
            instance=instance,
            resources={"home": GhostvisHome(root=str(home))},
            run_config=config,
            raise_on_error=False,
        )
        if selection == "shard_manifest" or not first.success:
            return first
        from ghostvis_pipeline.demo import PARTITION_RANGE_END_TAG, PARTITION_RANGE_START_TAG

        keys = instance.get_dynamic_partitions("shards")
        return materialize(
            [shard_manifest, raw_shards],
            instance=instance,
            resources={"home": GhostvisHome(root=str(home))},
            selection=[raw_shards],
            tags={PARTITION_RANGE_START_TAG: keys[0], PARTITION_RANGE_END_TAG: keys[-1]},
            raise_on_error=False,
        )


def first_error(result) -> str:
    """The first line of a failed Dagster run's user message (a GhostvisError's text, as the CLI shows it)."""
    [failure] = [e for e in result.all_events if e.is_step_failure]
    err = failure.event_specific_data.error
    while err.cause is not None and not err.cls_name.endswith(("GhostvisError", "DamagedCheckpoint")):
        err = err.cause
    assert err.cls_name == "GhostvisError", err.to_string()
    return err.message.split(": ", 1)[1].splitlines()[0]


def record_mlflow_run(home: Path) -> None:
    """One finished MLflow run with a token metric in the home's MLflow store (its mlflow.db, which the
    `unchanged` check hashes with every other file: a refused input must leave the runs as they were)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(Home(home).mlflow_tracking_uri)
    run = client.create_run(client.create_experiment("pretrain", artifact_location=(home / "mlartifacts").as_uri()))
    client.log_metric(run.info.run_id, "tokens/real", 512, step=1)
    client.set_terminated(run.info.run_id)


@pytest.fixture(scope="module")
def home(module_tmp) -> Path:
    """A home with source `web` (two text shards from a folder listing) downloaded, one committed
    checkpoint of a tiny model at checkpoints/pretrain/r1/step_000000002 and one MLflow run."""
    root = module_tmp("bad-inputs")
    listing = root / "listing"
    for name, texts in TEXTS.items():
        write_parquet(listing / f"{name}.parquet", {"text": texts})
    result = run_manifest(root / "home", [{"name": "web", "listing": listing.as_uri()}], selection="raw_shards")
    assert result.success
    store = FolderStore(root / "home" / "store")
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    opt.step()
    run_dir = store.writable("checkpoints", "pretrain", "r1")
    for step in (1, 2):
        ckpt.save(
            run_dir, step, model=model, optimizer=opt, state={"step": step}, config={"model": dataclasses.asdict(TINY)}
        )
    record_mlflow_run(root / "home")
    return root / "home"


@pytest.fixture
def unchanged(home):
    """Asserts, after the test, that no file of the home was added, removed or changed: the store and the
    MLflow store (mlflow.db: every run recorded before, its metrics included)."""
    before = files_of(home)
    assert "mlflow.db" in before
    yield home
    assert files_of(home) == before


# --- 1. source declarations: refused by shard_manifest before it writes anything ---------------------

LISTING = "{listing}"
DECLARATIONS = {
    "absolute name": (
        [{"name": "/tmp/web2", "listing": LISTING}],
        "source name '/tmp/web2' is not a plain identifier; name it with letters, digits",
    ),
    "name with a separator": ([{"name": "a/b", "listing": LISTING}], "source name 'a/b' is not a plain identifier"),
    "name ..": ([{"name": "..", "listing": LISTING}], "source name '..' is not a plain identifier"),
    "name with a control byte": (
        [{"name": "web\x07", "listing": LISTING}],
        "source name 'web\\x07' is not a plain identifier",
    ),
    "declared twice": (
        [{"name": "two", "listing": LISTING}, {"name": "two", "listing": LISTING}],
        "source(s) two declared more than once in this shard_manifest run; a later one would replace the first "
        "one's manifest: keep one declaration per name, or rename one",
    ),
    "misspelt kind": (
        [{"name": "web2", "kind": "txt", "listing": LISTING}],
        "source web2: unknown kind 'txt'; set kind to one of text, chat, preference, problem, image_caption",
    ),
    "listing that finds nothing": (
        [{"name": "web2", "listing": "{empty}"}],
        "source web2: no .parquet or .jsonl shards found at {empty}; check the listing URL and the shard range",
    ),
    "listing beyond its shards": (
        [{"name": "web2", "listing": LISTING, "first_shard": 5}],
        "source web2: no .parquet or .jsonl shards found at {listing} from shard 5; check the listing URL and the "
        "shard range",
    ),
    "negative shard range": (
        [{"name": "web2", "listing": LISTING, "first_shard": -1}],
        "source web2: first_shard=-1 and num_shards=0 must be 0 or more; fix the shard range",
    ),
    "validation pin matching no shard": (
        [{"name": "web2", "listing": LISTING, "validation": ["zzz"]}],
        "source web2: pinned shards ['zzz'] (in validation/sha256) match no shard listed at {listing}",
    ),
    "url_pattern and listing": (
        [{"name": "web2", "listing": LISTING, "url_pattern": "https://h/{shard}.parquet", "num_shards": 1}],
        "source web2: give exactly one of url_pattern or listing",
    ),
    "url_pattern without {shard}": (
        [{"name": "web2", "url_pattern": "https://h/x.parquet", "num_shards": 2}],
        "source web2: url_pattern 'https://h/x.parquet' must contain {shard} and no other field",
    ),
    "columns mapping of a field the kind lacks": (
        [{"name": "web2", "listing": LISTING, "columns": {"body": "text"}}],
        "source web2: columns mapping 'body': 'text' does not map a field of a text source to a column name",
    ),
    "misspelt reward rule": (
        [{"name": "web2", "kind": "problem", "listing": LISTING, "reward": "exact"}],
        "source web2: reward 'exact' is not a reward rule; use integer (the default), string or regex:<pattern>",
    ),
    "validation_sha256 that is no digest": (
        [{"name": "web2", "listing": LISTING, "validation_sha256": ["abc"]}],
        "source web2: validation_sha256 pin 'abc' is not a sha256 digest",
    ),
}


@pytest.mark.parametrize("case", list(DECLARATIONS))
def test_a_bad_source_declaration_is_refused_before_anything_is_written(case, unchanged, tmp_path):
    remote, message = DECLARATIONS[case]
    (tmp_path / "empty").mkdir()
    fill = {LISTING: (unchanged.parent / "listing").as_uri(), "{empty}": (tmp_path / "empty").as_uri()}

    def filled(text):
        for k, v in fill.items():
            text = text.replace(k, v) if isinstance(text, str) else text
        return text

    result = run_manifest(unchanged, [{k: filled(v) for k, v in source.items()} for source in remote])
    assert not result.success
    assert first_error(result).startswith(filled(message))


def test_a_listing_with_a_link_out_of_its_folder_is_refused(unchanged, tmp_path):
    outside = write_parquet(tmp_path / "secret.parquet", {"text": ["not yours"]})
    listing = tmp_path / "listing"
    listing.mkdir()
    (listing / "in.parquet").symlink_to(outside)
    result = run_manifest(unchanged, [{"name": "web2", "listing": listing.as_uri()}])
    assert not result.success
    assert first_error(result) == (
        f"listing {listing.as_uri()}: {listing / 'in.parquet'} resolves to {outside}, outside the listed folder "
        f"(1 such file(s)); a listing reads only its own folder: copy the file into it or remove the link"
    )


# --- 2. shard files: checked row by row for their kind before they take their place ------------------

SHARDS = {
    "text column of integers": ("text", {"text": [1, 2]}, None, "row 0, field 'text' is an int (1), expected a string"),
    "text column of bytes": (
        "text",
        {"text": [b"\xff\xfe"]},
        None,
        "row 0, field 'text' is a bytes (b'\\xff\\xfe'), expected a string",
    ),
    "text of invalid UTF-8": (
        "text",
        {"text": pa.array([b"fine", b"\xff\xfe"], pa.binary()).view(pa.string())},
        None,
        "row 1, column 'text' is not valid UTF-8 text",
    ),
    "no text column": (
        "text",
        {"body": ["x"]},
        None,
        "row 0, field 'text' is missing (the row's columns: body); expected a string",
    ),
    "chat messages as a string": (
        "chat",
        {"messages": ["hello"]},
        None,
        "row 0, field 'messages' is a str ('hello'), expected a non-empty list of {role, content} messages",
    ),
    "caption without images": (
        "image_caption",
        {"caption": ["a cat"]},
        None,
        "row 0, field 'image' is missing (the row's columns: caption); expected image bytes, or a path",
    ),
    "image named by a path that is not there": (
        "image_caption",
        {"caption": ["a cat"], "image": ["cat.png"]},
        None,
        "row 0, field 'image' names 'cat.png', which cannot be read (file:///",
    ),
    "preference without rejected": (
        "preference",
        {"prompt": ["q"], "chosen": ["a"]},
        None,
        "row 0, field 'rejected' is missing (the row's columns: chosen, prompt); expected a string or a list",
    ),
}


def download_check(shard_id: str, kind: str, entry: ShardEntry):
    """raw_shards' check of a download: every row of its kind (records.normalize_shard)."""
    return partial(normalize_shard, shard_id, kind, {}, entry.url)


@pytest.mark.parametrize("case", list(SHARDS))
def test_a_shard_of_the_wrong_schema_is_refused_at_download_and_kept_nowhere(case, unchanged, tmp_path):
    kind, columns, schema, message = SHARDS[case]
    src = write_parquet(tmp_path / "bad.parquet", columns, schema)
    dest = FolderStore(unchanged / "store").writable("raw_shard", "web/bad")
    entry = ShardEntry("bad", src.as_uri())
    with pytest.raises(GhostvisError) as exc:
        fetch_shard("web/bad", entry, dest, check=download_check("web/bad", kind, entry))
    assert str(exc.value).startswith(f"shard web/bad: {message}")
    assert str(exc.value).endswith("then re-materialize raw_shards partition web/bad")
    assert not dest.exists()


def test_a_file_that_is_neither_parquet_nor_json_lines_is_refused_at_download(unchanged, tmp_path):
    dest = FolderStore(unchanged / "store").writable("raw_shard", "web/bad")
    for content, refusal in (
        (b"not parquet at all", r"line 1 is not a JSON object \(.*\); a shard is a Parquet file or JSON Lines"),
        (b"PAR1 and then nothing", r"not a readable Parquet file \("),
    ):
        src = tmp_path / "bad.parquet"
        src.write_bytes(content)
        entry = ShardEntry("bad", src.as_uri())
        with pytest.raises(GhostvisError, match=rf"^shard web/bad: {refusal}"):
            fetch_shard("web/bad", entry, dest, check=download_check("web/bad", "text", entry))
        assert not dest.exists()


def test_a_shard_stored_before_the_check_is_refused_by_the_tokenizer_naming_row_and_column(tmp_path):
    from ghostvis_core.data.tokenize_shards import RawShardReader, TokenizeJob

    store = FolderStore(tmp_path / "store")
    text = pa.array([b"fine", b"also fine", b"\xff\xfe"], pa.binary()).view(pa.string())
    raw = write_parquet(store.writable("raw_shard", "old/00000"), {"text": text})
    job = TokenizeJob("old/00000", "old", "train", sha256_file(raw))
    with pytest.raises(GhostvisError) as exc:
        list(RawShardReader([job], str(tmp_path / "store")).run())
    assert str(exc.value) == (
        "shard old/00000: row 2, column 'text' is not valid UTF-8 text; fix the file or the source's kind (text), "
        "then re-materialize raw_shards partition old/00000"
    )


# --- 3. run config and --set values: by type and range, naming the key and a value to set -------------

SETS = {
    "lr=nan": (
        "optim.lr=nan",
        "config optim.lr: expected a finite number, got 'nan'; set it, e.g. --set optim.lr=3e-3",
    ),
    "lr=NaN": ("optim.lr=NaN", "config optim.lr: expected a finite number, got nan; set it, e.g. --set optim.lr=3e-3"),
    "lr=Infinity": ("optim.lr=Infinity", "config optim.lr: expected a finite number, got inf"),
    "lr<0": ("optim.lr=-1", "config optim.lr: -1.0 is not above 0; set it, e.g. --set optim.lr=3e-3"),
    "steps=0": ("budget.steps=0", "config budget.steps: 0 is not above 0; set it, e.g. --set budget.steps=100"),
    "steps=abc": (
        "budget.steps=abc",
        "config budget.steps: expected int, got 'abc'; set it, e.g. --set budget.steps=100",
    ),
    "steps=1.5": ("budget.steps=1.5", "config budget.steps: expected int, got 1.5"),
    "beta2=1.5": ("optim.beta2=1.5", "config optim.beta2: 1.5 is not in [0, 1); set it, e.g. --set optim.beta2=0.95"),
    "keep_last=0": ("checkpoint.keep_last=0", "config checkpoint.keep_last: 0 is not above 0"),
    "unknown key": ("optim.lrr=0.1", "unknown config key 'optim.lrr': 'lrr' is not in optim (valid keys there: "),
    "unknown optimizer": (
        "optim.name=sgd",
        "config config.optim.name: 'sgd' is not one of adamw, muon; set one of them",
    ),
    "no =": ("optim.lr", "--set 'optim.lr': expected key=value, e.g. --set budget.steps=100"),
}


@pytest.mark.parametrize("case", list(SETS))
def test_a_bad_set_value_exits_2_naming_the_key_and_a_value(case, unchanged, monkeypatch, capsys):
    flag, message = SETS[case]
    monkeypatch.setenv("GHOSTVIS_HOME", str(unchanged))
    monkeypatch.setenv("GHOSTVIS_PRESET", "smoke")
    assert cli.main(["plan", "--set", flag]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"ghostvis: error: {message}")


# --- 4. checkpoints: verified against the hashes of their COMPLETE marker before anything loads -------


def damaged_copy(home: Path, tmp_path: Path, damage) -> Path:
    """A copy of the home's newest checkpoint with `damage(folder)` applied (the home's stays intact)."""
    src = home / "store" / "checkpoints" / "pretrain" / "r1" / "step_000000002"
    dest = tmp_path / "run" / src.name
    shutil.copytree(src, dest)
    damage(dest)
    return dest


def flip_byte(f: Path, at: int = -5) -> None:
    data = bytearray(f.read_bytes())
    data[at] ^= 0xFF
    f.write_bytes(bytes(data))


DAMAGES = {
    "flipped byte in the weights": (
        lambda d: flip_byte(d / "model.safetensors"),
        "model.safetensors has sha256 ",
    ),
    "truncated weights": (
        lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100]),
        "model.safetensors has sha256 ",
    ),
    "optimizer state removed": (lambda d: (d / "optimizer.safetensors").unlink(), "optimizer.safetensors is missing"),
    "config edited": (lambda d: (d / "config.json").write_text("{}"), "config.json has sha256 "),
    "marker without hashes": (
        lambda d: (d / ckpt.MARKER).write_text("2"),
        "its COMPLETE marker records no file hashes (missing, damaged, or written before checkpoints recorded them)",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGES))
def test_a_damaged_checkpoint_is_refused_naming_it_before_loading(case, unchanged, tmp_path):
    damage, message = DAMAGES[case]
    path = damaged_copy(unchanged, tmp_path, damage)
    model = GPT(TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.DamagedCheckpoint) as exc:
        ckpt.load_model(path, model)
    assert str(exc.value).startswith(f"checkpoint {path}: {message}")
    assert "delete " + str(path) in str(exc.value) and "re-materialize the stage that wrote it" in str(exc.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was loaded


def manager(store_root: Path) -> CheckpointManager:
    spec = SimpleNamespace(stage="pretrain", run_key="r1")
    ctx = DistContext(0, 0, 1, torch.device("cpu"))
    return CheckpointManager(FolderStore(store_root), spec, ctx, keep_last=2, async_save=False, sharded=False)


def test_a_resume_passes_over_a_damaged_newest_checkpoint_to_the_previous_one(home, tmp_path, capsys):
    store = tmp_path / "store"
    shutil.copytree(home / "store" / "checkpoints", store / "checkpoints")
    flip_byte(store / "checkpoints" / "pretrain" / "r1" / "step_000000002" / "model.safetensors")
    resumed = manager(store)
    ref = resumed.newest()
    assert ref.step == 1
    [passed] = resumed.passed_over  # what the resumed segment's ledger parts declare (steps 2.. trained again)
    assert (passed["checkpoint"], passed["step"]) == ("step_000000002", 2)
    assert passed["reason"].startswith("model.safetensors has sha256 ") and str(store) not in passed["reason"]
    said = capsys.readouterr().out
    assert said.startswith(
        f"[pretrain] not resuming from it: checkpoint {store}/checkpoints/pretrain/r1/step_000000002: "
    )
    flip_byte(store / "checkpoints" / "pretrain" / "r1" / "step_000000001" / "model.safetensors")
    with pytest.raises(GhostvisError, match=r"^run r1: none of its 2 committed checkpoints in .* verifies against its"):
        manager(store).newest()


def test_an_intact_checkpoint_round_trips_through_its_marker(home, tmp_path):
    path = damaged_copy(home, tmp_path, lambda d: None)
    ckpt.verify(path)
    marker = ckpt.read_json(path, ckpt.MARKER)
    assert marker["step"] == 2
    assert sorted(marker["sha256"]) == ["config.json", "model.safetensors", "optimizer.safetensors", "train_state.json"]
    assert marker["sha256"]["model.safetensors"] == sha256_file(path / "model.safetensors")


# --- 5. content, not names: a file changed under its name is a new version, the old one stays ----------


def tokenized_version(store: FolderStore, shard_id: str, content: str, replaces: str = "") -> None:
    """A token file and its ledger record for one version (raw content) of a shard, as a worker writes them."""
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.data.ledger.records import ShardRecord
    from ghostvis_core.data.token_shard import list_column, write_token_shard

    path = store.writable("token_shard", "tok", shard_id, content)
    write_token_shard(path, {"row": pa.array([0], pa.int64()), "tokens": list_column([3], [1, 2, 3], "uint16")})
    store.publish("token_shard", "tok", shard_id, content)
    record = ShardRecord(shard_id=shard_id, source="web", split="train", kind="text", content_sha256=content,
                         replaces_sha256=replaces, raw_bytes=1, tokenizer_id="tok", docs=1, tokens=3, text_bytes=1,
                         token_path=str(path))  # fmt: skip
    Ledger.in_store(store).write_shard(record)


def test_a_source_file_changed_under_its_name_becomes_a_new_version_and_the_old_one_stays(home, tmp_path):
    from ghostvis_core.data.catalog import load_manifest, raw_content, recorded_sha256
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.data.tokenize_shards import job_for_shard
    from ghostvis_core.launch.start import select_shards

    copy, listing = tmp_path / "home", tmp_path / "listing"
    shutil.copytree(home, copy)
    shutil.copytree(home.parent / "listing", listing)
    store = FolderStore(copy / "store")
    old, old_bytes = recorded_sha256(store, "web/a"), store.fetch("raw_shard", "web/a").read_bytes()
    tokenized_version(store, "web/a", old)  # a run trained on this version
    write_parquet(listing / "a.parquet", {"text": ["first documenX", "second one"]})  # same name and size
    new = sha256_file(listing / "a.parquet")
    assert len(old_bytes) == (listing / "a.parquet").stat().st_size and new != old
    before = files_of(copy)
    assert run_manifest(copy, [{"name": "web", "listing": listing.as_uri()}], selection="raw_shards").success
    after = files_of(copy)
    assert sorted(k for k in before if after.get(k) != before[k]) == [
        "store/manifests/web.json",  # the listing's new URL
        "store/shards/raw/web/a.parquet",
        "store/shards/raw_meta/web/a.json",
    ]
    assert sorted(after.keys() - before.keys()) == [f"store/shards/raw_versions/web/a/{old}.parquet"]
    assert store.read_json("raw_shard_meta", "web/a") == {
        "shard_id": "web/a",
        "sha256": new,
        "bytes": len(old_bytes),
        "split": "train",
        "versions": [{"sha256": old, "bytes": len(old_bytes), "split": "train"}],
    }
    assert raw_content(store, "web/a", old).read_bytes() == old_bytes  # what the old run read, by its content
    assert raw_content(store, "web/a", new) == store.fetch("raw_shard", "web/a")
    job = job_for_shard(store, load_manifest(store, "web"), "web/a")
    assert (job.content_sha256, job.replaces_sha256) == (new, old)

    ledger = Ledger.in_store(store)
    with pytest.raises(GhostvisError) as exc:  # training the new content needs its tokenization
        select_shards(ledger, store, "tok", ["web"], "train")
    assert str(exc.value) == (
        f"shard web/a changed under its name: raw_shards recorded content sha256 {new}, but the ledger's newest "
        f"tokenization with tok is of sha256 {old}; re-materialize tokenized_shards partition web/a to tokenize "
        f"the new version"
    )
    tokenized_version(store, "web/a", new, replaces=old)
    [ref] = select_shards(ledger, store, "tok", ["web"], "train")["web"]
    assert (ref.content_sha256, ref.path) == (new, store.uri_of("token_shard", "tok", "web/a", new))
    versions = ledger.shards(tokenizer_id="tok", every_version=True)
    assert [(r.content_sha256, r.replaces_sha256) for r in versions] == [(old, ""), (new, old)]
    assert store.exists("token_shard", "tok", "web/a", old)  # the old version's tokens stay
