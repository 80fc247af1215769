"""The embedded demo task data: deterministic shards in the real formats, with answers that check out."""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
from collections import Counter
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ghostvis_core.data.decontaminate import drop_shared, held_out
from ghostvis_core.data.eval_texts import shipped_texts
from ghostvis_core.data.ngrams import fingerprints, record_text
from ghostvis_core.data.problems import is_correct
from ghostvis_core.data.short_items import WholeItems, whole_phrase
from ghostvis_core.demo.tasks import (
    COLORS,
    NUMBER_WORDS,
    POSITION_PHRASES,
    REWARD_RULES,
    SPLIT_SIZES,
    TASK_SOURCES,
    build_task_source,
    render_shape_image,
)
from ghostvis_core.errors import GhostvisError
from tests.conftest import built_timed

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
EXPECTED_SCHEMAS = {
    "demo_reasoning": {
        "text": pa.string(),
        "question": pa.string(),
        "solution": pa.string(),
        "answer": pa.string(),
        "id": pa.string(),
    },
    "demo_problems": {"prompt": pa.string(), "answer": pa.string(), "id": pa.string()},
    "demo_chat": {"messages": MESSAGES, "image": pa.binary(), "id": pa.string()},
    "demo_prefs": {"prompt": pa.string(), "chosen": pa.string(), "rejected": pa.string(), "id": pa.string()},
    "demo_images": {
        "image": pa.binary(),
        "caption": pa.string(),
        "shape": pa.string(),
        "color": pa.string(),
        "count": pa.int64(),
        "position": pa.string(),
        "id": pa.string(),
    },
}
# Generated training rows dropped for sharing a 13-gram fingerprint with a validation row of any task
# source (23, 64, 340), then for holding a short shipped evaluation item whole (108, 545, 135: the
# arithmetic and capitals items and the capital prompt). demo_prefs: all 308 pairs whose rejected
# reply ends in the 24-word "I hope this helps! ..." tail (21 validation pairs have it too) and 32
# that repeat a validation pair's or chat's Q&A; demo_chat: 14 of its 64 repeat a validation
# preference pair's; demo_images: captions are too short to have a fingerprint and hold no item. demo_problems
# (question and answer, no worked steps): 4 share a fingerprint with a validation row; none holds a shipped item whole.
DECONTAMINATED = {"demo_reasoning": 131, "demo_problems": 4, "demo_chat": 609, "demo_prefs": 475, "demo_images": 0}
SHARD_NAMES = ["00000.parquet", "00001.parquet", "00002.parquet", "00003.parquet", "val_00000.parquet"]
STEP = re.compile(r"^Step (\d+): (\d+) ([-+*]) (\d+) = (\d+)\.$")
ARITH_REPLY = re.compile(r"^(\d+) ([-+*]) (\d+) = (\d+)\.$")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@pytest.fixture(scope="module")
def built(module_tmp):
    """Every source built once, with its build time."""
    return built_timed(build_task_source, TASK_SOURCES, module_tmp("tasks"))


def _rows(built, source, split=None):
    shards, _ = built[source]
    return [row for path, s in shards if split in (None, s) for row in pq.read_table(path).to_pylist()]


def _pixels(png: bytes) -> np.ndarray:
    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG" and img.mode == "RGB" and img.size == (32, 32)
    return np.asarray(img)


def _coloured(px: np.ndarray) -> np.ndarray:
    return np.any(px != 255, axis=-1)


def _dominant_colour(px: np.ndarray) -> tuple[str, float]:
    """Name of the palette colour nearest to the most common non-white pixel, and its share."""
    values = [tuple(int(v) for v in p) for p in px[_coloured(px)]]
    rgb, n = Counter(values).most_common(1)[0]
    name = min(COLORS, key=lambda c: sum((a - b) ** 2 for a, b in zip(COLORS[c], rgb)))
    return name, n / len(values)


def _components(mask: np.ndarray) -> int:
    """4-connected components of True pixels."""
    seen = np.zeros_like(mask)
    n = 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        n += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < 32 and 0 <= nx < 32 and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return n


# --- all sources ------------------------------------------------------------------------------


def test_build_is_fast(built):
    assert sum(seconds for _, seconds in built.values()) < 20


def test_rebuild_is_byte_identical(built, tmp_path):
    for source in TASK_SOURCES:
        first, _ = built[source]
        second = build_task_source(source, tmp_path / source)
        assert [(p.name, s) for p, s in first] == [(p.name, s) for p, s in second]
        for (a, _), (b, _) in zip(first, second):
            assert a.read_bytes() == b.read_bytes(), f"{source}/{a.name} differs between two builds"


def test_unknown_source_names_the_valid_ones(tmp_path):
    with pytest.raises(GhostvisError) as err:
        build_task_source("demo_nope", tmp_path)
    assert "demo_nope" in str(err.value)
    assert all(source in str(err.value) for source in TASK_SOURCES)
    assert not (tmp_path / "00000.parquet").exists()


@pytest.mark.parametrize("source", list(TASK_SOURCES))
def test_shards_splits_and_counts(built, source):
    shards, _ = built[source]
    assert [p.name for p, _ in shards] == SHARD_NAMES
    assert [s for _, s in shards] == ["train"] * 4 + ["validation"]
    assert sorted(p.name for p in shards[0][0].parent.iterdir()) == SHARD_NAMES  # no temp files left
    assert all(pq.read_metadata(p).num_rows > 0 for p, _ in shards)
    assert all(pq.ParquetFile(p).metadata.row_group(0).column(0).compression == "ZSTD" for p, _ in shards)
    n_train, n_val = SPLIT_SIZES[source]
    assert len(_rows(built, source, "train")) == n_train - DECONTAMINATED[source]
    assert len(_rows(built, source, "validation")) == n_val
    assert n_train >= 3000 and n_val >= 200


@pytest.mark.parametrize("source", list(TASK_SOURCES))
def test_schema(built, source):
    for path, _ in built[source][0]:
        schema = pq.read_schema(path)
        assert {f.name: f.type for f in schema} == EXPECTED_SCHEMAS[source], path


@pytest.mark.parametrize("source", list(TASK_SOURCES))
def test_ids_are_unique_content_hashes(built, source):
    rows = _rows(built, source)
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(rf"{source}:[0-9a-f]{{16}}", i) for i in ids)
    if source == "demo_reasoning":
        assert all(r["id"] == f"{source}:" + hashlib.sha1(r["text"].encode()).hexdigest()[:16] for r in rows)


def _content(source, row):
    if source == "demo_reasoning":
        return row["text"]
    if source == "demo_problems":
        return row["prompt"], row["answer"]
    if source == "demo_chat":
        return json.dumps(row["messages"]), row["image"]
    if source == "demo_prefs":
        return row["prompt"], row["chosen"], row["rejected"]
    return row["image"]


@pytest.mark.parametrize("source", list(TASK_SOURCES))
def test_rows_unique_and_validation_not_in_train(built, source):
    train = [_content(source, r) for r in _rows(built, source, "train")]
    val = [_content(source, r) for r in _rows(built, source, "validation")]
    assert len(set(train)) == len(train) and len(set(val)) == len(val)
    assert not set(train) & set(val)


def test_a_training_row_holding_20_words_of_a_validation_row_is_dropped():
    val = " ".join(f"v{i}" for i in range(40))
    passage = " ".join(f"v{i}" for i in range(10, 30))  # 20 words: a shared fingerprint is guaranteed
    near = " ".join(f"v{i}" for i in range(10, 22))  # 12 words: no 13-gram in common
    train = [
        {"text": f"Tom has 3 apples. {passage}. Answer: 3"},
        {"text": f"Ann has 2 pears. {near} and more words here."},
    ]
    held = held_out([val])
    assert drop_shared(train, partial(record_text, "text"), held) == [train[1]]


def test_a_training_row_holding_a_short_shipped_item_whole_is_dropped():
    """The gate's whole-item rule at build time: the capitals and arithmetic items have no 13-gram."""
    train = [
        {"text": "Q: Which city? The capital of France is Paris. Well done."},
        {"text": "Tom has 40 apples.\nStep 1: 40 + 24 = 64.\nAnswer: 64"},
        {"text": "Paris is the capital of France, and 40 + 24 = 64 at step 1."},
    ]
    assert drop_shared(train, partial(record_text, "text"), held_out([])) == [train[2]]


@pytest.mark.parametrize("source", list(TASK_SOURCES))
def test_train_holds_no_short_shipped_item_whole(built, source):
    index = WholeItems(p for p in map(whole_phrase, shipped_texts()) if p)
    kind = TASK_SOURCES[source]
    assert [r for r in _rows(built, source, "train") if index.found_in(record_text(kind, r))] == []


@pytest.mark.parametrize("source", list(TASK_SOURCES))
def test_train_shares_no_fingerprint_with_validation_or_shipped_items(built, source):
    """From the built shards, the way tokenization fingerprints them: the held-out side is every task
    source's validation rows (the gate compares across kinds) and the shipped evaluation items."""
    held = set().union(
        *(fingerprints(record_text(k, r)) for s, k in TASK_SOURCES.items() for r in _rows(built, s, "validation")),
        *(fingerprints(t) for t in shipped_texts()),
    )
    kind = TASK_SOURCES[source]
    train = [fingerprints(record_text(kind, r)) for r in _rows(built, source, "train")]
    assert sum(1 for fps in train if fps & held) == 0
    if kind != "image_caption":  # captions are too short for a 13-gram, so the check would be empty
        assert sum(1 for fps in train if fps) > len(train) / 2 and held


# --- demo_problems ----------------------------------------------------------------------------


def test_demo_problems_are_the_reasoning_problems_as_prompt_and_answer_in_the_same_split(built):
    """The rl stage's problems: demo_reasoning's questions and answers, split the same way, and the demo's
    reward rule finds each answer in its worked solution (the form the policy is taught to answer in)."""
    pairs = {
        split: [
            {(r["question"], r["answer"]) for r in _rows(built, "demo_reasoning", split)},
            {(r["prompt"], r["answer"]) for r in _rows(built, "demo_problems", split)},
        ]
        for split in ("train", "validation")
    }
    assert pairs["validation"][0] == pairs["validation"][1]
    assert len(pairs["train"][0] - pairs["train"][1]) <= DECONTAMINATED["demo_problems"]
    assert not pairs["train"][1] & pairs["validation"][1]
    rule = REWARD_RULES["demo_problems"]
    rows = _rows(built, "demo_reasoning")
    assert all(is_correct(rule, r["text"].split("\n", 1)[1], r["answer"]) for r in rows)
    assert not any(is_correct(rule, r["solution"], r["answer"]) for r in rows)  # no `Answer:` line, no answer


# --- demo_reasoning ---------------------------------------------------------------------------


def test_reasoning_steps_check_out(built):
    rows = _rows(built, "demo_reasoning")
    n_steps = Counter()
    for r in rows:
        assert r["text"] == f"{r['question']}\n{r['solution']}\nAnswer: {r['answer']}"
        lines = r["solution"].split("\n")
        n_steps[len(lines)] += 1
        assert 1 <= len(lines) <= 3, r["text"]
        previous = None
        for k, line in enumerate(lines, 1):
            m = STEP.match(line)
            assert m, f"unparseable step {line!r} in {r['text']!r}"
            i, a, op, b, c = int(m[1]), int(m[2]), m[3], int(m[4]), int(m[5])
            assert i == k
            assert OPS[op](a, b) == c, line
            assert a < 100 and b < 100  # 1-2 digit operands
            if previous is not None:
                assert previous in (a, b), f"step {k} does not use the previous result: {r['text']!r}"
            previous = c
        assert r["answer"] == str(previous)
        assert r["answer"] in r["text"].splitlines()[-1]
    assert set(n_steps) == {1, 2, 3}  # all three depths occur


def test_reasoning_validation_questions_are_held_out(built):
    train = {r["question"] for r in _rows(built, "demo_reasoning", "train")}
    val = [r["question"] for r in _rows(built, "demo_reasoning", "validation")]
    assert not train & set(val)
    assert len({q.split()[0] for q in train}) > 20  # names and templates vary


# --- demo_chat --------------------------------------------------------------------------------


def test_chat_roles_alternate_and_replies_are_short(built):
    for r in _rows(built, "demo_chat"):
        roles = [m["role"] for m in r["messages"]]
        if roles[0] == "system":
            roles = roles[1:]
        assert len(roles) in (2, 4, 6), roles
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        for m in r["messages"]:
            assert m["content"].strip()
            if m["role"] == "assistant":
                assert len(m["content"].split()) <= 25, m["content"]
                assert "<|" not in m["content"]
                assert not re.search(r"(^|\n)\s*(User|Assistant|System)\s*:", m["content"]), m["content"]
            m_arith = ARITH_REPLY.match(m["content"])
            if m["role"] == "assistant" and m_arith:
                a, op, b, c = int(m_arith[1]), m_arith[2], int(m_arith[3]), int(m_arith[4])
                assert OPS[op](a, b) == c


def test_chat_images_and_placeholders(built):
    rows = _rows(built, "demo_chat")
    image_rows = [r for r in rows if r["image"] is not None]
    assert 0.15 <= len(image_rows) / len(rows) <= 0.25
    for r in rows:
        texts = [m["content"] for m in r["messages"]]
        if r["image"] is None:
            assert all("<|image|>" not in text for text in texts)
            continue
        first_user = next(i for i, m in enumerate(r["messages"]) if m["role"] == "user")
        users = [texts[first_user]]
        assert users[0].count("<|image|>") == 1 and users[0].startswith("<|image|>")
        assert sum(text.count("<|image|>") for text in texts) == 1  # only in the first user message
        assert users[0].replace("<|image|>", "").strip()  # a question follows the placeholder
        px = _pixels(r["image"])
        colour, share = _dominant_colour(px)
        assert share > 0.9
        n_objects = _components(_coloured(px))
        for m in r["messages"]:
            if m["role"] != "assistant":
                continue
            said_colours = [c for c in COLORS if re.search(rf"\b{c}\b", m["content"])]
            assert said_colours in ([], [colour]), (m["content"], colour)
            said_counts = [n for n, w in NUMBER_WORDS.items() if re.search(rf"\b{w}\b", m["content"], re.I)]
            assert said_counts in ([], [n_objects]), (m["content"], n_objects)


def test_chat_validation_images_and_questions_mix(built):
    val = _rows(built, "demo_chat", "validation")
    assert any(r["image"] is not None for r in val) and any(r["image"] is None for r in val)
    assert any(r["messages"][0]["role"] == "system" for r in val)
    assert any(len(r["messages"]) >= 4 for r in val)


# --- demo_prefs -------------------------------------------------------------------------------


def test_prefs_pairs(built):
    rows = _rows(built, "demo_prefs")
    prompts = [r["prompt"] for r in rows]
    assert len(set(prompts)) == len(prompts)  # a validation prompt is never a training prompt
    run_on = 0
    for r in rows:
        assert r["prompt"] and r["chosen"] and r["rejected"]
        assert r["chosen"] != r["rejected"]
        assert "User:" not in r["chosen"] and "<|" not in r["chosen"]
        assert len(r["chosen"].split()) <= 25
        m = ARITH_REPLY.match(r["chosen"])
        if m:
            assert OPS[m[2]](int(m[1]), int(m[3])) == int(m[4])
            bad = ARITH_REPLY.match(r["rejected"])
            if bad:
                assert OPS[bad[2]](int(bad[1]), int(bad[3])) != int(bad[4])
        run_on += "\nUser:" in r["rejected"]
    assert 0.05 < run_on / len(rows) < 0.5


# --- demo_images ------------------------------------------------------------------------------


def test_image_rows(built):
    for r in _rows(built, "demo_images"):
        px = _pixels(r["image"])
        noun = r["shape"] if r["count"] == 1 else r["shape"] + "s"
        assert r["caption"] == f"{NUMBER_WORDS[r['count']]} {r['color']} {noun} {POSITION_PHRASES[r['position']]}."
        colour, share = _dominant_colour(px)
        assert colour == r["color"] and share > 0.9, (r["caption"], colour, share)
        assert np.all(px[_coloured(px)] == COLORS[r["color"]])  # no anti-aliasing: one exact colour
        mask = _coloured(px)
        assert mask.sum() >= 30 * r["count"]  # big enough to see
        assert _components(mask) == r["count"], r["caption"]
        ys, xs = np.nonzero(mask)
        cx, cy = xs.mean(), ys.mean()
        position = r["position"]
        if position == "left":
            assert cx < 12 and xs.max() < 16
        elif position == "right":
            assert cx > 19 and xs.min() >= 16
        elif position == "top":
            assert cy < 12 and ys.max() < 16
        elif position == "bottom":
            assert cy > 19 and ys.min() >= 16
        else:
            assert abs(cx - 15.5) < 4.5 and abs(cy - 15.5) < 4.5


def test_image_validation_combinations_seen_in_training(built):
    attrs = lambda r: (r["shape"], r["color"], r["count"], r["position"])  # noqa: E731
    train = _rows(built, "demo_images", "train")
    val = _rows(built, "demo_images", "validation")
    train_combos = Counter(attrs(r) for r in train)
    assert len(train_combos) == 3 * 6 * 3 * 5  # every combination is trained on
    assert all(train_combos[attrs(r)] >= 5 for r in val)
    assert len({attrs(r) for r in val}) == len(val)  # many different combinations held out


def test_render_shape_image_is_seeded_and_checks_its_input():
    a = render_shape_image("square", "purple", 2, "top", random.Random(7))
    b = render_shape_image("square", "purple", 2, "top", random.Random(7))
    assert a == b
    images = {render_shape_image("square", "purple", 2, "top", random.Random(s)) for s in range(20)}
    assert len(images) > 5  # placement and size vary with the seed
    with pytest.raises(GhostvisError, match="hexagon"):
        render_shape_image("hexagon", "red", 1, "left", random.Random(0))
    with pytest.raises(GhostvisError):
        render_shape_image("circle", "red", 4, "left", random.Random(0))
