"""Every kind of a user's data (issue 45 item 1): chats, preference pairs in TRL's two shapes, RL problems and
image-caption pairs, in JSON Lines and in Parquet, some under other column names, through the real download
path (fetch_shard checking with records.normalize_shard) and real tokenization (datatrove, one worker): the
ledger counts what the chat template makes of each row, the same rows give the same token file whatever the
format, and the token files decode to their raw rows. A malformed row of each kind is refused naming the
shard, the row and the field, and the shard already in the store is left as it was."""

from __future__ import annotations

import io
import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.data.bpe_tokenizer import save_tokenizer, train_tokenizer
from ghostvis_core.data.catalog import RemoteSource, remote_manifest
from ghostvis_core.data.chat import render_chat, render_prompt, render_reply
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.normalize_shard import normalize_shard
from ghostvis_core.data.problems import completion_answer, is_correct
from ghostvis_core.data.shard_manifest import Manifest, ShardEntry, fetch_shard
from ghostvis_core.data.token_shard import TokenShard
from ghostvis_core.data.tokenize_shards import TokenizeJob
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import FolderStore
from ghostvis_core.store.files import sha256_file
from ghostvis_core.verify.audit.token_integrity import (
    documents_start_where_ledger_says,
    sampled_documents_decode_to_raw_text,
)
from tests.raw_shards import tokenize_here


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


TEXTS = ["a first plain document about the sky", "a second one, about the sea and its colour"]
CHATS = [
    [msg("user", "what is two plus two"), msg("assistant", "four, as two and two make four")],
    [msg("system", "be brief"), msg("user", "name a colour"), msg("assistant", "blue")],
    [msg("user", "describe <|image|> please"), msg("assistant", "a small red square")],
]
PAIRS = [
    ("say hello to the reader", "hello there, reader", "go away"),
    ("what colour is the sky", "the sky is blue on a clear day", "green"),
]
PROBLEMS = [("what is three plus four", 7), ("what is ten minus two", 8), ("what is six times three", 18)]


def png(color: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (4, 4), color).save(out, format="PNG")
    return out.getvalue()


CAPTIONS = [("a red square on white", png("red")), ("two blue circles", png("blue"))]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def user_files(root: Path) -> dict[str, tuple[str, dict[str, str], Path]]:
    """shard id -> (kind, columns mapping, the user's file), one per kind, format and shape."""
    chats_renamed = [{"conversations": c, "id": i} for i, c in enumerate(CHATS)]
    pairs_plain = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    pairs_chat = [
        {"prompt": [msg("user", p)], "chosen": [msg("assistant", c)], "rejected": [msg("assistant", r)]}
        for p, c, r in PAIRS
    ]
    for i, (_, image) in enumerate(CAPTIONS):
        (root / "pics" / "img").mkdir(parents=True, exist_ok=True)
        (root / "pics" / "img" / f"{i}.png").write_bytes(image)
    return {
        "text_jsonl/a": (
            "text",
            {"text": "body"},
            write_jsonl(root / "text_jsonl/a.jsonl", [{"body": t} for t in TEXTS]),
        ),
        "chat_jsonl/a": (
            "chat",
            {"messages": "conversations"},
            write_jsonl(root / "chat_jsonl/a.jsonl", chats_renamed),
        ),
        "chat_parquet/a": (
            "chat",
            {},
            write_parquet(root / "chat_parquet/a.parquet", [{"messages": c} for c in CHATS]),
        ),
        "pref_plain/a": ("preference", {}, write_jsonl(root / "pref_plain/a.jsonl", pairs_plain)),
        "pref_chat_jsonl/a": ("preference", {}, write_jsonl(root / "pref_chat_jsonl/a.jsonl", pairs_chat)),
        "pref_chat_parquet/a": ("preference", {}, write_parquet(root / "pref_chat_parquet/a.parquet", pairs_chat)),
        "problem_jsonl/a": (
            "problem",
            {"prompt": "question"},
            write_jsonl(root / "problem_jsonl/a.jsonl", [{"question": q, "answer": a} for q, a in PROBLEMS]),
        ),
        "problem_parquet/a": (
            "problem",
            {},
            write_parquet(root / "problem_parquet/a.parquet", [{"prompt": q, "answer": str(a)} for q, a in PROBLEMS]),
        ),
        "pics/captions": (
            "image_caption",
            {"image": "file_name"},
            write_jsonl(
                root / "pics/captions.jsonl",
                [{"file_name": f"img/{i}.png", "caption": c} for i, (c, _) in enumerate(CAPTIONS)],
            ),
        ),
        "pics_parquet/a": (
            "image_caption",
            {},
            write_parquet(root / "pics_parquet/a.parquet", [{"caption": c, "image": b} for c, b in CAPTIONS]),
        ),
        "pics_hf/a": (  # a Hugging Face datasets Image column: {bytes, path}
            "image_caption",
            {"caption": "text"},
            write_parquet(
                root / "pics_hf/a.parquet", [{"text": c, "image": {"bytes": b, "path": None}} for c, b in CAPTIONS]
            ),
        ),
    }


def download(store: FolderStore, shard_id: str, kind: str, columns: dict[str, str], path: Path):
    """raw_shards' download of one file (sources.fetch_shard with its check), published in the store."""
    entry = ShardEntry(shard_id.split("/")[1], path.as_uri())
    dest = (
        store.fetch("raw_shard", shard_id)
        if store.exists("raw_shard", shard_id)
        else store.writable("raw_shard", shard_id)
    )
    r = fetch_shard(shard_id, entry, dest, check=partial(normalize_shard, shard_id, kind, columns, entry.url))
    store.publish("raw_shard", shard_id)
    return r


@pytest.fixture(scope="module")
def kinds(module_tmp) -> SimpleNamespace:
    root = module_tmp("own_kinds")
    store = FolderStore(root / "store")
    tok = train_tokenizer([f"{q} {a}" for q, a in PROBLEMS] + [p + c + r for p, c, r in PAIRS] + TEXTS, 300)
    save_tokenizer(tok, store)
    files = user_files(root / "user")
    jobs, fetched = [], {}
    for sid, (kind, columns, path) in files.items():
        fetched[sid] = download(store, sid, kind, columns, path)
        jobs.append(TokenizeJob(sid, sid.split("/")[0], "train", fetched[sid].sha256, kind))
    tokenize_here(jobs, store, tok.tokenizer_id, root / "logs")
    ledger = Ledger.in_store(store)
    rows = {r.shard_id: r for r in ledger.shards(tokenizer_id=tok.tokenizer_id)}
    return SimpleNamespace(store=store, tok=tok, files=files, fetched=fetched, ledger=ledger, rows=rows, root=root)


def tokens_of(k: SimpleNamespace, shard_id: str) -> list[list[int]]:
    r = k.rows[shard_id]
    shard = TokenShard.open(k.store.fetch("token_shard", k.tok.tokenizer_id, shard_id, r.content_sha256), shard_id)
    return [shard.doc_tokens(d).tolist() for d in range(len(shard.rows))]


def test_each_kind_in_each_format_is_tokenized_with_the_ledgers_counts_right(kinds):
    tok, rows = kinds.tok, kinds.rows
    enc = tok.encode
    chat = sum(len(render_chat(tok, c)[0]) for c in CHATS)
    pairs = sum(len(render_prompt(tok, [msg("user", p)])) + len(enc(c)) + len(enc(r)) + 2 for p, c, r in PAIRS)
    problems = sum(len(render_prompt(tok, [msg("user", q)])) + len(render_reply(tok, str(a))) for q, a in PROBLEMS)
    captions = sum(3 + len(enc(c)) for c, _ in CAPTIONS)  # <|bos|><|image|> caption <|eot|>
    expected = {
        "text_jsonl/a": (2, sum(1 + len(enc(t)) for t in TEXTS)),  # <|bos|> text
        "chat_jsonl/a": (3, chat),
        "chat_parquet/a": (3, chat),
        "pref_plain/a": (2, pairs),
        "pref_chat_jsonl/a": (2, pairs),
        "pref_chat_parquet/a": (2, pairs),
        "problem_jsonl/a": (3, problems),
        "problem_parquet/a": (3, problems),
        "pics/captions": (2, captions),
        "pics_parquet/a": (2, captions),
        "pics_hf/a": (2, captions),
    }
    assert {sid: (r.docs, r.tokens) for sid, r in rows.items()} == expected
    assert {sid: r.kind for sid, r in rows.items()} == {sid: f[0] for sid, f in kinds.files.items()}


def test_the_same_rows_make_the_same_token_file_whatever_the_format_or_shape(kinds):
    for a, b in (
        ("chat_jsonl/a", "chat_parquet/a"),
        ("pref_plain/a", "pref_chat_jsonl/a"),
        ("pref_chat_jsonl/a", "pref_chat_parquet/a"),
        ("problem_jsonl/a", "problem_parquet/a"),
        ("pics/captions", "pics_parquet/a"),
        ("pics_parquet/a", "pics_hf/a"),
    ):
        assert tokens_of(kinds, a) == tokens_of(kinds, b), (a, b)
    images = pq.read_table(kinds.store.fetch("raw_shard", "pics/captions")).column("image").to_pylist()
    assert images == [b for _, b in CAPTIONS]  # the folder's images, fetched beside the captions file


def test_a_file_in_the_kinds_shape_is_kept_byte_for_byte_and_another_is_rewritten_as_its_parquet(kinds):
    for sid, (_, _, path) in kinds.files.items():
        stored = kinds.store.fetch("raw_shard", sid)
        kept = sid in ("chat_parquet/a", "pref_chat_parquet/a", "problem_parquet/a", "pics_parquet/a")
        assert (sha256_file(stored) == sha256_file(path)) is kept, sid
        assert kinds.fetched[sid].sha256 == sha256_file(stored) == kinds.rows[sid].content_sha256, sid
        assert stored.read_bytes()[:4] == b"PAR1"


def test_a_rewritten_file_downloaded_again_is_the_same_content(kinds, tmp_path):
    """The kind's Parquet written from a user's file is the same bytes each time: a download again is no new
    version of the shard."""
    store = FolderStore(tmp_path / "store")
    for sid in ("chat_jsonl/a", "pics/captions", "pics_hf/a"):
        kind, columns, path = kinds.files[sid]
        again = download(store, sid, kind, columns, path)
        assert again.downloaded and again.sha256 == kinds.fetched[sid].sha256, sid


def test_the_token_files_decode_to_their_raw_rows(kinds):
    for check in (documents_start_where_ledger_says, sampled_documents_decode_to_raw_text):
        out = check(kinds.store, kinds.ledger, kinds.tok.tokenizer_id)
        assert out.passed, out.failures
    assert (
        sampled_documents_decode_to_raw_text(kinds.store, kinds.ledger, kinds.tok.tokenizer_id).figures[
            "sampled_documents"
        ]
        == 2 + 3 + 3 + 2 + 2 + 2 + 3 + 3 + 2 + 2 + 2
    )


BAD = [  # (kind, columns, the user's rows, the refusal's words after "shard bad/a: ")
    (
        "chat",
        {},
        [{"messages": CHATS[0]}, {"messages": "hi"}],
        "row 1, field 'messages' is a str ('hi'), expected a non-empty list of {role, content} messages",
    ),
    (
        "chat",
        {"messages": "conversations"},
        [{"messages": CHATS[0]}],
        "row 0, field 'messages' (column 'conversations') is missing (the row's columns: messages); expected a list of "
        "{role, content} messages",
    ),
    (
        "chat",
        {},
        [{"messages": [msg("human", "hi")]}],
        "row 0, field 'messages[0].role' is 'human', expected one of system, user, assistant",
    ),
    (
        "preference",
        {},
        [{"prompt": "p", "chosen": "c"}],
        "row 0, field 'rejected' is missing (the row's columns: chosen, prompt); expected a string or a list of "
        "{role, content} messages",
    ),
    (
        "preference",
        {},
        [{"prompt": "p", "chosen": [msg("user", "c")], "rejected": [msg("assistant", "r")]}],
        "row 0, field 'chosen[0].role' is 'user', expected 'assistant'",
    ),
    (
        "preference",
        {},
        [
            {"prompt": "p", "chosen": "c", "rejected": "r"},
            {"prompt": "p", "chosen": [msg("assistant", "c")], "rejected": "r"},
        ],
        "row 1, field 'chosen' is a message list, but row 0's is a string: one shape per file",
    ),
    (
        "problem",
        {},
        [{"prompt": "q", "answer": 1}, {"prompt": "q", "answer": ["1"]}],
        "row 1, field 'answer' is a list (['1']), expected a string or an integer",
    ),
    (
        "problem",
        {},
        [{"prompt": 3, "answer": "1"}],
        "row 0, field 'prompt' is an int (3), expected a string or a list of {role, content} messages",
    ),
    (
        "image_caption",
        {},
        [{"caption": "c", "image": b"\x89PNG but cut"}],
        "row 0, field 'image' holds 12 bytes that are not an image (UnidentifiedImageError); expected PNG, JPEG",
    ),
    (
        "image_caption",
        {},
        [{"caption": "c", "image": "../secret.png"}],
        "row 0, field 'image' is '../secret.png', expected a path relative to the shard's file, inside its folder",
    ),
    (
        "image_caption",
        {},
        [{"caption": None, "image": "x.png"}],
        "row 0, field 'caption' is missing (the row's columns: image); expected a string",
    ),
    (
        "text",
        {"text": "body"},
        [{"text": "t"}],
        "row 0, field 'text' (column 'body') is missing (the row's columns: text); expected a string",
    ),
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("kind,columns,bad_rows,refusal", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_a_malformed_row_is_refused_naming_shard_row_and_field_and_the_stored_shard_is_unchanged(
    tmp_path, fmt, kind, columns, bad_rows, refusal
):
    try:
        pa.Table.from_pylist(bad_rows) if fmt == "parquet" else json.dumps(bad_rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        pytest.skip(f"these rows cannot be written as {fmt} (one type a Parquet column; no bytes in JSON)")
    store = FolderStore(tmp_path / "store")
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "a good document"}])
    download(store, "bad/a", "text", {}, good)  # what is already materialized under the partition
    before = store.fetch("raw_shard", "bad/a").read_bytes()
    user = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"a.{fmt}", bad_rows)
    with pytest.raises(GhostvisError) as e:
        download(store, "bad/a", kind, columns, user)
    assert str(e.value).startswith(f"shard bad/a: {refusal}"), str(e.value)
    assert str(e.value).endswith("then re-materialize raw_shards partition bad/a")
    assert store.fetch("raw_shard", "bad/a").read_bytes() == before
    assert sorted(p.name for p in store.fetch("raw_shard", "bad/a").parent.iterdir()) == ["a.parquet"]


def test_a_line_that_is_not_json_and_an_image_that_is_not_there_are_refused_by_name(tmp_path):
    store = FolderStore(tmp_path / "store")
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"messages": CHATS[0]}) + "\n{not json\n")
    with pytest.raises(
        GhostvisError,
        match=r"^shard bad/a: line 2 is not a JSON object \(.*\); a shard is a Parquet file or JSON Lines",
    ):
        download(store, "bad/a", "chat", {}, path)
    write_jsonl(path, [{"caption": "c", "image": "img/missing.png"}])
    with pytest.raises(
        GhostvisError,
        match=r"^shard bad/a: row 0, field 'image' names 'img/missing.png', which cannot be read "
        r"\(file:///.*/img/missing.png does not exist\); fix the row",
    ):
        download(store, "bad/a", "image_caption", {}, path)
    assert not store.exists("raw_shard", "bad/a")


def test_a_listing_finds_json_lines_and_the_manifest_carries_the_mapping_and_reward_rule(tmp_path):
    write_jsonl(tmp_path / "probs" / "0.jsonl", [{"q": "one plus one", "answer": 2}])
    write_parquet(tmp_path / "probs" / "1.parquet", [{"q": "two plus two", "answer": "4"}])
    src = RemoteSource("probs", "problem", listing=(tmp_path / "probs").as_uri(), columns={"prompt": "q"})
    m = remote_manifest(src)
    assert [e.name for e in m.shards] == ["0", "1"] and m.columns == {"prompt": "q"} and m.reward == "integer"
    assert Manifest.from_dict(json.loads(m.to_json())) == m
    with pytest.raises(
        GhostvisError, match=r"^source probs: columns mapping 'question': 'q' does not map a field of a problem source"
    ):
        remote_manifest(RemoteSource("probs", "problem", listing=src.listing, columns={"question": "q"}))
    with pytest.raises(
        GhostvisError,
        match=r"^source probs: reward 'exact' is not a reward rule; use integer \(the default\), string or regex:",
    ):
        remote_manifest(RemoteSource("probs", "problem", listing=src.listing, reward="exact"))
    with pytest.raises(GhostvisError, match=r"^source probs: reward 'regex:\(' is not a valid regular expression"):
        remote_manifest(RemoteSource("probs", "problem", listing=src.listing, reward="regex:("))
    with pytest.raises(GhostvisError, match=r"^source web: reward 'string' is set on a text source"):
        remote_manifest(RemoteSource("web", "text", listing=src.listing, reward="string"))


def test_the_reward_rules_match_a_completions_answer():
    assert completion_answer("integer", "3 + 4 is 7, so 0007") == "7" and is_correct("integer", "so 0007", "7")
    assert not is_correct("integer", "no number here", "7") and not is_correct("integer", "7", "seven")
    assert is_correct("string", "thinking...\n  Paris \n", "Paris") and not is_correct(
        "string", "Paris, France", "Paris"
    )
    assert is_correct("regex:Answer: (\\S+)", "Answer: x\nAnswer: 42", "42")
    assert is_correct("regex:\\d+ apples", "I count 12 apples", "12 apples")
    assert not is_correct("regex:Answer: (\\S+)", "42", "42")


def test_the_readmes_source_of_each_kind_is_a_valid_declaration():
    """README "Every kind of data": its sources.yaml declares one source per kind that shard_manifest
    accepts (known fields, kinds, columns mappings and reward rules; nothing is downloaded)."""
    import re

    import yaml

    from ghostvis_core.data.catalog import check_declarations
    from ghostvis_core.data.normalize_shard import check_columns_mapping
    from ghostvis_core.data.problems import check_reward_rule

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "my_chats" in b]
    assert len(blocks) == 2  # "Every kind of data" and the walk of "Every stage on your own data"
    for block in blocks:
        remote = yaml.safe_load(block)["ops"]["shard_manifest"]["config"]["remote"]
        sources = [RemoteSource(**r) for r in remote]
        check_declarations([(s.name, s.kind) for s in sources])
        assert sorted(s.kind for s in sources) == ["chat", "image_caption", "preference", "problem"]
        for s in sources:
            check_columns_mapping(s.name, s.kind, s.columns)
            check_reward_rule(s.name, s.kind, s.reward)
        assert is_correct(next(s.reward for s in sources if s.kind == "problem"), "17 * 3 = 51", "51")


def test_raw_shards_in_dagster_reads_a_mapped_json_lines_source_and_refuses_a_bad_row_keeping_the_shard(tmp_path):
    """The pipeline's own path (shard_manifest's config with a columns mapping, raw_shards' check): the chats
    are stored as the chat kind's Parquet; the same file with a malformed row fails naming shard, row and
    field, and the stored shard and its record are as they were."""
    from tests.test_bad_inputs import files_of, first_error, run_manifest

    listing = tmp_path / "chats"
    write_jsonl(listing / "00000.jsonl", [{"conversations": c} for c in CHATS])
    source = {"name": "chats", "kind": "chat", "listing": listing.as_uri(), "columns": {"messages": "conversations"}}
    home = tmp_path / "home"
    assert run_manifest(home, [source], selection="raw_shards").success
    store = FolderStore(home / "store")
    stored = pq.read_table(store.fetch("raw_shard", "chats/00000"))
    assert stored.column_names == ["messages"] and stored.column("messages").to_pylist() == CHATS
    assert store.read_json("manifest", "chats")["columns"] == {"messages": "conversations"}
    before = files_of(home / "store" / "shards")
    write_jsonl(
        listing / "00000.jsonl", [{"conversations": c} for c in CHATS] + [{"conversations": [{"role": "user"}]}]
    )
    result = run_manifest(home, [source], selection="raw_shards")
    assert not result.success
    assert first_error(result).startswith(
        "shard chats/00000: row 3, field 'messages[0].content' (column 'conversations') is missing, expected a string"
    )
    assert files_of(home / "store" / "shards") == before
