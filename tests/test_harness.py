"""lm-evaluation-harness on GhostVis models: the `ghostvis` lm_eval model scores requests exactly as
GhostVis's own model code does (harness tokenization conventions, left truncation, rolling windows,
stop strings); a shipped task run by the harness gives the accuracy its per-sample records give; and
on the demo, the sft stage's harness figures in Dagster, MLflow and the report equal the harness's
saved output."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from ghostvis_core.data.bpe_tokenizer import train_tokenizer
from ghostvis_core.home import Home
from ghostvis_core.plan.config import ModelConfig
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.verify.eval.harness import GhostvisLM, run_tasks, task_metrics
from ghostvis_core.verify.eval.harness_tasks import CLOZE_FILE, TASKS_DIR, cloze_jsonl
from tests.conftest import run_cli

SEQ = 32
TEXTS = [
    "The capital of France is Paris. The capital of Spain is Madrid. The capital of Peru is Lima.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Step 1: 12 + 7 = 19. Step 2: 19 + 3 = 22. The answer is 22.",
] * 20


@pytest.fixture(scope="module")
def tiny():
    """A TrainedStage-shaped record: a random 2-layer model of context SEQ and a trained tokenizer."""
    tok = train_tokenizer(TEXTS, 400)
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=SEQ
    )
    return SimpleNamespace(stage="tiny", model=GPT(cfg).eval(), tok=tok, config=SimpleNamespace(model=cfg))


def req(kind: str, *args) -> Instance:
    return Instance(kind, {}, args, 0)


def own_loglikelihood(ts, context: str, continuation: str) -> tuple[float, bool]:
    """GhostVis's own model code: log p(continuation tokens) summed (reduction="logprobs"), and whether
    each is the argmax, over the last SEQ positions of <|bos|> + context + continuation."""
    ids = [ts.tok.bos, *ts.tok.encode(context + continuation)]
    n_cont = len(ids) - 1 - len(ts.tok.encode(context)) if context else len(ids) - 1
    window = torch.tensor(ids[-(SEQ + 1) :])
    x, y = window[None, :-1], window[None, 1:].clone()
    y[0, : y.shape[1] - n_cont] = -1
    with torch.no_grad():
        lp = ts.model(x, y, reduction="logprobs")
        greedy = ts.model(x).argmax(-1)[0, -n_cont:]
    return float(lp.sum()), bool((greedy == window[-n_cont:]).all())


def test_loglikelihood_equals_ghostvis_log_prob_sums_with_spaces_empty_and_long_contexts(tiny):
    long_context = " ".join(["The capital of Spain is Madrid."] * 20)  # far more than SEQ tokens
    assert len(tiny.tok.encode(long_context)) > 3 * SEQ
    pairs = [
        ("The capital of France is", " Paris"),
        ("Step 1: 12 + 7 =", " 19."),
        ("", "def add(a, b):"),
        (long_context + " The capital of France is", " Paris."),
        ("print(add", "(2, 3))"),
    ]
    got = GhostvisLM(tiny, batch_size=2).loglikelihood([req("loglikelihood", c, x) for c, x in pairs])
    for (context, continuation), (ll, greedy) in zip(pairs, got):
        want_ll, want_greedy = own_loglikelihood(tiny, context, continuation)
        assert math.isclose(ll, want_ll, rel_tol=1e-5, abs_tol=1e-5), (context[-30:], continuation, ll, want_ll)
        assert greedy == want_greedy
    # the harness moves a context's trailing space into the continuation: the same request
    moved = GhostvisLM(tiny).loglikelihood([req("loglikelihood", "The capital of France is ", "Paris")])
    assert moved[0][0] == pytest.approx(got[0][0], abs=1e-6)
    assert got[0][0] < 0 and got[3][0] != got[0][0]  # the long context changes the score


def test_loglikelihood_rolling_is_the_models_summed_nll_in_disjoint_windows(tiny):
    lm = GhostvisLM(tiny, batch_size=3)
    short, long = TEXTS[0][:60], " ".join(TEXTS[:3]) * 2
    ids_short, ids_long = tiny.tok.encode(short), tiny.tok.encode(long)
    assert len(ids_short) < SEQ < 3 * SEQ < len(ids_long)
    with torch.no_grad():
        seq = torch.tensor([[tiny.tok.bos, *ids_short]])
        want_short = -float(tiny.model(seq[:, :-1], seq[:, 1:], reduction="sum"))
        full, want_long, done = [tiny.tok.bos, *ids_long], 0.0, 0
        while done < len(ids_long):  # each token once, after the SEQ tokens before it (or all there are)
            end = min(done + SEQ, len(ids_long))
            x = torch.tensor([full[max(0, end - SEQ) : end]])
            y = torch.tensor([full[max(0, end - SEQ) + 1 : end + 1]])
            y[0, : y.shape[1] - (end - done)] = -1
            want_long -= float(tiny.model(x, y, reduction="sum"))
            done = end
    got = lm.loglikelihood_rolling([req("loglikelihood_rolling", short), req("loglikelihood_rolling", long)])
    assert got == pytest.approx([want_short, want_long], rel=1e-5)


def test_generate_until_stops_at_the_first_stop_string(tiny):
    lm = GhostvisLM(tiny)
    prompt = [tiny.tok.bos, *tiny.tok.encode("The capital of France is")]
    free = tiny.model.generate(prompt, 12, stop_tokens=(tiny.tok.eot, tiny.tok.bos))
    assert len(free) == 12  # nothing stops it early, so a stop string is what ends it below
    text = lm.tok_decode(free)
    stop = lm.tok_decode(free[5:6])
    assert stop and text.index(stop) > 0
    got = lm.generate_until(
        [
            req("generate_until", "The capital of France is", {"until": [stop], "max_gen_toks": 12}),
            req("generate_until", "The capital of France is", {"until": ["\x00"], "max_gen_toks": 12}),
        ]
    )
    assert got == [text[: text.index(stop)], text]


def recount(samples: list[dict]) -> float:
    """Accuracy from the harness's per-sample records: the highest log-likelihood choice is the target."""
    right = [max(range(len(s["resps"])), key=lambda i: s["resps"][i][0][0]) == s["target"] for s in samples]
    return sum(right) / len(right)


def test_a_shipped_task_through_simple_evaluate_gives_the_accuracy_of_its_samples(tiny):
    lm = GhostvisLM(tiny)
    out = simple_evaluate(
        model=lm,
        tasks=["ghostvis_capitals"],
        bootstrap_iters=0,
        log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
    )
    samples = out["samples"]["ghostvis_capitals"]
    assert len(samples) == 36
    assert out["results"]["ghostvis_capitals"]["acc,none"] == recount(samples)
    first = samples[0]  # the records hold the wrapper's own scores of "<context>" + " <choice>"
    assert first["resps"][0][0][0] == pytest.approx(
        own_loglikelihood(tiny, first["doc"]["context"], " " + first["doc"]["choices"][0])[0], abs=1e-5
    )
    # run_tasks (the evaluator, as the evaluation asset calls it) gives the same figures
    assert run_tasks(lm, ["ghostvis_capitals"]).metrics == {"ghostvis_capitals": task_metrics(out)["ghostvis_capitals"]}


def test_the_held_out_cloze_scores_greedy_last_words_and_perplexity(tiny, tmp_path):
    texts = {
        "prose": [
            "A river runs to the sea. " * 3 + "\n\nThe sea is wide and deep and the river is long and "
            "slow and cold and the river meets the sea at last, where every river ends."
        ]
    }
    (tmp_path / CLOZE_FILE).write_text(cloze_jsonl(texts))
    item = json.loads((tmp_path / CLOZE_FILE).read_text().splitlines()[0])
    assert item["target"] == " river" and item["context"].endswith("where every")
    run = run_tasks(GhostvisLM(tiny), ["ghostvis_cloze"], held_out_dir=tmp_path)
    samples = run.results["samples"]["ghostvis_cloze"]
    lls = [s["resps"][0][0] for s in samples]
    assert run.metrics["ghostvis_cloze"]["acc"] == sum(bool(r[1]) for r in lls) / len(lls)
    assert run.metrics["ghostvis_cloze"]["perplexity"] == pytest.approx(math.exp(-sum(r[0] for r in lls) / len(lls)))


@pytest.mark.e2e
def test_sft_harness_figures_in_dagster_mlflow_and_the_report_equal_the_saved_harness_output(home_copy):
    from dagster import AssetKey, DagsterInstance
    from mlflow.tracking import MlflowClient

    run_cli(
        ["dagster", "asset", "materialize", "--select", "evaluation,report", "-m", "ghostvis_pipeline.definitions"],
        home_copy,
    )
    os.environ["DAGSTER_HOME"] = str(home_copy / "dagster")
    instance = DagsterInstance.get()

    def latest(asset):
        ev = instance.get_latest_materialization_event(AssetKey(asset))
        return {k: getattr(v, "value", v) for k, v in ev.asset_materialization.metadata.items()}

    evaluation, report = latest("evaluation"), latest("report")
    store = Home(home_copy).store
    saved = store.read_json("report", f"evaluation/{evaluation['identity']}/harness/sft.json")
    acc = saved["results"]["ghostvis_capitals"]["acc,none"]
    assert acc == recount(saved["samples"]["ghostvis_capitals"])
    assert evaluation["harness"]["sft"] == task_metrics(saved)
    assert evaluation["harness"]["sft"]["ghostvis_capitals"]["acc"] == acc
    assert set(evaluation["harness"]["sft"]) == {"ghostvis_capitals", "ghostvis_arithmetic", "ghostvis_cloze"}

    client = MlflowClient(Home(home_copy).mlflow_tracking_uri)
    sft_run = store.read_json("report", f"evaluation/{evaluation['identity']}.json")["sft"]
    row = next(
        r for r in json.loads(Path(report["report_html"]).with_name("report.json").read_text()) if r["stage"] == "sft"
    )
    assert row["run_key"] == sft_run["run_key"]
    metrics = client.get_run(row["mlflow_run_id"]).data.metrics
    for task, values in task_metrics(saved).items():
        for name, value in values.items():
            assert metrics[f"harness/{task}/{name}"] == value
    assert row["evaluation"]["harness"] == task_metrics(saved)
    html = Path(report["report_html"]).read_text()
    assert (
        f"<tr data-stage='sft'><td data-col='stage'>sft</td><td data-col='task'>ghostvis_capitals</td>"
        f"<td data-col='metric'>acc</td><td data-col='value'>{acc:,.4g}</td></tr>"
    ) in html
