"""`ghostvis plan --recipe` plans the data in the home as the launch will: a fresh model priced at its
tokenizer's vocabulary (said when the tokenizer is smaller than the preset plans), and a budget the
pre-flight would refuse refused here with the pre-flight's own message and fix (exit 2); the fix passes."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest

from ghostvis_core.data.bpe_tokenizer import save_tokenizer, train_tokenizer
from ghostvis_core.home import Home
from ghostvis_core.plan.budget import shortfall
from ghostvis_core.plan.presets import padded_vocab, tokenizer_vocab
from ghostvis_pipeline.cli import main
from tests.raw_shards import raw_shard_job, tokenize_here

WORDS = "amber basil cedar dune ember fjord grove heath inlet juniper knoll larch marsh nettle".split()


@pytest.fixture
def small_home(tmp_path, monkeypatch):
    """A home with one tokenized text source `web` (one train shard) and a tokenizer trained on it at the tiny
    preset's vocabulary: the text is too small to learn that many merges."""
    rng = random.Random(3)
    texts = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(300)]
    store = Home(tmp_path / "home").store
    tok = train_tokenizer(texts, tokenizer_vocab("tiny"))
    save_tokenizer(tok, store)
    tokenize_here([raw_shard_job(store, "web/00000", pa.table({"text": texts}))], store, tok.tokenizer_id, tmp_path)
    monkeypatch.setenv("GHOSTVIS_HOME", str(tmp_path / "home"))
    return tok


def plan_json(capsys, *args: str) -> tuple[int, dict, str]:
    rc = main(["plan", "--preset", "tiny", "--recipe", "web=1.0", *args, "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def test_the_plan_prices_the_tokenizers_vocabulary_and_says_it_is_smaller(small_home, capsys):
    tok = small_home
    assert tok.vocab_size < tokenizer_vocab("tiny")
    rc, plan, _ = plan_json(capsys, "--steps", "1")
    assert rc == 0
    assert plan["notes"] == [
        f"tokenizer {tok.tokenizer_id} has {tok.vocab_size:,} tokens, fewer than the 4,096 the tiny preset plans "
        f"(the text holds too few distinct pairs to merge that often): a new model is built and priced with "
        f"vocab_size {padded_vocab(tok.vocab_size):,} ({tok.vocab_size:,} padded to 64); more text or the "
        f"tokenizer asset's vocab_size changes it"
    ]
    assert main(["plan", "--preset", "tiny", "--steps", "1", "--vocab-size", str(padded_vocab(tok.vocab_size)),
                 "--json"]) == 0  # fmt: skip
    assert plan["params_total"] == json.loads(capsys.readouterr().out)["params_total"]


def test_a_budget_the_preflight_refuses_is_refused_by_the_plan_with_its_fix(small_home, capsys):
    rc, plan, err = plan_json(capsys, "--steps", "12")
    (source,) = plan["sources"]
    assert source["needed_tokens"] > source["available_tokens"] > 0
    assert rc == 2
    refusal = shortfall("web", source["needed_tokens"], source["available_tokens"], 1)
    assert plan["refused_at_launch"] == [refusal]
    assert err == f"ghostvis: error: this run would be refused at launch: pre-flight failed: {refusal}\n"
    assert "set data.allow_repeat=true" in refusal
    rc, plan, err = plan_json(capsys, "--steps", "12", "--set", "data.allow_repeat=true")  # the fix
    assert (rc, err, "refused_at_launch" in plan) == (0, "", False)


def test_the_plan_refuses_what_the_preflight_refuses_with_the_same_message(home_copy, monkeypatch, capsys):
    """On the demo home: 5,000 smoke pretrain steps over demo_prose and demo_code need more than is tokenized;
    the plan's refusal is the job's pre-flight refusal, to the token and the word."""
    from ghostvis_core.errors import GhostvisError
    from ghostvis_core.launch.start import prepare_run
    from ghostvis_core.run.preflight import check_run

    home = Home(home_copy)
    monkeypatch.setenv("GHOSTVIS_HOME", str(home_copy))
    with pytest.raises(GhostvisError) as refused:
        check_run(prepare_run("pretrain", preset="smoke", home=home, overrides={"budget.steps": "5000"}), home.store)
    argv = ["plan", "--preset", "smoke", "--recipe", "demo_prose=0.5,demo_code=0.5", "--steps", "5000"]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"ghostvis: error: this run would be refused at launch: {refused.value}\n"
