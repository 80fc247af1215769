"""The decontamination gate (issue 24, item 6): 13-gram fingerprints of every tokenized document in the
ledger, every evaluation set reduced by the same rule, and the stage check `no_eval_contamination`.

Unit tests pin the normalization, hashing and winnowing with hand-computed values; the tokenization
tests run the real datatrove tokenization on small shards, one with a validation passage or a
multiple-choice item pasted into a training document, and call the check as the stage checks do.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.data.bpe_tokenizer import save_tokenizer, train_tokenizer
from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.ledger.records import ConsumptionRow, NgramRow, PartRow, RolloutRow
from ghostvis_core.data.ngrams import NGRAM, WINDOW, fingerprints, ngram_hash, ngram_hashes, normalize, winnow
from ghostvis_core.data.shard_ref import ShardRef
from ghostvis_core.data.short_items import MIN_WORDS, WholeItems, whole_phrase
from ghostvis_core.data.tokenize_shards import job_for_shard, tokenize_shards
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.config import ContaminationConfig
from ghostvis_core.plan.presets import resolve
from ghostvis_core.store import FolderStore
from ghostvis_core.store.files import sha256_file
from ghostvis_core.verify.audit.contamination import item_text, no_eval_contamination, shard_contamination
from ghostvis_core.verify.audit.stage_checks import stage_check_names
from tests.raw_shards import raw_shard_job, tokenize_here

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()


# ---- normalization, hashing, winnowing ---------------------------------------------------------


def test_normalize_lowercases_and_splits_on_everything_but_letters_and_digits():
    assert normalize("Hello, World! It's 3:45.") == ["hello", "world", "it", "s", "3", "45"]
    assert normalize("snake_case\tand\nNEW-lines") == ["snake", "case", "and", "new", "lines"]
    assert normalize("Über café") == ["über", "café"]
    assert normalize(" ... ") == []


def test_an_ngram_hash_is_blake2b_64_of_the_words_joined_by_spaces():
    digest = hashlib.blake2b(b"alpha bravo charlie", digest_size=8).digest()
    assert ngram_hash(["alpha", "bravo", "charlie"]) == int.from_bytes(digest, "little", signed=True)
    assert -(2**63) <= ngram_hash(WORDS[:NGRAM]) < 2**63


def test_a_text_has_one_13_gram_per_word_after_the_twelfth_and_punctuation_does_not_matter():
    assert NGRAM == 13
    assert ngram_hashes(" ".join(WORDS[:12])) == []  # 12 words: no 13-gram
    hashes = ngram_hashes(" ".join(WORDS))  # 14 words: 2
    assert hashes == [ngram_hash(WORDS[:13]), ngram_hash(WORDS[1:14])]
    shouted = ", ".join(w.upper() for w in WORDS) + "!!!"
    assert ngram_hashes(shouted) == hashes


def test_winnowing_keeps_the_minimum_of_every_window():
    # windows of 3 over [5, 3, 8, 1, 9, 2]: min(5,3,8)=3, min(3,8,1)=1, min(8,1,9)=1, min(1,9,2)=1
    assert winnow([5, 3, 8, 1, 9, 2], window=3) == {3, 1}
    assert winnow([4, 2], window=8) == {2}  # shorter than a window: its minimum
    assert winnow([]) == set()
    assert fingerprints("too short to hold a thirteen word n-gram") == set()


def test_two_texts_sharing_a_run_of_20_words_always_share_a_fingerprint():
    """The winnowing guarantee the sample is chosen for: NGRAM + WINDOW - 1 shared words suffice."""
    rng = random.Random(3)
    vocab = [f"w{i}" for i in range(500)]
    for _ in range(50):
        run = " ".join(rng.choices(vocab, k=NGRAM + WINDOW - 1))
        a = " ".join(rng.choices(vocab, k=rng.randint(0, 60))) + " " + run + " " + " ".join(rng.choices(vocab, k=30))
        b = " ".join(rng.choices(vocab, k=rng.randint(0, 60))) + " " + run
        assert fingerprints(a) & fingerprints(b)


def test_an_item_text_is_its_strings_and_the_right_choice():
    record = {"context": "The capital of France is", "choices": ["Dublin.", "Paris."], "answer": 1}
    assert item_text(record) == "The capital of France is\nParis."
    assert item_text({"question": "Why?", "target": "Because.", "id": 4}) == "Why?\nBecause."


def test_the_documents_of_every_version_of_a_validation_shard_are_evaluation_items(tmp_path):
    """A validation shard changed under its name: the documents of its earlier version stay evaluation items
    (a run evaluated on them is still checked against them), each version's row its own item."""
    from ghostvis_core.verify.audit.contamination import validation_items
    from tests.ledger_rows import shard_record

    ledger = Ledger(tmp_path / "ledger")
    for sha, at, hashes in (("sha-1", 1.0, [1, 2]), ("sha-2", 2.0, [3])):
        ledger.write_shard(shard_record("v/0", split="validation", sha=sha, created_at=at))
        ledger.write_ngrams("v/0", sha, [NgramRow("v/0", "prose", "validation", sha, 0, h) for h in hashes])
    assert sorted((i.item, sorted(i.fps)) for i in validation_items(ledger)) == [
        ("v/0 (earlier version sha-1) row 0", [1, 2]),
        ("v/0 row 0", [3]),
    ]


def test_the_gate_is_in_the_one_registry_of_stage_checks():
    assert stage_check_names()[-1] == "no_eval_contamination"


# ---- the real tokenization path, a planted contaminated document -----------------------------


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


VOCAB = [
    f"{a}{b}"
    for a in ("ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "vu", "ze")
    for b in ("bar", "cen", "dol", "fim", "gat", "hul", "jor", "kes", "lun", "mop", "nis", "pry")
]
SHORT_ITEM = "The capital of France is Paris."  # lm-eval capitals line 1, a benchmark item, the user set's line 1
MC_ITEM = {
    "question": "A farmer plants seven rows of beans with twelve plants in every row and then loses "
    "one full row to a storm. How many bean plants are left in the field?",
    "choices": ["Eighty four", "Seventy two", "Ninety six"],
    "answer": 1,
}


@pytest.fixture(scope="module")
def tokenized(module_tmp) -> SimpleNamespace:
    """A store with one source, tokenized for real: train shard corp/00000 (row 1 holds the
    validation document pasted mid-text, row 3 the multiple-choice item with its answer, row 4 a
    shipped capitals item of 6 words; rows 0 and 2 are clean), a clean train shard corp/00001 and a
    validation shard corp/val."""
    root = module_tmp("contamination")
    store, rng = FolderStore(root / "store"), random.Random(11)
    val_docs = [words(rng, 50), words(rng, 70)]
    mc_text = f"Question: {MC_ITEM['question']} Answer: {MC_ITEM['choices'][MC_ITEM['answer']]}"
    texts = {
        "corp/00000": [
            words(rng, 60),
            f"{words(rng, 30)}\n{val_docs[0]}\n{words(rng, 30)}",
            words(rng, 80),
            f"{words(rng, 25)} {mc_text} {words(rng, 25)}",
            f"{words(rng, 20)} {SHORT_ITEM} {words(rng, 20)}",
        ],
        "corp/00001": [words(rng, 60) for _ in range(4)],
        "corp/val": val_docs,
    }
    tok = train_tokenizer([t for docs in texts.values() for t in docs], 512)
    save_tokenizer(tok, store)
    jobs = [
        raw_shard_job(store, shard_id, pa.table({"text": docs}), "validation" if shard_id.endswith("val") else "train")
        for shard_id, docs in texts.items()
    ]
    tokenize_here(jobs, store, tok.tokenizer_id, root / "logs")
    eval_set = root / "my_evals" / "mc.jsonl"
    eval_set.parent.mkdir()
    eval_set.write_text(
        json.dumps({"context": "The capital of France is", "choices": ["Paris."], "answer": 0})
        + "\n"
        + json.dumps(MC_ITEM)
        + "\n"
    )
    return SimpleNamespace(
        store=store,
        ledger=Ledger.in_store(store),
        tok=tok,
        texts=texts,
        jobs={j.shard_id: j for j in jobs},
        eval_folder=root / "my_evals",
    )


def spec_of(t: SimpleNamespace, **contamination) -> SimpleNamespace:
    """The launch-spec fields the check reads."""
    refs = tuple(
        ShardRef(s, "corp", "train", "", 0, 0, j.content_sha256) for s, j in t.jobs.items() if j.split == "train"
    )
    return SimpleNamespace(
        tokenizer_id=t.tok.tokenizer_id,
        train_shards={"corp": refs},
        val_shards={},
        config=SimpleNamespace(contamination=ContaminationConfig(**contamination)),
    )


def consumed(shard_id: str, row_start: int, row_end: int) -> ConsumptionRow:
    return ConsumptionRow("p1", "r", "pretrain", 0, "corp", shard_id, "train", 0, 0, 0, row_start, row_end)


def test_tokenization_records_each_documents_winnowed_13_grams(tokenized):
    t = tokenized
    sha = t.jobs["corp/00000"].content_sha256
    written = pq.read_table(t.ledger.ngram_record_path("corp/00000", sha)).select(["shard_id", "source", "split"])
    assert set(zip(*written.to_pydict().values())) == {("corp/00000", "corp", "train")}
    docs = t.ledger.document_fingerprints([sha])
    by_row = {d.row: set(d.ngram_hashes) for d in docs}
    assert by_row == {i: fingerprints(text) for i, text in enumerate(t.texts["corp/00000"])}
    n_grams = len(ngram_hashes(t.texts["corp/00000"][2]))  # 80 words: 68 13-grams, about 2/9 of them kept
    assert n_grams == 68 and 68 // 9 <= len(by_row[2]) <= 68 // 2
    assert Path(t.ledger.ngram_record_path("corp/val", t.jobs["corp/val"].content_sha256)).is_file()


def test_a_pasted_validation_document_and_mc_item_fail_the_gate_naming_shard_row_and_item(tokenized):
    t = tokenized
    out = no_eval_contamination(
        t.store, t.ledger, spec_of(t, eval_sets=[str(t.eval_folder)]), [consumed("corp/00000", 0, 4)], []
    )
    assert not out.passed
    assert out.figures["contaminated_documents"] == 2 and out.figures["consumed_documents_fingerprinted"] == 4
    named = {(row[0], row[1], row[2], row[3]) for row in out.tables["shared_ngrams"][1] if row[-1] == "contaminated"}
    assert named == {("corp/00000", 1, "validation", "corp/val row 0"), ("corp/00000", 3, "user:mc.jsonl", "line 2")}
    assert any("training shard corp/00000 row 1 " in f and "validation corp/val row 0" in f for f in out.failures)
    assert any("training shard corp/00000 row 3 " in f and "user:mc.jsonl line 2" in f for f in out.failures)
    assert out.failures[-1] == (  # what was found, whether templated data explains it, and the setting
        "1 contaminated pair(s) are source corp's training documents against its own validation split (overlap up "
        "to 1.00): expected when corp's documents are generated from templates (train and validation rows share "
        "the template's words, not their content); if so, declare it for this stage with --set "
        "contamination.max_overlap=1 (the run config's contamination.max_overlap, which applies to every "
        "evaluation set), else its validation split holds copies of training documents: deduplicate the source "
        "or pin other validation shards"
    )
    val_fps = len(fingerprints(t.texts["corp/val"][0]))
    row = next(r for r in out.tables["shared_ngrams"][1] if r[1] == 1)
    assert row[4:7] == [val_fps, len(fingerprints(t.texts["corp/00000"][1])), val_fps] and row[7] == 1.0
    sets = {r[0]: r[1:] for r in out.tables["eval_sets"][1]}
    assert sets["validation"][:3] == [2, 2, 0] and sets["user:mc.jsonl"][:3] == [2, 2, 1]  # the capital item: whole


def test_clean_rows_and_a_clean_shard_pass(tokenized):
    t = tokenized
    spec = spec_of(t, eval_sets=[str(t.eval_folder)])
    for rows in ([consumed("corp/00001", 0, 4)], [consumed("corp/00000", 0, 1), consumed("corp/00000", 2, 3)]):
        out = no_eval_contamination(t.store, t.ledger, spec, rows, [])
        assert out.passed, out.failures
        assert out.figures["contaminated_documents"] == 0 and out.figures["documents_sharing_ngrams"] == 0


def test_the_threshold_is_declared_in_the_stage_config(tokenized):
    assert resolve("pretrain", "smoke").contamination.max_overlap == 0.5  # the default: ContaminationConfig
    assert resolve("sft", "smoke", {"contamination.max_overlap": "0.2"}).contamination.max_overlap == 0.2
    with pytest.raises(GhostvisError, match="contamination.max_overlap must be a share between 0 and 1"):
        resolve("sft", "smoke", {"contamination.max_overlap": "2"})
    t = tokenized
    out = no_eval_contamination(t.store, t.ledger, spec_of(t, max_overlap=1.0), [consumed("corp/00000", 0, 4)], [])
    assert out.passed and out.figures["max_overlap"] == 1.0 and out.figures["max_overlap_found"] == 1.0
    default = no_eval_contamination(t.store, t.ledger, spec_of(t), [consumed("corp/00000", 0, 4)], [])
    assert default.figures["max_overlap"] == 0.5 and default.figures["contaminated_documents"] == 1  # no user set


def test_ghostvis_ledger_shows_contamination_per_train_shard(tokenized):
    t = tokenized
    per_shard = shard_contamination(t.ledger, t.ledger.shards(), [str(t.eval_folder)])
    assert set(per_shard) == {"corp/00000", "corp/00001"}
    assert per_shard["corp/00000"]["docs_sharing"] == 2 and per_shard["corp/00000"]["docs_contaminated"] == 2
    assert per_shard["corp/00000"]["shared_ngrams"] >= len(fingerprints(t.texts["corp/val"][0]))
    assert per_shard["corp/00001"] == {"shared_ngrams": 0, "docs_sharing": 0, "docs_contaminated": 0}


def test_a_shard_tokenized_before_the_gate_fails_with_the_fix(tokenized, tmp_path):
    t = tokenized
    ledger = Ledger(tmp_path / "ledger")
    shutil.copytree(t.ledger.root, ledger.root)
    ledger.ngram_record_path("corp/00001", t.jobs["corp/00001"].content_sha256).unlink()
    out = no_eval_contamination(t.store, ledger, spec_of(t), [consumed("corp/00001", 0, 4)], [])
    assert not out.passed and out.figures["shards_without_ngrams"] == 1
    assert out.failures == [
        "training shard corp/00001 was consumed but has no n-gram record in the ledger (tokenized "
        "before the decontamination gate); re-materialize tokenized_shards partition corp/00001"
    ]


def test_a_registered_eval_set_that_does_not_exist_is_an_error(tokenized, tmp_path):
    with pytest.raises(GhostvisError, match="contamination.eval_sets"):
        no_eval_contamination(
            tokenized.store, tokenized.ledger, spec_of(tokenized, eval_sets=[str(tmp_path / "nope.jsonl")]), [], []
        )


def test_a_pasted_short_shipped_item_fails_the_gate_naming_item_and_document(tokenized):
    """6 words, no 13-gram: the fingerprints cannot see it; matched whole it is named in every set holding it."""
    t = tokenized
    out = no_eval_contamination(
        t.store, t.ledger, spec_of(t, eval_sets=[str(t.eval_folder)]), [consumed("corp/00000", 4, 5)], []
    )
    assert not out.passed and out.figures["documents_sharing_ngrams"] == 0
    named = {(r[0], r[1], r[2], r[3], r[8]) for r in out.tables["shared_ngrams"][1] if r[-1] == "contaminated"}
    whole = "whole: the capital of france is paris"
    assert named == {
        ("corp/00000", 4, "lm_eval:capitals.jsonl", "line 1", whole),
        ("corp/00000", 4, "benchmark:capitals", f"item {capitals_item('France')}", whole),
        ("corp/00000", 4, "user:mc.jsonl", "line 1", whole),
        ("corp/00000", 4, "prompts", "The capital of France is", "whole: the capital of france is"),
    }
    assert (
        'training shard corp/00000 row 4 holds lm_eval:capitals.jsonl line 1 whole ("the capital of france is '
        'paris", 6 words, too short for 13-gram fingerprints, matched as a whole)'
    ) in out.failures
    assert out.figures["documents_holding_short_items"] == out.figures["contaminated_documents"] == 1
    sets = {r[0]: r[1:] for r in out.tables["eval_sets"][1]}
    assert sets["prompts"][:3] == [4, 2, 2]  # "def fibonacci(n):" (3 words) and "3 + 4 =" (2) are too short


def capitals_item(country: str) -> int:
    """The benchmark's item number of a country's capitals item (arithmetic items come first)."""
    from ghostvis_core.data.eval_texts import BENCHMARK_PER_TASK, BENCHMARK_SEED, template_choices

    choices = template_choices(random.Random(BENCHMARK_SEED), BENCHMARK_PER_TASK)
    return next(n for n, c in enumerate(choices, start=1) if c[1] == f"The capital of {country} is")


def test_user_sets_in_parquet_are_checked_and_a_set_of_only_too_short_items_fails_by_name(tokenized, tmp_path):
    t = tokenized
    pq.write_table(pa.table({"question": [MC_ITEM["question"], "Name it."]}), tmp_path / "qa.parquet")
    (tmp_path / "tiny.jsonl").write_text(json.dumps({"q": "3 + 4 ="}) + "\n" + json.dumps({"q": "def f(n):"}) + "\n")
    out = no_eval_contamination(
        t.store, t.ledger, spec_of(t, eval_sets=[str(tmp_path)]), [consumed("corp/00000", 3, 4)], []
    )
    assert ("corp/00000", 3, "user:qa.parquet", "row 0") in {tuple(r[:4]) for r in out.tables["shared_ngrams"][1]}
    sets = {r[0]: r[1:] for r in out.tables["eval_sets"][1]}
    assert sets["user:qa.parquet"][:3] == [2, 1, 0] and sets["user:tiny.jsonl"][:3] == [2, 0, 0]
    assert out.failures[-1] == (
        "evaluation set user:tiny.jsonl has 2 items and none can be checked (each is shorter than 4 words once "
        "normalized: no fingerprint, too short to match whole); give it longer items or remove it from "
        "contamination.eval_sets"
    )
    assert not any("user:qa.parquet" in f and "none can be checked" in f for f in out.failures)


def test_an_rl_completion_reproducing_a_long_item_fails_the_gate_and_one_writing_a_short_item_is_listed(
    tokenized, tmp_path
):
    """An rl run trains on what it generates: its saved completions are decoded and checked too. A completion
    that reproduces a 50-word validation document fails, named by step, rank and global row; one that writes
    a 6-word item whole (a right answer) is counted and listed, not failed."""
    t = tokenized
    ledger = Ledger(tmp_path / "ledger")
    shutil.copytree(t.ledger.root, ledger.root)
    part = PartRow("p1", "", "rl-test", "", "rl", 0, 1, 2, 0, 0)
    texts = ["So the answer is 12.", f"Well: {SHORT_ITEM}", t.texts["corp/val"][0]]
    rollout = RolloutRow(
        "p1",
        "rl-test",
        1,
        2,
        0,
        0,
        3,
        1,
        rows=[6, 7, 8],
        completion_ids=[t.tok.encode(x) for x in texts],
        rewards=[0.0, 1.0, 0.0],
    )
    ledger.write_part(part, [], rollouts=[rollout])
    out = no_eval_contamination(t.store, ledger, spec_of(t), [consumed("corp/00001", 0, 4)], [part])
    assert out.figures["rl_completions_checked"] == 3 and out.figures["rl_completions_writing_short_items"] == 1
    assert out.figures["consumed_documents_fingerprinted"] == 4 and out.figures["contaminated_documents"] == 1
    assert not out.passed and out.failures == [
        "rl completion, step 2 rank 1, global row 8 shares 6 13-gram fingerprints with validation corp/val row 0 "
        "(document 6, item 6): overlap 1.00 > contamination.max_overlap 0.5"
    ]
    verdicts = {(r[0], r[1], r[2], r[3], r[-1]) for r in out.tables["shared_ngrams"][1]}
    assert verdicts == {
        ("rl completion, step 2 rank 1", 8, "validation", "corp/val row 0", "contaminated"),
        *(
            ("rl completion, step 2 rank 1", 7, s, item, "written by the policy (an answer, not eval text)")
            for s, item in [
                ("lm_eval:capitals.jsonl", "line 1"),
                ("benchmark:capitals", "item 51"),
                ("prompts", "The capital of France is"),
            ]
        ),
    }


def test_a_short_item_is_matched_whole_on_word_boundaries_punctuation_aside():
    assert whole_phrase("The capital of France is Paris.") == "the capital of france is paris"
    assert whole_phrase("3 + 4 =") is None and whole_phrase(" ".join(WORDS)) is None  # 2 words; 14 words
    assert MIN_WORDS == 4 and whole_phrase("a b c d") == "a b c d" and whole_phrase(" ".join(WORDS[:12]))
    index = WholeItems(["the capital of france is paris", "step 1 40 24 64"])
    assert index.found_in("Q: ... THE CAPITAL OF FRANCE IS: PARIS!\nStep 1: 40 + 24 = 64.") == {
        "the capital of france is paris",
        "step 1 40 24 64",
    }
    assert index.found_in("the capital of france is parisian; step 1: 40 + 24 = 641") == set()
    assert index.found_in("paris is the capital of france") == set() and not WholeItems([])


# ---- a real stage run on the demo data, then one with a validation document and a short item pasted in


def fingerprint_every_shard(home: Path, shard_ids: list[str] | None = None) -> None:
    """Tokenize a home's shards again (all, or `shard_ids`): the shared demo home may predate the ngrams table."""
    from ghostvis_core.data.catalog import registered_manifests
    from ghostvis_core.home import Home

    store = Home(home).store
    tokenizer_id = Ledger.in_store(store).shards()[0].tokenizer_id
    jobs = [job_for_shard(store, m, m.shard_id(e)) for m in registered_manifests(store).values() for e in m.shards]
    jobs = [j for j in jobs if shard_ids is None or j.shard_id in shard_ids]
    tokenize_shards(jobs, store=store, tokenizer_id=tokenizer_id, logging_dir=home / "logs" / "fingerprints")


def first_consumed_row(home: Path, run_key: str) -> tuple[str, int]:
    """(shard, row) of the run's first consumed text document."""
    from ghostvis_core.home import Home

    ledger = Ledger.in_store(Home(home).store)
    rows = ledger.consumption(ledger.chain(run_key))
    first = min(rows, key=lambda r: (r.shard_id, r.row_start))
    return first.shard_id, first.row_start


def paste_into(home: Path, shard_id: str, row: int, passage: str) -> None:
    """Rewrite a raw train shard with `passage` appended to one document, recorded as raw_shards would."""
    from ghostvis_core.data.catalog import manifest_of_shard, record_raw_shard
    from ghostvis_core.home import Home

    store = Home(home).store
    path = store.fetch("raw_shard", shard_id)  # a folder store's own file, rewritten below
    table = pq.read_table(path)
    texts = table.column("text").to_pylist()
    texts[row] = f"{texts[row]}\n\n{passage}"
    pq.write_table(table.set_column(table.schema.get_field_index("text"), "text", pa.array(texts)), path)
    record_raw_shard(store, manifest_of_shard(store, shard_id), shard_id, sha256_file(path), path.stat().st_size)


def validation_document(home: Path, source: str, min_words: int = 40, max_words: int = 300) -> tuple[int, str]:
    """(row, text) of the first validation document of `source` of a size the gate must catch whole."""
    from ghostvis_core.home import Home

    texts = pq.read_table(Home(home).store.fetch("raw_shard", f"{source}/val_00000"), columns=["text"]).column(0)
    return next((i, t) for i, t in enumerate(texts.to_pylist()) if min_words <= len(normalize(t)) <= max_words)


@pytest.mark.e2e
def test_a_smoke_pretrain_passes_the_gate_and_fails_it_once_eval_text_is_pasted_in(demo_home, tmp_path):
    """A validation document and a short shipped item pasted into one consumed document: both named."""
    from tests.conftest import copy_home
    from tests.test_audit import checks_of, clean_run

    home = copy_home(demo_home, tmp_path / "home")
    fingerprint_every_shard(home)
    clean = clean_run(home, 41)
    gate = checks_of(home, clean)["no_eval_contamination"]
    assert gate["passed"], gate["failures"]
    assert gate["figures"]["consumed_documents_fingerprinted"] > 0 and gate["figures"]["contaminated_documents"] == 0

    shard_id, row = first_consumed_row(home, clean)
    val_row, passage = validation_document(home, shard_id.split("/")[0])
    paste_into(home, shard_id, row, f"{passage}\n\n{SHORT_ITEM}")
    fingerprint_every_shard(home, [shard_id])
    planted = clean_run(home, 41)  # same config, new shard content: a new run key
    gate = checks_of(home, planted)["no_eval_contamination"]
    assert planted != clean and not gate["passed"]
    item = f"{shard_id.split('/')[0]}/val_00000 row {val_row}"
    assert any(
        f.startswith(f"training shard {shard_id} row {row} ") and f"validation {item} " in f for f in gate["failures"]
    ), gate["failures"]
    assert [shard_id, row, "validation", item] in [r[:4] for r in gate["tables"]["shared_ngrams"]["rows"]]
    assert f"training shard {shard_id} row {row} holds lm_eval:capitals.jsonl line 1 whole " in "\n".join(
        gate["failures"]
    )
