"""The embedded demo task data for the later phases: templated sets, generated locally, that a tiny
model (a few million parameters, a 4096-token BPE) learns in a few dozen optimizer steps.

Each source is written as Parquet shards in the format real datasets of its kind use, so the rest
of the pipeline treats it exactly like downloaded data:

- `demo_reasoning` (text): 1-3 step arithmetic word problems with a worked solution, GSM8K-like:
  `text` (question, `Step k: a op b = c.` lines, final `Answer: n`), `question`, `solution`, `answer`.
- `demo_problems` (problem): the same problems as the rl stage reads them, `prompt` (the question) and
  `answer` (the final number), split as demo_reasoning is (REWARD_RULES: the answer is the number of the
  completion's last `Answer: n`, the line the worked solutions end with).
- `demo_chat` (chat): `messages` (list of {role, content}: optional system, then 1-3 user/assistant
  exchanges) and a nullable `image` (PNG). About a fifth are image chats: the first user message is
  `<|image|>` followed by a question about the picture (colour, shape, count, position).
- `demo_prefs` (preference): `prompt`, `chosen` (the correct concise reply), `rejected` (a wrong
  result, a wrong fact, or a reply that runs on into an imitated user turn).
- `demo_images` (image_caption): 32x32 RGB PNGs of 1-3 coloured shapes on white, with `caption`
  ("two blue squares on the left.") and the attributes it is made from: `shape`, `color`, `count`,
  `position`.

Every table has an `id`: "<source>:" + the first 16 hex digits of the sha1 of the row's content.
Rows are unique within a source, so no validation row is a copy of a training row; for
`demo_reasoning` and `demo_prefs` even the question/prompt of a validation row never occurs in
training. Validation images reuse attribute combinations seen in training (a held-out caption loss),
never the exact picture.

Unique is not clean: templated rows repeat phrases, so a training chat can carry a validation chat's
words with another picture, a preference pair a validation pair's replies under a reworded prompt,
and a chat a validation preference pair's exchange (both use the same Q&A templates). After the
split, a training row that shares any 13-gram fingerprint (the text the tokenization fingerprints,
`ngrams.record_text`) with a validation row of any task source, whatever its kind, or with a shipped
evaluation item, or that holds a short shipped item whole ("Step 1: 40 + 24 = 64.", "The capital of
France is Paris."), is dropped (ghostvis_core/data/decontaminate.py; stricter than the gate's
`contamination.max_overlap`). A source therefore has fewer training rows than SPLIT_SIZES generates
(the whole-item rule drops 108 of 5,977 reasoning rows, 545 of 3,936 chats and 135 of 2,660
preference pairs that the fingerprints keep, and no caption); rows shorter than 13 words (every
caption) have no fingerprint and are kept unless they hold a shipped item. The stdlib text sources
(demo/corpus.py) share no 13-word run with these rows (tests/test_demo_corpus.py).

The build is deterministic (one seeded `random.Random` per source, no timestamps, no set
iteration), so the same installation always yields byte-identical shards.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

from ghostvis_core.data.decontaminate import HeldOut, drop_shared, held_out
from ghostvis_core.data.fact_tables import capitals
from ghostvis_core.data.ngrams import record_text
from ghostvis_core.demo.columns import demo_schema
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store.files import replacing

TASK_SOURCES: dict[str, str] = {
    "demo_reasoning": "text",
    "demo_problems": "problem",
    "demo_chat": "chat",
    "demo_prefs": "preference",
    "demo_images": "image_caption",
}

# A problem source's reward rule (ghostvis_core/data/problems.py), published in its manifest.
REWARD_RULES: dict[str, str] = {"demo_problems": r"regex:Answer:\s*(-?\d+)"}

SEED = 1337
DEMO_TRAIN_SHARDS = 4
ROW_GROUP_SIZE = 1000
# (train rows generated, validation rows) per source; decontamination then drops some training rows
SPLIT_SIZES: dict[str, tuple[int, int]] = {
    "demo_reasoning": (6000, 300),
    "demo_problems": (6000, 300),  # demo_reasoning's rows, as problems
    "demo_chat": (4000, 200),
    "demo_prefs": (3000, 200),
    "demo_images": (3000, 200),
}
IMAGE_CHAT_FRACTION = 0.2
IMAGE_SIZE = 32
IMAGE_PLACEHOLDER = "<|image|>"  # the same literal as ghostvis_core.data.chat.IMAGE

SCHEMAS: dict[str, pa.Schema] = {
    "demo_reasoning": demo_schema("text", "question", "solution", "answer", "id"),
    "demo_problems": demo_schema("prompt", "answer", "id"),
    "demo_chat": demo_schema("messages", "image", "id"),
    "demo_prefs": demo_schema("prompt", "chosen", "rejected", "id"),
    "demo_images": demo_schema("image", "caption", "shape", "color", "count", "position", "id"),
}

# --- image vocabulary -------------------------------------------------------------------------

SHAPES = ("circle", "square", "triangle")
COLORS: dict[str, tuple[int, int, int]] = {  # far apart in RGB, all clearly visible on white
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (235, 200, 0),
    "purple": (140, 40, 170),
    "orange": (245, 130, 0),
}
COUNTS = (1, 2, 3)
POSITIONS = ("left", "right", "top", "bottom", "center")
NUMBER_WORDS = {1: "one", 2: "two", 3: "three"}
POSITION_PHRASES = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
    "center": "in the center",
}
_WHITE = (255, 255, 255)
# object side in pixels by count: big enough to see at 32x32, small enough that three fit in a half
_SIZES = {1: (10, 12), 2: (9, 11), 3: (8, 9)}


def caption_for(shape: str, color: str, count: int, position: str) -> str:
    """The caption is a function of the attributes: "two blue squares on the left."."""
    noun = shape if count == 1 else shape + "s"
    return f"{NUMBER_WORDS[count]} {color} {noun} {POSITION_PHRASES[position]}."


def render_shape_image(shape: str, color: str, count: int, position: str, rng: random.Random) -> bytes:
    """A 32x32 RGB PNG: `count` solid shapes of one colour on white, grouped at `position`.

    The objects sit in a row (stacked vertically for left/right, side by side otherwise) in the
    named half of the image, separated by at least one white pixel; size, gaps and placement are
    jittered by `rng`. No anti-aliasing: every non-white pixel is exactly COLORS[color].
    """
    if shape not in SHAPES or color not in COLORS or count not in COUNTS or position not in POSITIONS:
        raise GhostvisError(
            f"cannot render shape={shape!r} color={color!r} count={count!r} position={position!r}; "
            f"shapes: {', '.join(SHAPES)}; colors: {', '.join(COLORS)}; counts: 1-3; "
            f"positions: {', '.join(POSITIONS)}"
        )
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), _WHITE)
    draw = ImageDraw.Draw(img)
    fill = COLORS[color]
    for x0, y0, s in _layout(count, position, rng):
        x1, y1 = x0 + s - 1, y0 + s - 1
        if shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([(x0 + (s - 1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _layout(count: int, position: str, rng: random.Random) -> list[tuple[int, int, int]]:
    """(x0, y0, side) of each object's bounding box; a 1-pixel white margin all round."""
    s = rng.randint(*_SIZES[count])
    gap = rng.randint(1, min(3, (30 - count * s) // (count - 1))) if count > 1 else 0
    length = count * s + (count - 1) * gap
    mid = (IMAGE_SIZE - length) // 2  # the group is centred (+-2 px) along its own axis
    start = rng.randint(max(1, mid - 2), min(IMAGE_SIZE - 1 - length, mid + 2))
    half = IMAGE_SIZE // 2
    if position in ("left", "top"):  # the whole object lies in the near half
        lo, hi = 1, half - 1 - s
    elif position in ("right", "bottom"):
        lo, hi = half + 1, IMAGE_SIZE - 1 - s
    else:
        centred = (IMAGE_SIZE - s) // 2
        lo, hi = centred - 1, centred + 1
    base = rng.randint(lo, hi)
    boxes = []
    for i in range(count):
        along = start + i * (s + gap)
        across = min(hi, max(lo, base + rng.randint(-1, 1)))
        boxes.append((across, along, s) if position in ("left", "right") else (along, across, s))
    return boxes


# --- the public entry point -------------------------------------------------------------------


def build_task_source(source: str, out_dir: Path) -> list[tuple[Path, str]]:
    """Write one source's shards into out_dir; return [(path, split)], train shards first (sorted),
    then validation. Training rows that share a 13-gram fingerprint with a validation row of any
    task source or with a shipped evaluation item, or hold a short shipped item whole, are dropped
    (module docstring)."""
    if source not in TASK_SOURCES:
        raise GhostvisError(
            f"unknown demo task source {source!r}; the embedded demo task sources are {', '.join(TASK_SOURCES)}"
        )
    train, val = _generate(source)
    train = drop_shared(train, partial(record_text, TASK_SOURCES[source]), _held_out())
    shards = [(f"{i:05d}.parquet", "train", train[i::DEMO_TRAIN_SHARDS]) for i in range(DEMO_TRAIN_SHARDS)]
    shards.append(("val_00000.parquet", "validation", val))

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, split, rows in shards:
        path = out_dir / name
        _write_shard(path, source, rows)
        written.append((path, split))
    return written


def _generate(source: str) -> tuple[list[dict], list[dict]]:
    """(train, validation) rows of a source as generated, before decontamination."""
    builders: dict[str, Callable[[random.Random, int, int], tuple[list[dict], list[dict]]]] = {
        "demo_reasoning": _reasoning_rows,
        "demo_problems": _problem_rows,
        "demo_chat": _chat_rows,
        "demo_prefs": _pref_rows,
        "demo_images": _image_rows,
    }
    n_train, n_val = SPLIT_SIZES[source]
    return builders[source](random.Random(f"{SEED}:{source}"), n_train, n_val)


@cache
def _held_out() -> HeldOut:
    """What no training row may share a fingerprint with: the validation rows of every task source,
    whatever its kind (the gate compares across kinds, and chats and preference pairs come from the
    same Q&A templates), and the shipped evaluation items. Cached: every source's build needs all of it."""
    return held_out(record_text(kind, row) for source, kind in TASK_SOURCES.items() for row in _generate(source)[1])


# --- shared helpers ---------------------------------------------------------------------------


def _row_id(source: str, *parts: bytes) -> str:
    return f"{source}:" + hashlib.sha1(b"\x00".join(parts)).hexdigest()[:16]


def _content_key(source: str, row: dict) -> tuple[bytes, ...]:
    """What makes a row what it is; its sha1 is the id."""
    if source == "demo_reasoning":
        return (row["text"].encode(),)
    if source == "demo_problems":
        return (row["prompt"].encode(), row["answer"].encode())
    if source == "demo_chat":
        return (json.dumps(row["messages"], ensure_ascii=False).encode(), row["image"] or b"")
    if source == "demo_prefs":
        return (json.dumps([row["prompt"], row["chosen"], row["rejected"]], ensure_ascii=False).encode(),)
    return (row["image"], row["caption"].encode())


def _unique(
    rng: random.Random, make: Callable[[random.Random], dict], key: Callable[[dict], object], n: int, what: str
) -> list[dict]:
    """n rows from `make` whose keys are pairwise different (duplicates are drawn again)."""
    rows: list[dict] = []
    seen: set = set()  # membership only; never iterated, so the order stays seeded
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 50 * n:  # a template change that shrank the space below n would spin forever
            raise GhostvisError(f"cannot draw {n} distinct {what} from the demo templates; widen the templates")
        row = make(rng)
        k = key(row)
        if k not in seen:
            seen.add(k)
            rows.append(row)
    return rows


def _write_shard(path: Path, source: str, rows: list[dict]) -> None:
    """Write atomically: a reader never sees a half-written shard under the final name."""
    schema = SCHEMAS[source]
    columns = {f.name: [r[f.name] for r in rows] for f in schema if f.name != "id"}
    columns["id"] = [_row_id(source, *_content_key(source, r)) for r in rows]
    table = pa.table(columns, schema=schema)
    with replacing(path) as tmp:
        pq.write_table(table, tmp, row_group_size=ROW_GROUP_SIZE, compression="zstd")


def _pick(rng: random.Random, seq):
    return seq[rng.randrange(len(seq))]


def _split(rng: random.Random, rows: list[dict], n_val: int) -> tuple[list[dict], list[dict]]:
    rng.shuffle(rows)
    return rows[n_val:], rows[:n_val]


# --- shared vocabulary ------------------------------------------------------------------------

_NAMES = (
    ("Tom", "He", "his"),
    ("Anna", "She", "her"),
    ("Ben", "He", "his"),
    ("Lily", "She", "her"),
    ("Sam", "He", "his"),
    ("Maya", "She", "her"),
    ("Leo", "He", "his"),
    ("Emma", "She", "her"),
    ("Omar", "He", "his"),
    ("Sofia", "She", "her"),
    ("Max", "He", "his"),
    ("Nora", "She", "her"),
    ("Jack", "He", "his"),
    ("Zoe", "She", "her"),
    ("Ravi", "He", "his"),
    ("Mia", "She", "her"),
    ("Carlos", "He", "his"),
    ("Hana", "She", "her"),
    ("Owen", "He", "his"),
    ("Lucy", "She", "her"),
    ("Ali", "He", "his"),
    ("Ella", "She", "her"),
    ("Finn", "He", "his"),
    ("Grace", "She", "her"),
    ("Noah", "He", "his"),
    ("Ivy", "She", "her"),
    ("Kai", "He", "his"),
    ("Ruby", "She", "her"),
    ("Luis", "He", "his"),
    ("Aisha", "She", "her"),
    ("Hugo", "He", "his"),
    ("Chloe", "She", "her"),
    ("Eli", "He", "his"),
    ("Nina", "She", "her"),
    ("Theo", "He", "his"),
    ("Julia", "She", "her"),
    ("Adam", "He", "his"),
    ("Rosa", "She", "her"),
    ("Kenji", "He", "his"),
    ("Priya", "She", "her"),
)
_OBJECTS = (
    ("apple", "apples"),
    ("pencil", "pencils"),
    ("marble", "marbles"),
    ("sticker", "stickers"),
    ("book", "books"),
    ("cookie", "cookies"),
    ("coin", "coins"),
    ("card", "cards"),
    ("shell", "shells"),
    ("stamp", "stamps"),
    ("balloon", "balloons"),
    ("crayon", "crayons"),
    ("egg", "eggs"),
    ("flower", "flowers"),
    ("toy car", "toy cars"),
    ("ribbon", "ribbons"),
    ("button", "buttons"),
    ("candy", "candies"),
    ("cupcake", "cupcakes"),
    ("banana", "bananas"),
    ("rock", "rocks"),
    ("feather", "feathers"),
    ("bead", "beads"),
    ("cherry", "cherries"),
    ("peach", "peaches"),
    ("lemon", "lemons"),
    ("kite", "kites"),
    ("sock", "socks"),
)
_CONTAINERS = (
    ("box", "boxes"),
    ("bag", "bags"),
    ("jar", "jars"),
    ("basket", "baskets"),
    ("pack", "packs"),
    ("tray", "trays"),
    ("bowl", "bowls"),
    ("crate", "crates"),
)
_PRICED = (
    ("pen", "pens"),
    ("notebook", "notebooks"),
    ("ticket", "tickets"),
    ("sandwich", "sandwiches"),
    ("toy", "toys"),
    ("comic", "comics"),
    ("plant", "plants"),
    ("mug", "mugs"),
    ("ball", "balls"),
)
_GAIN = ("buys", "finds", "gets", "picks up", "is given", "receives", "wins")
_GAIN_PAST = ("bought", "found", "got", "picked up", "was given", "received", "won")
_LOSS = ("gives away", "loses", "sells", "drops", "uses", "donates")


def _people(rng: random.Random, k: int) -> list[tuple[str, str, str]]:
    return rng.sample(_NAMES, k)


# --- demo_reasoning ---------------------------------------------------------------------------


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


# The phrasings of the one-step questions, filled in by _ask. A phrasing's verbs are drawn before the phrasing is
# picked, every phrasing's, so the draws do not depend on which phrasing is picked.
_ADD = (
    "{n} has {a} {objs}. {p} {gain} {b} more. How many {objs} does {n} have now?",
    "There are {a} {objs} on a table. {n} puts {b} more on it. How many {objs} are on the table?",
    "{n} had {a} {objs} and then {gain_past} {b} more. How many {objs} does {n} have?",
)
_SUB = (
    "{n} has {a} {objs}. {p} {loss} {b} of them. How many {objs} are left?",
    "A shop has {a} {objs}. It sells {b}. How many {objs} does the shop have left?",
    "{n} has {a} {objs} and {other_loss} {b}. How many {objs} does {n} have left?",
)
_MUL = (
    "{n} has {a} {conts}. Each {cont} holds {b} {objs}. How many {objs} does {n} have in total?",
    "There are {a} {conts} with {b} {objs} in each. How many {objs} are there altogether?",
)
_MUL_SUB = (
    "There are {a} {conts} with {b} {objs} each. {n} takes {c} {objs}. How many {objs} are left?",
    "{n} fills {a} {conts} with {b} {objs} each and then eats {c} of them. How many {objs} are left?",
)


def _ask(rng: random.Random, phrasings: tuple[str, ...], **words) -> str:
    """One of the phrasings, with the question's names, objects, verbs and numbers filled in."""
    return _pick(rng, phrasings).format(**words)


def _owner(rng: random.Random) -> tuple[str, str, str]:
    """A person (name, pronoun) and the objects they have (plural)."""
    (n, p, _), (_, objs) = _people(rng, 1)[0], _pick(rng, _OBJECTS)
    return n, p, objs


def _r_add(rng):
    n, p, objs = _owner(rng)
    a, b = rng.randint(2, 40), rng.randint(1, 30)
    verbs = dict(gain=_pick(rng, _GAIN), gain_past=_pick(rng, _GAIN_PAST))
    return _ask(rng, _ADD, n=n, p=p, objs=objs, a=a, b=b, **verbs), [(a, "+", b)]


def _r_sub(rng):
    n, p, objs = _owner(rng)
    a = rng.randint(5, 50)
    b = rng.randint(1, a - 1)
    verbs = dict(loss=_pick(rng, _LOSS), other_loss=_pick(rng, _LOSS))
    return _ask(rng, _SUB, n=n, p=p, objs=objs, a=a, b=b, **verbs), [(a, "-", b)]


def _r_add_sub(rng):
    (n, p, _), (n2, _, _) = _people(rng, 2)
    objs = _pick(rng, _OBJECTS)[1]
    a, b = rng.randint(2, 30), rng.randint(1, 20)
    c = rng.randint(1, a + b - 1)
    loss = _pick(rng, (f"gives {c} away", f"loses {c}", f"sells {c}", f"gives {c} to {n2}"))
    q = (
        f"{n} has {a} {objs}. {p} {_pick(rng, ('buys', 'finds', 'gets'))} {b} more and {loss}. "
        f"How many {objs} does {n} have?"
    )
    return q, [(a, "+", b), (a + b, "-", c)]


def _r_sub_add(rng):
    (n, p, _), (n2, _, _) = _people(rng, 2)
    objs = _pick(rng, _OBJECTS)[1]
    a = rng.randint(5, 40)
    b = rng.randint(1, a - 1)
    c = rng.randint(1, 20)
    q = (
        f"{n} has {a} {objs}. {p} {_pick(rng, _LOSS)} {b}, and then {n2} gives {n} {c} more. "
        f"How many {objs} does {n} have now?"
    )
    return q, [(a, "-", b), (a - b, "+", c)]


def _r_mul(rng):
    (n, _, _), (cont, conts), (_, objs) = _people(rng, 1)[0], _pick(rng, _CONTAINERS), _pick(rng, _OBJECTS)
    a, b = rng.randint(2, 9), rng.randint(2, 11)
    return _ask(rng, _MUL, n=n, cont=cont, conts=conts, objs=objs, a=a, b=b), [(a, "*", b)]


def _r_mul_add(rng):
    (n, p, _), (_, conts), (_, objs) = _people(rng, 1)[0], _pick(rng, _CONTAINERS), _pick(rng, _OBJECTS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 10), rng.randint(1, 20)
    q = (
        f"{n} buys {a} {conts} of {objs} with {b} {objs} in each. {p} already had {c} {objs}. "
        f"How many {objs} does {n} have now?"
    )
    return q, [(a, "*", b), (a * b, "+", c)]


def _r_mul_sub(rng):
    (n, _, _), (_, conts), (_, objs) = _people(rng, 1)[0], _pick(rng, _CONTAINERS), _pick(rng, _OBJECTS)
    a, b = rng.randint(2, 9), rng.randint(2, 10)
    c = rng.randint(1, a * b - 1)
    return _ask(rng, _MUL_SUB, n=n, conts=conts, objs=objs, a=a, b=b, c=c), [(a, "*", b), (a * b, "-", c)]


def _r_compare(rng):
    (n, _, _), (n2, _, _) = _people(rng, 2)
    objs = _pick(rng, _OBJECTS)[1]
    a = rng.randint(3, 30)
    if rng.random() < 0.5:
        b = rng.randint(1, 15)
        q = f"{n} has {a} {objs}. {n2} has {b} more {objs} than {n}. How many {objs} do they have together?"
        return q, [(a, "+", b), (a, "+", a + b)]
    b = rng.randint(1, a - 1)
    q = f"{n} has {a} {objs}. {n2} has {b} fewer {objs} than {n}. How many {objs} do they have together?"
    return q, [(a, "-", b), (a, "+", a - b)]


def _r_three(rng):
    (n, p, _), (n2, _, _) = _people(rng, 2)
    objs = _pick(rng, _OBJECTS)[1]
    a, b = rng.randint(2, 30), rng.randint(1, 20)
    c = rng.randint(1, a + b - 1)
    d = rng.randint(1, 15)
    q = (
        f"{n} has {a} {objs}. {p} buys {b} more, gives {c} to {n2}, and then finds {d} more. "
        f"How many {objs} does {n} have now?"
    )
    return q, [(a, "+", b), (a + b, "-", c), (a + b - c, "+", d)]


def _r_double(rng):
    n, p, objs = _owner(rng)
    a = rng.randint(2, 25)
    if rng.random() < 0.5:
        return f"{n} has {a} {objs}. {p} doubles them. How many {objs} does {n} have now?", [(a, "*", 2)]
    c = rng.randint(1, 2 * a - 1)
    q = f"{n} has {a} {objs}. {p} doubles them and then gives {c} away. How many {objs} does {n} have now?"
    return q, [(a, "*", 2), (2 * a, "-", c)]


def _r_money(rng):
    (n, _, _), (_, items) = _people(rng, 1)[0], _pick(rng, _PRICED)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    if rng.random() < 0.5:
        return f"{n} buys {a} {items} that cost {b} dollars each. How many dollars does {n} spend?", [(a, "*", b)]
    c = a * b + rng.randint(1, min(20, 99 - a * b))  # every number in the steps stays below 100
    q = f"{n} buys {a} {items} at {b} dollars each and pays with {c} dollars. How many dollars of change does {n} get?"
    return q, [(a, "*", b), (c, "-", a * b)]


def _r_expr(rng):
    form = rng.randrange(5)
    if form == 0:  # a + b - c
        a, b = rng.randint(1, 40), rng.randint(1, 40)
        c = rng.randint(1, a + b)
        steps = [(a, "+", b), (a + b, "-", c)]
    elif form == 1:  # a - b + c
        a = rng.randint(2, 50)
        b, c = rng.randint(1, a), rng.randint(1, 40)
        steps = [(a, "-", b), (a - b, "+", c)]
    elif form == 2:  # a * b + c
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 30)
        steps = [(a, "*", b), (a * b, "+", c)]
    elif form == 3:  # a * b - c
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        c = rng.randint(1, a * b)
        steps = [(a, "*", b), (a * b, "-", c)]
    else:  # a + b + c
        a, b, c = rng.randint(1, 30), rng.randint(1, 30), rng.randint(1, 30)
        steps = [(a, "+", b), (a + b, "+", c)]
    (a, op1, b), (_, op2, c) = steps
    expr = f"{a} {op1} {b} {op2} {c}"
    q = _pick(rng, (f"What is {expr}?", f"Compute {expr}.", f"Calculate {expr}."))
    return q, steps


_REASONING_FAMILIES = (
    _r_add,
    _r_sub,
    _r_add_sub,
    _r_sub_add,
    _r_mul,
    _r_mul_add,
    _r_mul_sub,
    _r_compare,
    _r_three,
    _r_double,
    _r_money,
    _r_expr,
)


def _reasoning_doc(rng: random.Random) -> dict:
    question, steps = _pick(rng, _REASONING_FAMILIES)(rng)
    lines = []
    for i, (a, op, b) in enumerate(steps, 1):
        result = _apply(a, op, b)
        assert result >= 0, (question, steps)  # templates keep every intermediate non-negative
        lines.append(f"Step {i}: {a} {op} {b} = {result}.")
    solution = "\n".join(lines)
    answer = str(result)
    return {
        "text": f"{question}\n{solution}\nAnswer: {answer}",
        "question": question,
        "solution": solution,
        "answer": answer,
    }


def _reasoning_rows(rng, n_train, n_val):
    rows = _unique(rng, _reasoning_doc, lambda r: r["question"], n_train + n_val, "reasoning questions")
    return _split(rng, rows, n_val)


def _problem_rows(rng, n_train, n_val):
    """demo_reasoning's rows (same split) as the rl stage's problems: the question and the final answer."""
    train, val = _generate("demo_reasoning")
    train_problems, val_problems = (
        [{"prompt": r["question"], "answer": r["answer"]} for r in rows] for rows in (train, val)
    )
    return train_problems, val_problems


# --- short factual Q&A (demo_chat and demo_prefs) ---------------------------------------------
# Each family returns (user prompt, correct concise reply, a plausible wrong reply).

_WORDS = (
    "cat",
    "dog",
    "sun",
    "tree",
    "book",
    "fish",
    "bird",
    "milk",
    "rain",
    "star",
    "moon",
    "ship",
    "door",
    "lamp",
    "cake",
    "frog",
    "hand",
    "leaf",
    "ring",
    "bell",
    "desk",
    "road",
    "king",
    "note",
    "rose",
    "sand",
    "wolf",
    "bear",
    "gold",
    "salt",
    "snow",
    "wind",
    "apple",
    "house",
    "water",
    "bread",
    "chair",
    "table",
    "light",
    "green",
    "plant",
    "river",
    "stone",
    "cloud",
    "smile",
    "train",
    "horse",
    "mouse",
    "paper",
    "music",
    "happy",
    "dream",
    "ocean",
    "tiger",
    "lemon",
    "grape",
    "pencil",
    "garden",
    "window",
    "candle",
    "rabbit",
    "planet",
    "yellow",
    "orange",
    "silver",
    "winter",
    "summer",
    "forest",
    "basket",
    "button",
    "castle",
    "dragon",
    "flower",
    "jacket",
    "ladder",
    "monkey",
    "pepper",
    "rocket",
    "school",
    "spring",
)
_SOUNDS = (
    ("cow", "moo"),
    ("dog", "woof"),
    ("cat", "meow"),
    ("duck", "quack"),
    ("sheep", "baa"),
    ("pig", "oink"),
    ("horse", "neigh"),
    ("owl", "hoot"),
    ("lion", "roar"),
    ("frog", "ribbit"),
    ("mouse", "squeak"),
    ("bee", "buzz"),
    ("snake", "hiss"),
    ("crow", "caw"),
)
_OPPOSITES = (
    ("hot", "cold"),
    ("big", "small"),
    ("up", "down"),
    ("fast", "slow"),
    ("happy", "sad"),
    ("light", "dark"),
    ("open", "closed"),
    ("early", "late"),
    ("full", "empty"),
    ("hard", "soft"),
    ("high", "low"),
    ("long", "short"),
    ("loud", "quiet"),
    ("strong", "weak"),
    ("wet", "dry"),
    ("young", "old"),
    ("day", "night"),
    ("in", "out"),
    ("yes", "no"),
    ("push", "pull"),
)
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "You are GhostVis, a small and friendly assistant.",
    "Answer every question in one short sentence.",
)


def _other(rng: random.Random, seq, exclude):
    while (x := _pick(rng, seq)) == exclude:
        pass
    return x


def _qa_arith(rng):
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        op, c = "+", a + b
        prompt = _pick(rng, (f"What is {a} + {b}?", f"What is {a} plus {b}?", f"Add {a} and {b}."))
    elif kind == 1:
        a = rng.randint(2, 60)
        b = rng.randint(1, a)
        op, c = "-", a - b
        prompt = _pick(rng, (f"What is {a} - {b}?", f"What is {a} minus {b}?", f"Subtract {b} from {a}."))
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 9)
        op, c = "*", a * b
        prompt = _pick(rng, (f"What is {a} * {b}?", f"What is {a} times {b}?", f"Multiply {a} by {b}."))
    wrong = c + _pick(rng, (-3, -2, -1, 1, 2, 3, 10))
    if wrong < 0:
        wrong = c + 1
    return prompt, f"{a} {op} {b} = {c}.", f"{a} {op} {b} = {wrong}."


def _qa_capital(rng):
    country, city = _pick(rng, capitals())
    prompt = _pick(
        rng,
        (
            f"What is the capital of {country}?",
            f"Which city is the capital of {country}?",
            f"Name the capital of {country}.",
            f"What's the capital city of {country}?",
        ),
    )
    wrong = _other(rng, capitals(), (country, city))[1]
    return prompt, f"The capital of {country} is {city}.", f"The capital of {country} is {wrong}."


def _qa_spell(rng):
    w = _pick(rng, _WORDS)
    prompt = _pick(rng, (f"Spell the word {w}.", f"How do you spell {w}?", f"Spell {w} letter by letter."))
    i = rng.randrange(len(w))
    bad = w[:i] + w[i + 1 :]  # a letter left out
    return prompt, f"The word {w} is spelled {'-'.join(w)}.", f"The word {w} is spelled {'-'.join(bad)}."


def _qa_reverse(rng):
    w = _pick(rng, _WORDS)
    prompt = _pick(rng, (f"Reverse the word {w}.", f"Write {w} backwards.", f"What is {w} spelled backwards?"))
    rev = w[::-1]
    bad = rev[1] + rev[0] + rev[2:]  # two letters the wrong way round, or (below) not reversed at all
    if rng.random() < 0.5 or bad == rev:
        bad = w  # no word in _WORDS is a palindrome
    return prompt, f"The word {w} backwards is {rev}.", f"The word {w} backwards is {bad}."


def _qa_greet(rng):
    person = _pick(rng, _NAMES)
    name, wrong_name = person[0], _other(rng, _NAMES, person)[0]
    if rng.random() < 0.6:
        prompt = _pick(rng, (f"Say hello to {name}.", f"Greet {name}.", f"Please say hi to {name}."))
        good, bad = (
            f"Hello, {name}! Nice to meet you.",
            _pick(rng, (f"Hello, {wrong_name}! Nice to meet you.", f"Goodbye, {name}! See you soon.")),
        )
    else:
        prompt = _pick(rng, (f"Say goodbye to {name}.", f"Please say bye to {name}."))
        good, bad = (
            f"Goodbye, {name}! See you soon.",
            _pick(rng, (f"Goodbye, {wrong_name}! See you soon.", f"Hello, {name}! Nice to meet you.")),
        )
    return prompt, good, bad


def _qa_count(rng):
    a = rng.randint(1, 30)
    b = a + rng.randint(2, 6)
    prompt = _pick(rng, (f"Count from {a} to {b}.", f"List the numbers from {a} to {b}."))
    nums = [str(i) for i in range(a, b + 1)]
    skip = rng.randrange(1, len(nums) - 1)
    return prompt, ", ".join(nums) + ".", ", ".join(nums[:skip] + nums[skip + 1 :]) + "."


def _qa_compare(rng):
    a, b = rng.sample(range(1, 100), 2)
    hi, lo = max(a, b), min(a, b)
    prompt = _pick(rng, (f"Which is larger, {a} or {b}?", f"Which number is bigger: {a} or {b}?"))
    return prompt, f"{hi} is larger than {lo}.", f"{lo} is larger than {hi}."


def _qa_next(rng):
    a = rng.randint(1, 99)
    if rng.random() < 0.5:
        prompt = _pick(rng, (f"What number comes after {a}?", f"What is the next number after {a}?"))
        return prompt, f"{a + 1} comes after {a}.", f"{_pick(rng, (a - 1, a + 2))} comes after {a}."
    prompt = _pick(rng, (f"What number comes before {a}?", f"What is the number just before {a}?"))
    return prompt, f"{a - 1} comes before {a}.", f"{a + 1} comes before {a}."


def _qa_sound(rng):
    animal, sound = _pick(rng, _SOUNDS)
    wrong = _other(rng, _SOUNDS, (animal, sound))[1]
    prompt = _pick(rng, (f"What sound does a {animal} make?", f"What does a {animal} say?"))
    return prompt, f"A {animal} says {sound}.", f"A {animal} says {wrong}."


def _qa_opposite(rng):
    pair = _pick(rng, _OPPOSITES)
    w, opp = pair if rng.random() < 0.5 else pair[::-1]
    wrong = _pick(rng, _other(rng, _OPPOSITES, pair))
    prompt = _pick(rng, (f"What is the opposite of {w}?", f"Give the opposite of the word {w}."))
    return prompt, f"The opposite of {w} is {opp}.", f"The opposite of {w} is {wrong}."


def _qa_upper(rng):
    w = _pick(rng, _WORDS)
    prompt = _pick(rng, (f"Write {w} in capital letters.", f"Write the word {w} in uppercase."))
    return prompt, f"{w.upper()}.", f"{w.capitalize()}."


# (family, weight): arithmetic is the biggest and the only one with thousands of distinct prompts
_QA_FAMILIES = (
    (_qa_arith, 5),
    (_qa_capital, 2),
    (_qa_spell, 1),
    (_qa_reverse, 1),
    (_qa_greet, 1),
    (_qa_count, 1),
    (_qa_compare, 1),
    (_qa_next, 1),
    (_qa_sound, 1),
    (_qa_opposite, 1),
    (_qa_upper, 1),
)
_QA_TABLE = tuple(f for f, w in _QA_FAMILIES for _ in range(w))


def _qa(rng: random.Random) -> tuple[str, str, str]:
    return _pick(rng, _QA_TABLE)(rng)


# --- demo_chat --------------------------------------------------------------------------------


def _image_qa(
    rng: random.Random, attr: str, shape: str, color: str, count: int, position: str, first: bool
) -> tuple[str, str]:
    one = count == 1
    noun = shape if one else shape + "s"
    where = POSITION_PHRASES[position]
    if attr == "color":
        q = _pick(
            rng,
            (
                "What colour are the shapes?",
                "What color is the shape?",
                "Which colour do you see?",
                "What color are the objects in the picture?",
            ),
        )
        a = f"The {noun} {'is' if one else 'are'} {color}."
    elif attr == "shape":
        q = _pick(rng, ("What shape is in the image?", "Which shape do you see?", "What kind of shape is shown?"))
        a = f"It is a {shape}." if one else f"They are {noun}."
    elif attr == "count":
        q = _pick(
            rng, ("How many shapes are there?", "How many objects are in the picture?", "How many shapes can you see?")
        )
        a = f"There is one {shape}." if one else f"There are {NUMBER_WORDS[count]} {noun}."
    elif attr == "position":
        q = _pick(
            rng,
            ("Where is the shape?", "Where are the shapes in the image?", "In which part of the image are the shapes?"),
        )
        a = f"{'It is' if one else 'They are'} {where}."
    else:
        q = _pick(rng, ("Describe the image.", "What do you see?", "Write a caption for this image."))
        a = caption_for(shape, color, count, position).capitalize()
    if not first and rng.random() < 0.5:  # some follow-ups read as follow-ups
        q = "And " + q[0].lower() + q[1:]
    return q, a


def _chat_row(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": _pick(rng, _SYSTEM_PROMPTS)})
    n_exchanges = _pick(rng, (1, 1, 1, 1, 1, 2, 2, 2, 3, 3))
    image = None
    if rng.random() < IMAGE_CHAT_FRACTION:
        shape, color = _pick(rng, SHAPES), _pick(rng, tuple(COLORS))
        count, position = _pick(rng, COUNTS), _pick(rng, POSITIONS)
        image = render_shape_image(shape, color, count, position, rng)
        attrs = rng.sample(("color", "shape", "count", "position", "describe"), n_exchanges)
        for i, attr in enumerate(attrs):
            q, a = _image_qa(rng, attr, shape, color, count, position, first=i == 0)
            messages += [
                {"role": "user", "content": f"{IMAGE_PLACEHOLDER}\n{q}" if i == 0 else q},
                {"role": "assistant", "content": a},
            ]
    else:
        for i in range(n_exchanges):
            if i and i == n_exchanges - 1 and rng.random() < 0.2:
                q, a = _pick(rng, ("Thanks!", "Thank you.", "Great, thanks.")), "You're welcome!"
            else:
                q, a, _ = _qa(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": messages, "image": image}


def _chat_rows(rng, n_train, n_val):
    rows = _unique(rng, _chat_row, lambda r: _content_key("demo_chat", r), n_train + n_val, "conversations")
    return _split(rng, rows, n_val)


# --- demo_prefs -------------------------------------------------------------------------------


def _pref_row(rng: random.Random) -> dict:
    prompt, chosen, wrong = _qa(rng)
    style = rng.random()
    if style < 0.6:  # wrong result or wrong fact, same shape as the right answer
        rejected = wrong
    else:  # does not stop: imitates the next user turn, sometimes answers it too, or rambles on
        p2, a2, _ = _qa(rng)
        rejected = _pick(
            rng,
            (
                f"{chosen}\nUser: {p2}",
                f"{chosen}\nUser: {p2}\nAssistant: {a2}",
                f"{chosen} {chosen} {chosen}",
                f"{chosen} I hope this helps! Let me know if you have any other questions, "
                f"I am always happy to help with anything else you need.",
            ),
        )
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _pref_rows(rng, n_train, n_val):
    rows = _unique(rng, _pref_row, lambda r: r["prompt"], n_train + n_val, "preference prompts")
    return _split(rng, rows, n_val)


# --- demo_images ------------------------------------------------------------------------------


def _image_rows(rng, n_train, n_val):
    """Every attribute combination about equally often; each validation image has a combination that
    also occurs (with other pixels) in training."""
    combos = [(s, c, n, p) for s in SHAPES for c in COLORS for n in COUNTS for p in POSITIONS]
    rng.shuffle(combos)
    total = n_train + n_val
    if n_val > len(combos) or total < 2 * len(combos):
        raise GhostvisError(f"demo_images needs {len(combos)} <= validation and 2x{len(combos)} <= total rows")
    seen: set[bytes] = set()
    rows = []
    for i in range(total):
        shape, color, count, position = combos[i % len(combos)]
        while (png := render_shape_image(shape, color, count, position, rng)) in seen:
            pass  # the same pixels again: jitter once more
        seen.add(png)
        rows.append(
            {
                "image": png,
                "caption": caption_for(shape, color, count, position),
                "shape": shape,
                "color": color,
                "count": count,
                "position": position,
            }
        )
    val = rows[:n_val]  # first pass over the combinations: n_val distinct ones, all repeated later
    train = rows[n_val:]
    rng.shuffle(train)
    return train, val
