"""The README's "Every stage on your own data" walk, run verbatim from an empty folder: a user's chats,
preference pairs, problems and image-caption pairs (JSON Lines under their own column names, TRL's
conversational pairs, a folder of images with a captions file) served from a local S3 server, `./my-model` a
Hugging Face export of the demo's reasoning_mix. sft, dpo and rl of the `chat` lineage and vision_alignment
each start where the README says, train on the user's rows only, and the ledger, the checks and the audit
hold as for text. That the same files over HTTP give the same shards, for every kind, is
tests/test_own_data.py's (test_every_kind_downloads_to_the_same_shard_over_s3_http_and_file)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.demo.tasks import build_task_source
from ghostvis_core.runs.launch_spec import LaunchSpec
from ghostvis_core.runs.lookup import completed_runs
from tests.conftest import run_cli
from tests.readme_walks import readme_blocks, upload_folder, walk

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"chats": "demo_chat", "pairs": "demo_prefs", "problems": "demo_reasoning", "captions": "demo_images"}
TRAIN_SHARDS = 3  # 00000..00002 train, 00003 validation (the README's pins)


def readme_walk() -> tuple[str, str]:
    """(sources.yaml, the bash commands) between the README's own-stages markers."""
    (yaml,), (bash,) = readme_blocks("own-stages")
    return yaml, bash


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def user_rows(kind: str, row: dict, folder: Path, index: str) -> dict:
    """A demo row in the shape a user brings it (the README's comments)."""
    if kind == "chats":
        return {"conversations": row["messages"]}
    if kind == "pairs":
        return {
            "prompt": [{"role": "user", "content": row["prompt"]}],
            "chosen": [{"role": "assistant", "content": row["chosen"]}],
            "rejected": [{"role": "assistant", "content": row["rejected"]}],
        }
    if kind == "problems":
        question, answer = row["text"].split("\n")[0], int(row["text"].rsplit("Answer:", 1)[1].strip())
        return {"question": question, "answer": answer}
    name = f"img/{index}.png"
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(row["image"])
    return {"file_name": name, "caption": row["caption"]}


@pytest.fixture(scope="module")
def corpus(module_tmp) -> Path:
    """The demo's task rows as a user's files: bucket/<kind>/0000{0..3}.jsonl (text-only chats)."""
    out = module_tmp("own-stages")
    for kind, source in KINDS.items():
        files = build_task_source(source, out / "build" / kind)
        train = [r for p, split in files if split == "train" for r in pq.read_table(p).to_pylist()]
        val = [r for p, split in files if split == "validation" for r in pq.read_table(p).to_pylist()]
        if kind == "chats":
            train, val = ([r for r in rows if not r["image"]] for rows in (train, val))
        shards = [train[i::TRAIN_SHARDS] for i in range(TRAIN_SHARDS)] + [val]
        folder = out / "bucket" / kind
        for n, rows in enumerate(shards):
            user = [user_rows(kind, r, folder, f"{n}-{i}") for i, r in enumerate(rows)]
            write_jsonl(folder / f"{n:05d}.jsonl", user)
    return out / "bucket"


@pytest.fixture(scope="module")
def bucket(corpus, moto_s3) -> str:
    """The S3 server holding the corpus as my-bucket: its endpoint."""
    upload_folder(moto_s3, "my-bucket", corpus)
    return moto_s3


@pytest.fixture(scope="module")
def my_model(demo_home, module_tmp) -> Path:
    """A Hugging Face checkpoint folder: the demo's reasoning_mix, exported."""
    out = module_tmp("model") / "my-model"
    run_cli(["ghostvis", "export", "--stage", "reasoning_mix", "--to", str(out)], demo_home)
    return out


def test_the_readme_walk_trains_every_stage_on_the_users_own_data(tmp_path, bucket, my_model):
    sources_yaml, commands = readme_walk()
    shutil.copytree(my_model, tmp_path / "walk" / "my-model")
    # GHOSTVIS_PRESET=smoke: the smoke preset's batch sizes and steps for each stage
    home, out = walk(tmp_path / "walk", {"sources.yaml": sources_yaml}, commands, bucket, GHOSTVIS_PRESET="smoke")
    store, ledger = home.store, Ledger.in_store(home.store)

    shards = {r.shard_id: r for r in ledger.shards()}
    names = {"chats": "my_chats", "pairs": "my_pairs", "problems": "my_problems", "captions": "my_captions"}
    assert sorted(shards) == sorted(f"{n}/{i:05d}" for n in names.values() for i in range(TRAIN_SHARDS + 1))
    assert {k for k, r in shards.items() if r.split == "validation"} == {f"{n}/00003" for n in names.values()}
    tokenizer_ids = {r.tokenizer_id for r in shards.values()}
    assert len(tokenizer_ids) == 1  # the model's tokenizer, not one trained here

    runs = {stage: completed_runs(store, stage)[-1] for stage in ("sft", "dpo", "rl", "vision_alignment")}
    specs = {s: LaunchSpec.from_dict(store.read_json("run_spec", s, r.run_key)) for s, r in runs.items()}
    assert specs["sft"].tags["ghostvis.upstream_stage"] == specs["vision_alignment"].tags["ghostvis.upstream_stage"]
    assert specs["sft"].tags["ghostvis.upstream_stage"] == "hf_import"
    assert specs["dpo"].parent_run_key == runs["sft"].run_key and specs["rl"].parent_run_key == runs["dpo"].run_key
    assert {s.tokenizer_id for s in specs.values()} == tokenizer_ids
    reads = {"sft": "my_chats", "dpo": "my_pairs", "rl": "my_problems", "vision_alignment": "my_captions"}
    for stage, run in runs.items():
        consumed = ledger.consumed_by_shard(run.run_key)
        assert {r.shard_id.split("/")[0] for r in consumed} == {reads[stage]}, stage
        assert not {r.shard_id for r in consumed} & {f"{reads[stage]}/00003"}, stage  # never the validation shard
        assert run.counts.real_tokens > 0 and sum(p.real_tokens for p in ledger.chain(run.run_key)) == (
            run.counts.real_tokens
        ), stage
    assert "every figure agrees" in out or "0 failures" in out, out[-3000:]
