"""Hugging Face format both ways: export parity (logits, greedy generation, tokenizer ids, chat
template), import of transformers-built Llama / Qwen2 checkpoints, round trips, refused imports."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ghostvis_core.data.bpe_tokenizer import train_tokenizer
from ghostvis_core.data.chat import render_chat, render_prompt
from ghostvis_core.errors import GhostvisError
from ghostvis_core.plan.config import ModelConfig
from ghostvis_core.run.hf.export import export_model
from ghostvis_core.run.hf.imports import IMPORT_STAGE, import_checkpoint, load_hf_model
from ghostvis_core.run.model.gpt import GPT
from ghostvis_core.run.train import checkpoint as ckpt
from ghostvis_core.runs.lookup import checkpoint_of
from ghostvis_core.store import FolderStore
from tests.conftest import new_bucket, prepare_argv, prepare_stage, run_cli, s3_env

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The quick brown fox jumps over the lazy dog. 1234 5678!",
    "def f(x):\n    return x * 2\n",
    "Hello, world! It's a naive cafe, isn't it? Numbers: 3.14159 and 2718.",
] * 10
HELD_OUT = "Held-out: the lazy fox's 98765 naps.\n\n  <|user|>hi<|eot|> tabs\there <|bos|>end"
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what's 2+2? <|image|>"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "and 3+3?"},
]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, 400)


def tiny(tok, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=448, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=128, **kw
    )
    return GPT(cfg).eval()


def batch() -> torch.Tensor:
    return torch.randint(0, 400, (2, 48), generator=torch.Generator().manual_seed(1))


def hf_load(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "kw",
    [{}, {"tie_embeddings": True}, {"rope_scaling": 4.0}, {"qkv_bias": True}],
    ids=["untied", "tied", "rope-linear", "qkv-bias"],
)
def test_export_logits_and_greedy_generation_match(tok, tmp_path, kw):
    model = tiny(tok, **kw)
    if kw.get("qkv_bias"):  # non-zero biases, so the test sees them
        for b in model.blocks:
            torch.nn.init.normal_(b.attn.wq.bias), torch.nn.init.normal_(b.attn.wkv.bias)
    export_model(model, tok, tmp_path)
    hf = hf_load(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM" if kw.get("qkv_bias") else "LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is bool(kw.get("tie_embeddings"))
    assert (config["num_key_value_heads"], config["bos_token_id"], config["eos_token_id"]) == (2, tok.bos, tok.eot)
    assert ("lm_head.weight" in load_file(tmp_path / "model.safetensors")) is not bool(kw.get("tie_embeddings"))
    x = batch()
    with torch.no_grad():
        diff = (model(x) - hf(x).logits).abs().max().item()
    assert diff <= 1e-4
    prompt = x[0, :8].tolist()
    ours = model.generate(prompt, 32)
    theirs = hf.generate(
        x[:1, :8],
        max_new_tokens=32,
        do_sample=False,
        eos_token_id=None,
        attention_mask=torch.ones(1, 8, dtype=torch.long),
    )[0, 8:].tolist()
    assert ours == theirs and len(ours) == 32
    if kw.get("rope_scaling"):  # the scaling is read by transformers: without it the logits differ
        assert config["rope_scaling"]["factor"] == 4.0 and config["rope_parameters"]["rope_type"] == "linear"
        config.pop("rope_scaling"), config.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        unscaled = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
        unscaled.load_state_dict(hf.state_dict())
        with torch.no_grad():
            assert (unscaled(x).logits - hf(x).logits).abs().max().item() > 1e-3


def test_export_shards_large_models_with_an_index(tok, tmp_path):
    export_model(tiny(tok), tok, tmp_path, max_shard_size=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((tmp_path / f).is_file() for f in files)
    x = batch()
    with torch.no_grad():
        assert (tiny(tok)(x) - hf_load(tmp_path)(x).logits).abs().max().item() <= 1e-4


def test_tokenizer_and_chat_template_give_ghostvis_ids(tok, tmp_path):
    export_model(tiny(tok), tok, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf(HELD_OUT, add_special_tokens=False)["input_ids"] == tok.enc.encode(HELD_OUT, allowed_special="all")
    assert hf("plain text")["input_ids"] == [tok.bos, *tok.encode("plain text")]  # documents start with <|bos|>
    assert hf.decode(tok.encode(HELD_OUT)) == HELD_OUT
    full = hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=False)["input_ids"]
    prompt = hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert full == render_chat(tok, CHAT)[0]
    assert prompt == render_prompt(tok, CHAT)
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("<|bos|>", "<|eot|>", "<|pad|>")


def hf_reference(arch: str, tmp_path: Path, tok, **extra) -> tuple[Path, torch.nn.Module]:
    """A randomly initialised transformers model (Llama or Qwen2) saved with save_pretrained, with
    GhostVis's tokenizer beside it (its tokenizer.json, as an import needs one)."""
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    torch.manual_seed(3)
    config = cls[0](
        vocab_size=448,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        **extra,
    )
    model = cls[1](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # non-trivial values, so a wrong mapping shows
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    folder = tmp_path / arch
    model.save_pretrained(folder)
    export_model(tiny(tok), tok, tmp_path / "tok-source")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tok-source" / name, folder / name)
    return folder, model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_import_matches_transformers_and_round_trips(arch, tok, tmp_path):
    folder, reference = hf_reference(arch, tmp_path, tok)
    ours = load_hf_model(folder)
    assert ours.cfg.qkv_bias is (arch == "qwen2") and ours.cfg.rope_base == 50000.0
    x = batch()
    with torch.no_grad():
        assert (ours(x) - reference(x).logits).abs().max().item() <= 1e-4
    export_model(ours, tok, tmp_path / "a")
    export_model(load_hf_model(tmp_path / "a"), tok, tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    original = {k: v for k, v in reference.state_dict().items() if k in a}
    assert a.keys() == b.keys() == original.keys()
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], original[k]) for k in a)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_import_into_the_store_is_a_ghostvis_checkpoint(tok, tmp_path):
    folder, reference = hf_reference("llama", tmp_path, tok, tie_word_embeddings=True)
    store = FolderStore(tmp_path / "store")
    imported = import_checkpoint(store, str(folder))
    assert imported.upstream.stage == IMPORT_STAGE and imported.tokenizer.tokenizer_id == tok.tokenizer_id
    path = checkpoint_of(store, imported.upstream.checkpoint)
    model = GPT(ModelConfig(**json.loads((path / "config.json").read_text())["model"])).eval()
    ckpt.load_model(path, model)
    x = batch()
    with torch.no_grad():
        assert (model(x) - reference(x).logits).abs().max().item() <= 1e-4
    assert import_checkpoint(store, str(folder)).upstream == imported.upstream  # converted once per content


def test_import_from_s3(tok, tmp_path, moto_s3, monkeypatch):
    import boto3

    folder, reference = hf_reference("qwen2", tmp_path, tok)
    for k, v in s3_env(moto_s3, tmp_path).items():
        monkeypatch.setenv(k, v)
    new_bucket(moto_s3, "models")
    s3 = boto3.client("s3")
    for f in folder.iterdir():
        s3.upload_file(str(f), "models", f"open/qwen-tiny/{f.name}")
    imported = import_checkpoint(FolderStore(tmp_path / "store"), "s3://models/open/qwen-tiny")
    model = GPT(load_hf_model(folder).cfg).eval()
    ckpt.load_model(checkpoint_of(FolderStore(tmp_path / "store"), imported.upstream.checkpoint), model)
    x = batch()
    with torch.no_grad():
        assert (model(x) - reference(x).logits).abs().max().item() <= 1e-4


def _break(folder: Path, how: str) -> str:
    weights = folder / "model.safetensors"
    if how == "missing":
        t = load_file(weights)
        del t["model.layers.1.mlp.up_proj.weight"]
        from safetensors.torch import save_file

        save_file(t, weights)
        return "missing tensors model.layers.1.mlp.up_proj.weight"
    if how == "shape":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
        return "model.layers.0.mlp.down_proj.weight has shape (64, 96), expected (64, 128)"
    if how == "architecture":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
        return "architecture ['MistralForCausalLM'] is not supported"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return "model.safetensors is not a readable safetensors file"


@pytest.mark.parametrize("how", ["missing", "shape", "architecture", "truncated"])
def test_broken_imports_fail_naming_the_tensors(how, tok, tmp_path):
    folder, _ = hf_reference("llama", tmp_path, tok)
    expected = _break(folder, how)
    store = FolderStore(tmp_path / "store")
    with pytest.raises(
        GhostvisError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    ):
        import_checkpoint(store, str(folder))
    assert not store.keys("checkpoints", IMPORT_STAGE)  # nothing half-imported


@pytest.mark.e2e
def test_export_command_on_the_demo_sft(home_copy, tmp_path):
    out = tmp_path / "sft-hf"
    run_cli(["ghostvis", "export", "--stage", "sft", "--to", str(out)], home_copy)
    from ghostvis_core.home import Home
    from ghostvis_core.run.trained_model import load_stage

    trained = load_stage(Home(home_copy), "sft")
    hf = hf_load(out)
    ids = render_prompt(trained.tok, CHAT)
    x = torch.tensor([ids])
    with torch.no_grad():
        assert (trained.model(x) - hf(x).logits).abs().max().item() <= 1e-4
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"] == ids
    from ghostvis_core.run.hf.vision import image_embeds, load_vision

    vision, image_id = load_vision(out), trained.tok.special("<|image|>")
    images = torch.rand(1, 3, trained.config.vision.image_size, trained.config.vision.image_size)
    prompt = torch.tensor([render_prompt(trained.tok, [{"role": "user", "content": "<|image|> what is this?"}])])
    with torch.no_grad():  # an image prompt through the vision loader and transformers = GhostVis's VLM
        expanded, embeds = image_embeds(hf, vision, prompt, images, image_id)
        ours = trained.model(expanded, images=images, image_mask=expanded == image_id)
        assert expanded.shape[1] == prompt.shape[1] + trained.config.vision.n_latents - 1
        assert (ours - hf(inputs_embeds=embeds).logits).abs().max().item() <= 1e-4


@pytest.mark.e2e
def test_a_stage_trains_from_an_imported_hf_folder(home_copy, tmp_path):
    """The trainer's first step, from an exported-then-imported pretrain, has the imported model's loss
    on that step's batch (not ~ln(vocab) of a random init)."""
    from mlflow.tracking import MlflowClient

    from ghostvis_core.home import Home
    from ghostvis_core.run.hf.export import export_run
    from ghostvis_core.run.train.objectives import build_objective
    from ghostvis_core.runs.launch_spec import LaunchSpec
    from ghostvis_core.runs.run_result import RunResult

    home = Home(home_copy)
    folder = export_run(home.store, "pretrain", None, tmp_path / "pretrain-hf")
    sets = [
        f"init_from={folder}",
        "budget.steps=1",
        "checkpoint.every_steps=1",
        "eval.every_steps=1",
        "runtime.precision=fp32",
        "batch.world_size=1",
        "eval.evidence=[]",
        "eval.val_tokens=512",
    ]
    spec_uri = prepare_stage(home_copy, "continued_pretrain", *sets)[-1]
    run_cli(["python", "-m", "ghostvis_core.run", "--spec", spec_uri], home_copy)  # one rank: no torchrun needed
    store = home.store
    (key,) = [
        k
        for _, k in store.keys("run_spec", "continued_pretrain")
        if IMPORT_STAGE in (store.read_json("run_spec", "continued_pretrain", k)["init_checkpoint"] or "")
    ]
    spec = LaunchSpec.from_dict(store.read_json("run_spec", "continued_pretrain", key))
    result = RunResult.from_dict(store.read_json("run_record", "continued_pretrain", key))
    (first,) = [
        m.value
        for m in MlflowClient(home.mlflow_tracking_uri).get_metric_history(result.mlflow_run_id, "train/loss")
        if m.step == 1
    ]
    cfg = spec.config
    objective = build_objective(spec, cfg)
    batches = objective.step_batches(0, spec.plan.batch, 0)
    model = load_hf_model(folder)
    with torch.no_grad():
        expected = sum(float(objective.loss_sum(model, b, torch.device("cpu"))) for b in batches) / sum(
            b.units for b in batches
        )
    print(f"first-step loss {first:.6f}, imported model on that batch {expected:.6f}")
    assert abs(first - expected) <= 1e-4, (first, expected)
    assert expected < 0.95 * torch.log(torch.tensor(float(model.cfg.vocab_size))).item()


class _HubHandler:
    """The Hub endpoints snapshot_download uses, over one folder: the revision's info, its file tree,
    and /resolve/ answering HEAD (commit, ETag, size) and GET (the bytes)."""

    @staticmethod
    def make(repo: str, folder: Path, seen: list[str]):
        import hashlib
        from http.server import BaseHTTPRequestHandler

        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
        sha = hashlib.sha1(repo.encode() + b"".join(files.values())).hexdigest()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool = False):
                self.send_response(status)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _route(self, head: bool):
                path = self.path.split("?")[0]
                seen.append(f"{self.command} {path}")
                if path in (f"/api/models/{repo}/revision/main", f"/api/models/{repo}/revision/{sha}"):
                    body = {"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]}
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                if path.startswith(f"/api/models/{repo}/tree/{sha}"):
                    body = [
                        {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                        for f, b in files.items()
                    ]
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                prefix = f"/{repo}/resolve/"
                if path.startswith(prefix):
                    rev, _, name = path[len(prefix) :].partition("/")
                    if rev in ("main", sha) and name in files:
                        return self._send(
                            200,
                            files[name],
                            {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha256(files[name]).hexdigest()}"'},
                            head,
                        )
                return self._send(404, b'{"error": "not found"}', {"X-Error-Code": "EntryNotFound"}, head)

            def do_GET(self):
                self._route(False)

            def do_HEAD(self):
                self._route(True)

        return Handler


def imported_commit(seen: list[str]) -> str:
    return next(s.split("/resolve/")[1].split("/")[0] for s in seen if "/resolve/" in s)


def test_import_from_the_hub_through_huggingface_hub(tok, tmp_path, monkeypatch):
    import threading
    from http.server import ThreadingHTTPServer

    folder, reference = hf_reference("llama", tmp_path, tok)
    seen: list[str] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HubHandler.make("open-org/llama-tiny", folder, seen))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    store = FolderStore(tmp_path / "store")
    try:
        imported = import_checkpoint(store, "hf://open-org/llama-tiny@main")
        with pytest.raises(GhostvisError, match=f"init_from hf://open-org/missing: download from {endpoint} failed"):
            import_checkpoint(store, "hf://open-org/missing")
    finally:
        server.shutdown()
    assert seen[:2] == [
        "GET /api/models/open-org/llama-tiny/revision/main",
        f"GET /api/models/open-org/llama-tiny/tree/{imported_commit(seen)}",
    ]
    files = {s.split(" ")[0] + " " + s.rsplit("/", 1)[-1] for s in seen if "/resolve/" in s}
    assert {"HEAD model.safetensors", "GET model.safetensors", "GET tokenizer.json"} <= files
    model = load_hf_model(folder)
    ckpt.load_model(checkpoint_of(store, imported.upstream.checkpoint), model)
    x = batch()
    with torch.no_grad():
        assert (model(x) - reference(x).logits).abs().max().item() <= 1e-4


def test_planning_a_stage_refuses_a_broken_import_or_an_unknown_init_from(tok, tmp_path):
    """In the launch planning path (before torchrun), the offending tensor is named."""
    from ghostvis_core.home import Home
    from ghostvis_core.launch.start import plan_run

    folder, _ = hf_reference("qwen2", tmp_path, tok)
    _break(folder, "missing")
    home = Home(tmp_path / "home")
    with pytest.raises(GhostvisError, match=r"missing tensors model\.layers\.1\.mlp\.up_proj\.weight"):
        plan_run("continued_pretrain", preset="smoke", overrides={"init_from": str(folder)}, home=home)
    with pytest.raises(GhostvisError, match="init_from 'pretrian' is neither a stage"):
        plan_run("continued_pretrain", preset="smoke", overrides={"init_from": "pretrian"}, home=home)


# The tokenizer asset with from_model, materialized in this Python process (as Dagster's in-process executor runs
# it), then what that process imported and the materialization's metadata
TOKENIZER_FROM_MODEL_IN_DAGSTER = """
import json, os, sys
from dagster import DagsterInstance, materialize
from ghostvis_pipeline.assets.data import tokenizer
from ghostvis_pipeline.launchers import Launcher
from ghostvis_pipeline.resources import GhostvisHome
with DagsterInstance.ephemeral() as instance:
    result = materialize(
        [tokenizer],
        instance=instance,
        resources={"home": GhostvisHome(root=os.environ["GHOSTVIS_HOME"]), "launcher": Launcher()},
        run_config={"ops": {"tokenizer": {"config": {"from_model": sys.argv[1]}}}},
    )
    [mat] = result.asset_materializations_for_node("tokenizer")
md = {k: v.value for k, v in mat.metadata.items()}
heavy = [m for m in ("torch", "transformers", "safetensors") if m in sys.modules]
print("DAGSTER_PROCESS " + json.dumps({"heavy_imports": heavy, "metadata": md}))
"""


def test_a_models_tokenizer_is_taken_by_the_tokenizer_job_not_the_dagster_process(tok, tmp_path):
    """from_model reads the checkpoint with the import code (torch): the tokenizer job does it, where the launcher
    runs jobs, and the Dagster process that materialized the asset never imported torch; its metadata is the
    model's tokenizer, as the asset gave it when it imported it in process."""
    folder, _ = hf_reference("qwen2", tmp_path, tok)
    home = tmp_path / "home"
    proc = run_cli(["python", "-c", TOKENIZER_FROM_MODEL_IN_DAGSTER, str(folder)], home)
    said = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("DAGSTER_PROCESS ")).split(" ", 1)[1])
    assert said["heavy_imports"] == []
    md = said["metadata"]
    assert (md["tokenizer_id"], md["from_model"], md["train_shards"]) == (tok.tokenizer_id, str(folder), 0)
    assert md["markers"] == dict(tok.markers) and "identity" not in md
    assert FolderStore(home / "store").exists("tokenizer", tok.tokenizer_id)


@pytest.mark.e2e
def test_a_foreign_models_tokenizer_tokenizes_the_data_a_stage_starts_from_it(tok, home_copy, tmp_path):
    """A Qwen2 with a tokenizer of its own (not the demo's): planning a stage from it names the fix;
    the tokenizer asset takes the model's tokenizer (from_model), tokenized_shards tokenizes the text
    sources with it, and pretraining starts from the model on those tokens."""
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.home import Home
    from ghostvis_core.runs.run_result import RunResult
    from tests.test_e2e_demo import dagster_instance, latest

    folder, _ = hf_reference("qwen2", tmp_path, tok)
    sets = [
        f"init_from={folder}",
        "budget.steps=2",
        "checkpoint.every_steps=2",
        "batch.seq_len=64",
        "batch.world_size=1",
        "eval.evidence=[]",
        "eval.val_tokens=128",
        "runtime.precision=fp32",
    ]
    refused = run_cli(prepare_argv("pretrain", *sets), home_copy, check=False)
    assert refused.returncode != 0
    assert f"materialize tokenizer with from_model: {folder}, then tokenized_shards" in refused.stdout + refused.stderr

    dagster = ["dagster", "asset", "materialize", "-m", "ghostvis_pipeline.definitions", "--select"]
    run_cli(
        [
            *dagster,
            "tokenizer",
            "--config-json",
            json.dumps({"ops": {"tokenizer": {"config": {"from_model": str(folder)}}}}),
        ],
        home_copy,
    )
    instance = dagster_instance(home_copy)
    md = latest(instance, "tokenizer")
    assert (md["tokenizer_id"], md["from_model"], md["train_shards"]) == (tok.tokenizer_id, str(folder), 0)
    keys = instance.get_dynamic_partitions("shards")
    text = [i for i, k in enumerate(keys) if k.split("/")[0] in ("demo_prose", "demo_code")]
    run_cli([*dagster, "tokenized_shards", "--partition-range", f"{keys[text[0]]}...{keys[text[-1]]}"], home_copy)
    store = Home(home_copy).store
    rows = Ledger.in_store(store).shards(tokenizer_id=tok.tokenizer_id)
    assert {r.source for r in rows} >= {"demo_prose", "demo_code"} and all(r.tokens > 0 for r in rows)

    spec_uri = prepare_stage(home_copy, "pretrain", *sets)[-1]
    out = run_cli(["python", "-m", "ghostvis_core.run", "--spec", spec_uri], home_copy).stdout  # one rank
    run_key = re.search(r"run (\S+) segment", out).group(1)
    spec = store.read_json("run_spec", "pretrain", run_key)
    result = RunResult.from_dict(store.read_json("run_record", "pretrain", run_key))
    assert spec["tokenizer_id"] == tok.tokenizer_id and IMPORT_STAGE in spec["init_checkpoint"]
    assert result.counts.real_tokens == Ledger.in_store(store).run_counts(run_key).real_tokens > 0
