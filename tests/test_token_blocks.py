"""Token files verified as they are read (data/token_blocks.py): tokenization writes a digest per block of
BLOCK_TOKENS tokens into the file; the loader's stream checks a block the first time it reads it, so a
block changed on disk stops the read that would hand its tokens to the model, naming the shard, the file,
the block and the fix. The shard here is three blocks of uint16 ids, changed in place byte by byte (bit rot)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.data.stream import SourceStream
from ghostvis_core.data.token_blocks import BLOCK_TOKENS, TokenBlocks
from ghostvis_core.data.token_shard import TokenShard, list_column
from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.runs.lookup import completed_runs
from tests.conftest import run_cli
from tests.test_loader import write_shard

DOC = 1000  # tokens per document: three blocks hold 2 full blocks and a partial third
TOKENS = 2 * BLOCK_TOKENS + 5 * DOC


def ids(n: int) -> list[int]:
    """Seeded random token ids: every 8-token run is unique in the file, so its bytes are found once."""
    return np.random.default_rng(0).integers(0, 65536, TOKENS).tolist()[:n]


@pytest.fixture
def shard(tmp_path):
    flat = ids(TOKENS)
    docs = [flat[i : i + DOC] for i in range(0, TOKENS, DOC)]
    return write_shard(tmp_path, "web", "web/00003", docs)


def rot(path: Path, token: int) -> None:
    """Move the id of shard-local token `token` by one in the file's bytes, in place: same name, size, rows
    and lengths. Its place is found from the file's own layout (the tokens buffer inside the IPC file)."""
    data = bytearray(path.read_bytes())
    whole = pa.py_buffer(bytes(data))
    tokens = pa.ipc.open_file(whole).get_batch(0).column("tokens")
    values = tokens.values.buffers()[1]
    width = tokens.values.type.bit_width // 8
    at = values.address - whole.address + (tokens.values.offset + tokens.offsets[0].as_py() + token) * width
    data[at] ^= 1
    path.write_bytes(bytes(data))


def test_the_file_holds_one_digest_per_block_of_its_tokens(shard):
    opened = TokenShard.open(Path(shard.path), shard.shard_id)
    digests = opened.blocks.digests
    assert digests.block_tokens == BLOCK_TOKENS and len(digests.sha256) == 3
    assert digests == TokenBlocks.of(np.asarray(ids(TOKENS), np.uint16))


def test_a_block_changed_on_disk_stops_the_read_that_would_use_it_naming_shard_file_block_and_fix(shard):
    rot(Path(shard.path), BLOCK_TOKENS + 300)
    stream = SourceStream("web", [shard], 0)
    before, _ = stream.read(0, BLOCK_TOKENS)  # block 0 is intact: read and checked
    assert before.tolist() == ids(BLOCK_TOKENS)
    after, _ = stream.read(2 * BLOCK_TOKENS, TOKENS)  # so is block 2
    assert after.tolist() == ids(TOKENS)[2 * BLOCK_TOKENS :]
    with pytest.raises(GhostvisError) as err:
        stream.read(BLOCK_TOKENS - 4, BLOCK_TOKENS + 4)  # four tokens of block 1 are enough
    message = str(err.value)
    assert message.startswith("token shard web/00003: block 1 (tokens 65,536-131,072) of file ")
    assert shard.path in message
    want = TokenBlocks.of(np.asarray(ids(TOKENS), np.uint16)).sha256[1]
    assert re.search(rf"expected {want}, got [0-9a-f]{{64}}\)", message)
    assert message.endswith("re-materialize tokenized_shards partition web/00003")
    assert stream.shard(shard).blocks.checked == {0, 2}


def test_each_block_is_hashed_once_however_often_it_is_read(shard, monkeypatch):
    stream = SourceStream("web", [shard], 0)
    stream.read(0, 10)
    hashed = []
    monkeypatch.setattr("ghostvis_core.data.token_blocks.block_sha256", lambda b: hashed.append(len(b)) or "")
    for start in range(0, BLOCK_TOKENS - 10, 4096):  # block 0 again: checked already
        stream.read(start, start + 10)
    assert hashed == []
    assert stream.shard(shard).blocks.checked == {0}


def test_a_token_file_written_without_block_digests_is_refused_when_read(tmp_path):
    path = tmp_path / "old.arrow"
    table = pa.table({"row": pa.array([0], pa.int64()), "tokens": list_column([4], [1, 2, 3, 4], np.uint16)})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    shard = TokenShard.open(path, "web/00001")
    with pytest.raises(GhostvisError, match=r"token shard web/00001: file .*old\.arrow has no block digests"):
        shard.slice(0, 2)


@pytest.mark.e2e
def test_a_token_file_block_rewritten_in_place_stops_the_next_stage_before_its_first_step(home_copy):
    """The demo's first pretrain shard, one id of its block 0 moved by one on disk (bit rot): a new pretrain
    run (`ghostvis train`, its job under torchrun) refuses before step 1, naming the shard, the file and the
    block, commits nothing, and is launched once: a problem of its inputs is no fault for the stage's retry.
    A developer's prebuilt demo home (GHOSTVIS_TEST_DEMO_HOME) may predate the block digests: `ghostvis data`
    gives its token files them first. The session's own demo home is built by this code and has them."""
    if os.environ.get("GHOSTVIS_TEST_DEMO_HOME"):
        run_cli(["ghostvis", "data"], home_copy)
    h = Home(home_copy)
    ledger = Ledger.in_store(h.store)
    first = ledger.consumption(ledger.chain(completed_runs(h.store, "pretrain")[-1].run_key)[:1])[0]
    assert (first.shard_id, first.tok_start) == ("demo_code/00000", 0)  # what step 1 of a pretrain run reads
    [record] = [r for r in ledger.shards() if r.shard_id == first.shard_id]
    path = Path(record.token_path)
    before = TokenShard.open(path, first.shard_id).slice(0, 3001).copy()
    rot(path, 3000)
    after = np.asarray(pa.ipc.open_file(str(path)).get_batch(0).column("tokens").values)[:3001]
    assert after.tolist() == [*before[:3000].tolist(), int(before[3000]) ^ 1]  # the one id moved, nothing else
    parts_before = ledger.parts(stage="pretrain")
    proc = run_cli(["ghostvis", "train", "pretrain", "--set", "budget.steps=4"], home_copy, check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert said.count("launching: ") == 1 and "STEP_UP_FOR_RETRY" not in said, said[-4000:]
    assert "not retried: a problem of the run's inputs or settings, which every retry would meet again" in said
    assert (
        f"token shard demo_code/00000: block 0 (tokens 0-{min(BLOCK_TOKENS, record.tokens):,}) of file {path} does "
        "not match the digest written at tokenization (expected "
    ) in said
    assert "delete it and re-materialize tokenized_shards partition demo_code/00000" in said
    assert "step 1/4" not in said
    assert Ledger.in_store(h.store).parts(stage="pretrain") == parts_before  # no part, so no checkpoint, committed
