"""The first hour on your own data, replayed from an empty folder: hand-written texts, chats (JSON Lines and
Parquet mixed), TRL preference pairs with several pairs per prompt (and one exact duplicate), and problems
with `columns: {prompt: question}`, listed from local folders, through `pretrain,sft,dpo,rl` on the tiny
preset. Every refusal met on the way is one message with its fix and no traceback, and the fix passes: a
plan beyond the data, and a file edited after it was listed."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.home import Home
from tests.conftest import BIN, cli_env

pytestmark = pytest.mark.e2e

WORDS = (
    "amber basil cedar dune ember fjord grove heath inlet juniper knoll larch marsh nettle orchid pebble quartz "
    "ridge sorrel thistle umber vale willow yarrow zephyr alder birch clover dahlia elm fern gorse hazel iris "
    "jasmine kelp lichen maple nutmeg oak poppy quince rowan sage tansy upland violet wren yew"
).split()
LINEAGE = "pretrain,sft,dpo,rl"
FILES = 4  # per source: 00000..00002 train, 00003 validation (pinned)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_rows(folder: Path, rows: list[dict], parquet: set[int] = frozenset()) -> None:
    """`rows` over FILES files 00000..00003 in order, a file in `parquet` as Parquet, else JSON Lines."""
    per = -(-len(rows) // FILES)
    for i in range(FILES):
        part = rows[i * per : (i + 1) * per]
        if i in parquet:
            folder.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(part), folder / f"{i:05d}.parquet")
        else:
            write_jsonl(folder / f"{i:05d}.jsonl", part)


def user_data(root: Path) -> None:
    """320 texts, 100 chats, 97 pairs (32 prompts x 3, a prompt's pairs in one file, one pair twice), 80 problems."""
    rng = random.Random(55)
    write_rows(root / "texts", [{"text": words(rng, rng.randint(40, 90))} for _ in range(320)])
    chats = [
        {
            "messages": [
                {"role": "user", "content": words(rng, 8) + "?"},
                {"role": "assistant", "content": words(rng, 12)},
            ]
        }
        for _ in range(100)
    ]
    write_rows(root / "chats", chats, parquet={1, 3})
    for i in range(FILES):  # 8 prompts a file, 3 pairs each: a prompt's pairs in one file
        pairs = []
        for _ in range(8):
            prompt = words(rng, 9) + "?"
            pairs += [{"prompt": prompt, "chosen": words(rng, 6), "rejected": words(rng, 6)} for _ in range(3)]
        if i == 0:
            pairs.insert(1, dict(pairs[0]))  # the same prompt, chosen and rejected again: an exact duplicate
        write_jsonl(root / "pairs" / f"{i:05d}.jsonl", pairs)
    problems = [
        {"question": f"{words(rng, 6)}: what is {a} plus {b}?", "answer": a + b}
        for a, b in ((rng.randint(1, 50), rng.randint(1, 50)) for _ in range(80))
    ]
    write_rows(root / "problems", problems)


def sources_yaml(root: Path) -> str:
    entries = {
        "my_texts": ("text", "texts", {}),
        "my_chats": ("chat", "chats", {}),
        "my_pairs": ("preference", "pairs", {}),
        "my_problems": ("problem", "problems", {"columns": {"prompt": "question"}, "reward": "integer"}),
    }
    remote = [
        {"name": name, "kind": kind, "listing": (root / folder).as_uri(), "validation": ["00003"], **extra}
        for name, (kind, folder, extra) in entries.items()
    ]
    return json.dumps({"ops": {"shard_manifest": {"config": {"sources": [], "remote": remote}}}})


def run(home: Path, *argv: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    """A console script of this venv against `home`, as the user runs it: the tiny preset, the walk's lineage."""
    env = {**cli_env(home, GHOSTVIS_LINEAGE=LINEAGE), "GHOSTVIS_PRESET": "tiny"}
    proc = subprocess.run([str(BIN / argv[0]), *argv[1:]], env=env, input=stdin, capture_output=True, text=True,
                          timeout=900, cwd=home.parent)  # fmt: skip
    if check:
        assert proc.returncode == 0, (
            f"{' '.join(argv)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def ghostvis(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(home, "ghostvis", *args, check=check)


def list_sources(home: Path, root: Path) -> None:
    run(home, "dagster", "asset", "materialize", "-m", "ghostvis_pipeline.definitions", "--select", "shard_manifest",
        "-c", str(root / "sources.yaml"))  # fmt: skip


def no_trace(proc) -> None:
    """Nothing the command printed is a Python traceback or a Dagster stack trace."""
    said = proc.stdout + proc.stderr
    assert "Traceback" not in said and "Stack Trace" not in said and 'File "' not in said, said[-5000:]


def refused(proc, *parts: str) -> str:
    """A refusal: exit 2, its message the stderr's end, with every part (what failed, the fix), no traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    no_trace(proc)
    message = proc.stderr[proc.stderr.rindex("ghostvis: error: ") :]
    for part in parts:
        assert part in message, message
    return message


def dagster_refused(proc, step: str, *parts: str) -> str:
    """A refusal of the README's `dagster asset materialize`: exit 1, no traceback, and the run's last line of
    GhostVis's is `<step> failed: <message>` with every part, before Dagster's own last line."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    no_trace(proc)
    *_, ours, dagsters = proc.stderr.rstrip("\n").splitlines()
    assert dagsters == "Error: Materialization failed." and ours.startswith(f"{step} failed: "), proc.stderr[-3000:]
    for part in parts:
        assert part in ours, ours
    return ours


def test_own_data_from_an_empty_folder_through_pretrain_sft_dpo_rl(tmp_path):
    root, home = tmp_path / "data", tmp_path / "my-home"
    user_data(root)
    (root / "sources.yaml").write_text(sources_yaml(root))
    ghostvis(home, "init")
    list_sources(home, root)

    # a chat file edited after the listing: refused with the re-listing fix, which passes
    edited = root / "chats" / "00000.jsonl"
    edited.write_text(
        edited.read_text()
        + json.dumps({"messages": [{"role": "user", "content": "one more?"}, {"role": "assistant", "content": "yes"}]})
        + "\n"
    )
    refused(ghostvis(home, "data", check=False), "my_chats/00000", "size mismatch", "re-materialize shard_manifest")
    one_shard = ("dagster", "asset", "materialize", "-m", "ghostvis_pipeline.definitions", "--select", "raw_shards")
    said = run(home, *one_shard, "--partition", "my_chats/00000", check=False)
    dagster_refused(said, "raw_shards", "my_chats/00000", "size mismatch", "re-materialize shard_manifest")
    list_sources(home, root)
    out = ghostvis(home, "data").stdout
    assert "my_pairs/00000" in out and "dropped: exact_duplicate 1" in out  # the duplicate pair, counted
    assert "note: tokenizer " in out and "fewer than the 4,096 the tiny preset plans" in out
    ledger = Ledger.in_store(Home(home).store)
    pairs = {r.shard_id: r for r in ledger.shards() if r.source == "my_pairs"}
    assert sum(r.docs for r in pairs.values()) == 96  # 97 rows, one exact duplicate: several pairs per prompt kept

    # a plan beyond the data: the pre-flight's refusal and fix, before anything launches; the fix passes
    beyond = ghostvis(home, "plan", "--recipe", "my_texts=1.0", "--steps", "400", check=False)
    refused(beyond, "would be refused at launch: pre-flight failed: source my_texts", "data.allow_repeat=true")
    ghostvis(home, "plan", "--recipe", "my_texts=1.0", "--steps", "400", "--set", "data.allow_repeat=true")

    trained = {}
    for stage, source in (("pretrain", "my_texts"), ("sft", "my_chats"), ("dpo", "my_pairs"), ("rl", "my_problems")):
        trained[stage] = ghostvis(home, "train", stage, "--recipe", f"{source}=1.0", "--set", "budget.steps=2").stdout
    assert_checked_and_aliased(home)
    assert_reward_signal_said(home, trained["rl"])
    ledger_out = ghostvis(home, "ledger").stdout
    for stage in LINEAGE.split(","):
        (line,) = [row for row in ledger_out.splitlines() if row.startswith(f"{stage} ")]
        assert line.endswith(" passed"), line
    ghostvis(home, "audit")
    chat = run(home, "ghostvis", "chat", "--stage", "sft", "--max-tokens", "16", stdin="amber basil?\nwillow yew?\n")
    assert len(chat.stdout.splitlines()) == 2 and "<|" not in chat.stdout


def assert_checked_and_aliased(home: Path) -> None:
    """Every stage's alias is on the version of its newest run, tagged passed with its MLflow run: the checks
    decided it after the job registered the version pending."""
    from mlflow.tracking import MlflowClient

    from ghostvis_core.runs.lookup import newest_completed_run

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    for stage in LINEAGE.split(","):
        version = client.get_model_version_by_alias("ghostvis", stage)
        assert version.tags["ghostvis.run_key"] == newest_completed_run(Home(home).store, stage).run_key
        run_tags = client.get_run(version.run_id).data.tags
        assert version.tags["ghostvis.checks"] == "passed" == run_tags["ghostvis.checks"]


def assert_reward_signal_said(home: Path, said: str) -> None:
    """rl after dpo on the walk's problems: `ghostvis train rl` warns, with an example completion, exactly when
    none of the completions the ledger saved earned a reward."""
    from ghostvis_core.runs.lookup import newest_completed_run

    store = Home(home).store
    ledger = Ledger.in_store(store)
    records = ledger.rollouts(ledger.chain(newest_completed_run(store, "rl").run_key))
    completions = sum(len(r.rewards) for r in records)
    assert completions > 0
    if any(reward > 0 for r in records for reward in r.rewards):
        assert "warning:" not in said
        return
    # what the policy wrote first, as the warning quotes it
    from ghostvis_core.data.bpe_tokenizer import load_tokenizer
    from ghostvis_core.verify.audit.reward_signal import EXAMPLE_CHARS

    run_key = newest_completed_run(store, "rl").run_key
    (tokenizer_id,) = {r.tokenizer_id for r in ledger.shards() if r.source == "my_problems"}
    text = load_tokenizer(tokenizer_id, store).decode(records[0].completion_ids[0])
    example = text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + "..."
    (warning,) = [line for line in said.splitlines() if line.startswith("warning: ")]
    assert warning.startswith(
        f"warning: rl run {run_key}: none of its {completions:,} sampled completions earned a reward, so every "
        "advantage was 0 and no step changed the weights. The reward rule (my_problems: integer) gives 1 for the "
        "problem's answer and 0.1 when a completion's last non-empty line is an integer and nothing else (e.g. `42`); "
        f"step {records[0].step}, row {records[0].rows[0]} wrote {example!r}."
    ), warning
    assert "set grpo.stop_at_answer=true" in warning and "(README: rl on your own problems)" in warning
