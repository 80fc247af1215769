"""lm-evaluation-harness on a trained stage: `GhostvisLM`, an `lm_eval` model (registered as
`ghostvis`) around a TrainedStage, and `run_tasks`, which runs harness tasks on it: GhostVis's own
(ghostvis_core/resources/lm_eval_tasks: multiple choice on capitals and on arithmetic, a next-word
cloze on held-out text) or any task the user's harness knows (a standard one where the machine has
its data, or a folder of the user's YAML).

Requests follow the harness's conventions (its TemplateLM): a context's trailing spaces move to the
continuation, the pair is encoded whole and split at the context's length, every sequence starts
with <|bos|> (an empty context is <|bos|> alone), and an input longer than the model's context is
cut from the left, as GhostVis's documents start with <|bos|> in training.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.defaults import DEFAULT_OTHER_SEED
from lm_eval.evaluator import evaluate
from lm_eval.models.utils import normalize_gen_kwargs, postprocess_generated_text
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, handle_non_serializable, make_disjoint_window

from ghostvis_core.errors import GhostvisError
from ghostvis_core.home import Home
from ghostvis_core.run.trained_model import TrainedStage, load_stage
from ghostvis_core.verify.eval.harness_tasks import CLOZE_TASK, DEFAULT_TASKS, TASKS_DIR

BATCH_ROWS, MAX_GEN_TOKS, GEN_CHUNK = 32, 256, 32


@register_model("ghostvis")
class GhostvisLM(TemplateLM):
    """A GhostVis decoder as an `lm_eval` model; from Python `GhostvisLM(load_stage(...))`, from the
    harness's CLI `--model ghostvis --model_args home=<GHOSTVIS_HOME>,stage=sft[,run_key=...]`."""

    def __init__(
        self,
        trained: TrainedStage | None = None,
        home: str | None = None,
        stage: str | None = None,
        run_key: str | None = None,
        batch_size: int | str | None = None,
        device: str | None = None,
    ):
        super().__init__()
        if trained is None:
            if not (home and stage):
                raise GhostvisError(
                    "lm_eval model ghostvis: name the model with model_args "
                    "home=<GHOSTVIS_HOME>,stage=<stage> (and run_key=<run> for an older run)"
                )
            trained = load_stage(Home(Path(home)), stage, run_key)
        self.trained, self.tok = trained, trained.tok
        self._device = torch.device(device or "cpu")
        self.model = trained.model.to(self._device).eval()
        self.batch_rows = int(batch_size or BATCH_ROWS)

    @property
    def eot_token_id(self) -> int:
        return self.tok.eot

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos

    @property
    def max_length(self) -> int:
        return self.trained.config.model.max_seq_len

    @property
    def tokenizer_name(self) -> str:
        return self.tok.tokenizer_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Text as ordinary tokens, after <|bos|> unless add_special_tokens is False."""
        ids = self.tok.encode(string)
        return ids if add_special_tokens is False else [self.tok.bos, *ids]

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tok.decode([t for t in tokens if t not in (self.tok.bos, self.tok.eot)])

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of log p(continuation token), all of them greedy) per (key, context ids, continuation
        ids); rows of similar length are scored together, right-padded (padding cannot be attended)."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for a in range(0, len(order), self.batch_rows):
            batch = order[a : a + self.batch_rows]
            for i, answer in zip(batch, self._score([requests[i][1:] for i in batch])):
                out[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return out

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        rows = []
        for context, continuation in pairs:
            if not continuation or len(continuation) > self.max_length:
                raise GhostvisError(
                    f"lm_eval request: a continuation of {len(continuation)} tokens does not fit "
                    f"stage {self.trained.stage}'s context of {self.max_length}"
                )
            rows.append(((context + continuation)[-(self.max_length + 1) :][:-1], continuation))
        x = torch.zeros(len(rows), max(len(inp) for inp, _ in rows), dtype=torch.long)
        for r, (inp, _) in enumerate(rows):
            x[r, : len(inp)] = torch.tensor(inp)
        h = self.model.hidden(x.to(self._device))  # the logits of the continuation positions only, below
        picked = torch.cat([h[r, len(inp) - len(cont) : len(inp)] for r, (inp, cont) in enumerate(rows)])
        logp = F.log_softmax(self.model.lm_head(picked).float(), dim=-1).split([len(c) for _, c in rows])
        out = []
        for lp, (_, cont) in zip(logp, rows):
            target = torch.tensor(cont, device=lp.device)
            out.append((float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood after <|bos|>, in the harness's disjoint windows of the model's
        context (every token predicted once, with as much context as fits)."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            ids = self.tok_encode(text, add_special_tokens=False)
            for context, continuation in map(
                make_disjoint_window, get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, 1)
            ):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in (req.args for req in requests):
            text = self._generate(context, gen_kwargs)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def _generate(self, context: str, gen_kwargs: dict) -> str:
        """KV-cached generation (greedy unless the task samples) in chunks, until a stop string, <|eot|>,
        <|bos|> or max_gen_toks; the context keeps its last (max_length - max_gen_toks) tokens."""
        kw = normalize_gen_kwargs(gen_kwargs, MAX_GEN_TOKS)
        until, budget = kw["until"], kw["max_gen_toks"]
        if budget >= self.max_length:
            raise GhostvisError(
                f"lm_eval request: max_gen_toks {budget} must be below stage {self.trained.stage}'s "
                f"context of {self.max_length} tokens; lower it in the task's generation_kwargs"
            )
        prompt, stops, out = self.tok_encode(context)[-(self.max_length - budget) :], (self.tok.eot, self.tok.bos), []
        while len(out) < budget:
            step = self.model.generate(
                prompt + out,
                min(GEN_CHUNK, budget - len(out)),
                temperature=float(kw.get("temperature", 0.0)),
                stop_tokens=stops,
            )
            out += step
            if not step or step[-1] in stops or any(u and u in self.tok_decode(out) for u in until):
                break
        return postprocess_generated_text(self.tok_decode(out), until, None)


def load_shipped(data_files: dict[str, str], **_metadata) -> datasets.DatasetDict:
    """`custom_dataset` of GhostVis's task YAML: JSON Lines files next to the YAML (TASKS_DIR). The harness
    would hand `dataset_kwargs` to `datasets.load_dataset`, which reads relative files from the working
    directory; reading them from a known folder lets the tasks run from anywhere, never online."""
    return _json_files(TASKS_DIR, data_files)


def load_held_out(data_files: dict[str, str], held_out_dir: str | None = None, **_metadata) -> datasets.DatasetDict:
    """`custom_dataset` of the cloze task: files written at evaluation time from the home's validation
    shards (held out from training by the ledger), in the folder named by task metadata `held_out_dir`."""
    if not held_out_dir:
        raise GhostvisError(
            f"lm_eval task {CLOZE_TASK} reads held-out text that GhostVis's evaluation writes "
            f"(cloze_jsonl); pass task metadata held_out_dir=<folder holding "
            f"{', '.join(data_files.values())}>, e.g. "
            f'lm_eval --metadata \'{{"held_out_dir": "DIR"}}\''
        )
    return _json_files(Path(held_out_dir), data_files)


def _json_files(folder: Path, data_files: dict[str, str]) -> datasets.DatasetDict:
    files = {split: folder / name for split, name in data_files.items()}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        raise GhostvisError(f"lm_eval task data {', '.join(missing)} missing; write it first (or fix data_files)")
    return datasets.load_dataset("json", data_files={split: str(f) for split, f in files.items()})


@dataclass(frozen=True)
class HarnessRun:
    """The harness's own output (JSON-ready, per-sample records included) and the per-task metrics
    read from it: task -> metric (`acc`, or `<metric>/<filter>` for a filter other than `none`) -> value."""

    metrics: dict[str, dict[str, float]]
    results: dict[str, Any]


def run_tasks(
    lm: GhostvisLM,
    tasks: Sequence[str],
    include: Sequence[str] = (),
    held_out_dir: Path | None = None,
    limit: int | None = None,
) -> HarnessRun:
    """Run harness tasks on `lm` through lm_eval's evaluator, set up as simple_evaluate sets it up
    (zero-shot unless the task says otherwise, the harness's fewshot seed) but without its
    environment report, which costs seconds per call; no bootstrap stderr. `held_out_dir` holds the
    held-out files GhostVis's cloze task reads (cloze_jsonl)."""
    manager = task_manager(tasks, include, {"held_out_dir": str(held_out_dir)} if held_out_dir else None)
    loaded = manager.load(list(tasks))
    for task in loaded["tasks"].values():
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    raw = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=True)
    results = json.loads(json.dumps(raw, default=handle_non_serializable))
    return HarnessRun(task_metrics(results), results)


def task_manager(tasks: Sequence[str], include: Sequence[str], metadata: dict | None) -> TaskManager:
    """GhostVis's tasks and the user's folders; the harness's own thousands of tasks are indexed (slow)
    only when a task is named that neither holds."""
    paths = [str(TASKS_DIR), *(str(Path(p).expanduser().resolve()) for p in include)]
    manager = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    if set(tasks) <= set(manager.all_tasks):
        return manager
    manager = TaskManager(include_path=paths, metadata=metadata)
    unknown = sorted(set(tasks) - set(manager.all_tasks))
    if unknown:
        raise GhostvisError(
            f"lm_eval tasks {', '.join(unknown)} are unknown: not GhostVis's "
            f"({', '.join(DEFAULT_TASKS)}), not in harness_include {list(include)} and not among "
            f"the harness's tasks; fix the name or add the folder holding its YAML to harness_include"
        )
    return manager


def task_metrics(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """task -> metric -> value from the harness's `results` (stderr and alias entries left out)."""
    out: dict[str, dict[str, float]] = {}
    for task, row in results["results"].items():
        for key, value in row.items():
            name, _, filt = key.partition(",")
            if filt and not name.endswith("_stderr") and isinstance(value, (int, float)):
                out.setdefault(task, {})[name if filt == "none" else f"{name}/{filt}"] = float(value)
    return out
