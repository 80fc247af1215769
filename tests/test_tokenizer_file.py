"""Bring a tokenizer (ghostvis_core.data.brought_tokenizer): byte-level BPE tokenizer.json files made here with the
`tokenizers` library (ChatML, Llama 3 and GPT-2 styles) and a tiktoken BPE file encode as their own library does,
their special tokens stand for GhostVis's chat markers, the file and the mapping decide the tokenizer's id, a GhostVis
export comes back as the same tokenizer, what cannot be served exactly is refused naming the file and the fix, and
the `tokenizer` asset takes a file whose id the tokenization's ledger rows carry. No Hub, no torchrun."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from ghostvis_core.data.bpe_tokenizer import SPLIT_PATTERN, load_tokenizer, save_tokenizer, train_tokenizer
from ghostvis_core.data.brought_tokenizer import CL100K_PATTERN, bring_tokenizer
from ghostvis_core.data.chat import render_chat, render_prompt
from ghostvis_core.errors import GhostvisError
from ghostvis_core.store import FolderStore

CORPUS = [
    "The quick brown fox jumps over the lazy dog. 1234 5678!",
    "naïve café — Ünïcödé: 日本語のテキスト, 한국어, العربية 🙂👍🏽",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "It's what they've done; we'll see.   spaces\t\ttabs\r\n",
] * 25
TEXTS = [
    "",
    "Held-out: the lazy fox's 98765 naps.\n\n",
    "Über naïve café — ✓ 日本語のテキストです 👨‍👩‍👧‍👦 emoji",
    "<|im_start|> a literal special in text <|eot_id|>",
    "\x00\x01 control \x7f and \r\n line ends",
]
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what's 2+2?"},
    {"role": "assistant", "content": "4, naïvely."},
]
LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def hf_bpe(specials: list[str], split: str | None = LLAMA3_SPLIT, vocab: int = 420) -> HFTokenizer:
    """A byte-level BPE trained by `tokenizers` as Llama 3 / Qwen2 are built (Split + ByteLevel, or GPT-2's
    ByteLevel that splits itself when `split` is None), its special tokens added after the vocabulary."""
    hf = HFTokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    hf.pre_tokenizer = (
        byte_level
        if split is None
        else pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    hf.train_from_iterator(CORPUS, trainer=trainer)
    hf.add_special_tokens(specials)
    return hf


def write(hf: HFTokenizer, path) -> str:
    path.write_text(hf.to_str())
    return str(path)


@pytest.fixture(scope="module")
def files(module_tmp):
    root = module_tmp("tokenizer-files")
    return {
        "chatml": (write(hf_bpe(CHATML), root / "chatml.json"), hf_bpe(CHATML)),
        "llama3": (write(hf_bpe(LLAMA3), root / "llama3.json"), hf_bpe(LLAMA3)),
        "gpt2": (write(hf_bpe(["<|endoftext|>"], split=None), root / "gpt2.json"), hf_bpe(["<|endoftext|>"], None)),
    }


@pytest.mark.parametrize("style", ["chatml", "llama3", "gpt2"])
def test_a_tokenizer_json_encodes_and_decodes_as_the_tokenizers_library(style, files):
    path, hf = files[style]
    mapping = {"bos": "<|endoftext|>", "eot": "<|endoftext|>", "system": "S: ", "user": "U: ", "assistant": "A: "}
    tok = bring_tokenizer(path, mapping if style == "gpt2" else None).tokenizer
    hf = HFTokenizer.from_str(hf.to_str())  # a copy: the module's is shared
    hf.encode_special_tokens = True  # a special token's text in a document is text to GhostVis
    for text in TEXTS + CORPUS[:4]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(tok.encode(text)) == hf.decode(tok.encode(text)) == text
    # the file's ids stay; <|image|> and <|pad|> come after them
    assert {n: tok.special(n) for n in ("<|image|>", "<|pad|>")} == {
        "<|image|>": hf.get_vocab_size(),
        "<|pad|>": hf.get_vocab_size() + 1,
    }


def test_chatml_and_llama3_specials_stand_for_the_chat_markers(files):
    """The chat template renders with the file's own tokens: what the model saw in its own chats."""
    chatml = bring_tokenizer(files["chatml"][0]).tokenizer
    hf = files["chatml"][1]
    ids, mask = render_chat(chatml, CHAT)
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>" for m in CHAT)
    assert ids == hf.encode("<|endoftext|>" + expected, add_special_tokens=False).ids
    assert chatml.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "4, naïvely.<|im_end|>"
    marker = hf.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    assert render_prompt(chatml, CHAT[:2]) == render_chat(chatml, CHAT[:2])[0] + marker
    assert (chatml.bos, chatml.eot) == (hf.token_to_id("<|endoftext|>"), hf.token_to_id("<|im_end|>"))

    llama = bring_tokenizer(files["llama3"][0]).tokenizer
    hf = files["llama3"][1]
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    expected = "<|begin_of_text|>" + header.format("user") + "hi<|eot_id|>" + header.format("assistant")
    assert render_prompt(llama, [{"role": "user", "content": "hi"}]) == hf.encode(expected).ids
    assert llama.markers["<|eot|>"] == "<|eot_id|>"


def test_the_file_and_the_mapping_decide_the_id_and_the_store_keeps_both(files, tmp_path):
    path = files["chatml"][0]
    brought = bring_tokenizer(path)
    assert brought.sha256 == hashlib.sha256(open(path, "rb").read()).hexdigest()
    again = bring_tokenizer(path).tokenizer
    remapped = bring_tokenizer(path, {"bos": "<|im_start|>"}).tokenizer
    other = bring_tokenizer(write(hf_bpe(CHATML, vocab=400), tmp_path / "smaller.json")).tokenizer
    ids = {brought.tokenizer.tokenizer_id, remapped.tokenizer_id, other.tokenizer_id}
    assert again.tokenizer_id == brought.tokenizer.tokenizer_id and len(ids) == 3
    store = FolderStore(tmp_path / "store")
    save_tokenizer(remapped, store)
    loaded = load_tokenizer(remapped.tokenizer_id, store)
    assert (loaded.tokenizer_id, dict(loaded.markers)) == (remapped.tokenizer_id, dict(remapped.markers))
    assert loaded.bos == remapped.special("<|im_start|>") and render_chat(loaded, CHAT) == render_chat(remapped, CHAT)


def test_a_stage_from_an_imported_model_keeps_the_assets_mapping_of_its_tokenizer(files, tmp_path):
    """init_from a model whose tokenizer the asset took with special_tokens: the stage uses the asset's (same ids,
    its markers); a tokenizer of other ids is not taken for the model's."""
    from ghostvis_core.launch.start import model_tokenizer

    store = FolderStore(tmp_path / "store")
    model_tok = bring_tokenizer(files["chatml"][0]).tokenizer
    remapped = bring_tokenizer(files["chatml"][0], {"system": "<|im_start|>developer\n"}).tokenizer
    other = bring_tokenizer(files["llama3"][0]).tokenizer
    for tok in (model_tok, remapped, other):
        save_tokenizer(tok, store)
    assert remapped.same_ids(model_tok) and not other.same_ids(model_tok)
    assert model_tokenizer(store, remapped.tokenizer_id, model_tok) == remapped.tokenizer_id
    assert model_tokenizer(store, other.tokenizer_id, model_tok) == model_tok.tokenizer_id
    assert model_tokenizer(store, None, model_tok) == model_tok.tokenizer_id


def test_a_tokenizer_file_comes_over_https_the_hub_and_s3_with_its_sha256(files, tmp_path, moto_s3, monkeypatch):
    """The same file from a local HTTP server (as http:// and as hf://org/name@rev through HF_ENDPOINT) and from S3:
    the same tokenizer and sha256 as the local path; a missing one names the URL."""
    import shutil
    import threading
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    import boto3

    from tests.conftest import new_bucket, s3_env

    path = files["chatml"][0]
    local = bring_tokenizer(path)
    served = tmp_path / "served"
    (served / "org" / "chat-model" / "resolve" / "v1").mkdir(parents=True)
    shutil.copy(path, served / "org" / "chat-model" / "resolve" / "v1" / "tokenizer.json")
    shutil.copy(path, served / "tok.json")
    handler = partial(SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *a: None
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}"
    for k, v in {**s3_env(moto_s3, tmp_path), "HF_ENDPOINT": url}.items():
        monkeypatch.setenv(k, v)
    new_bucket(moto_s3, "tokenizers")
    boto3.client("s3").upload_file(path, "tokenizers", "chat/tokenizer.json")
    try:
        for uri in (f"{url}/tok.json", "hf://org/chat-model@v1", "s3://tokenizers/chat/tokenizer.json"):
            brought = bring_tokenizer(uri)
            assert (brought.tokenizer.tokenizer_id, brought.sha256) == (local.tokenizer.tokenizer_id, local.sha256)
        with pytest.raises(GhostvisError, match=f"tokenizer file: {url}/org/nothing/resolve/main/tokenizer.json"):
            bring_tokenizer("hf://org/nothing")
        unigram(served / "spm.json")
        with pytest.raises(GhostvisError, match=f"^tokenizer file {url}/spm.json: model type Unigram"):
            bring_tokenizer(f"{url}/spm.json")
    finally:
        httpd.shutdown()


def test_a_tiktoken_bpe_file_is_served_like_a_trained_tokenizer(tmp_path):
    """GhostVis's own ranks file with its split pattern is the trained tokenizer again (same id); with the default
    pattern it encodes as tiktoken does with cl100k's split."""
    trained = train_tokenizer(CORPUS, 400)
    store = FolderStore(tmp_path / "store")
    ranks_file = save_tokenizer(trained, store) / "ranks.tiktoken"
    assert bring_tokenizer(str(ranks_file), pattern=SPLIT_PATTERN).tokenizer.tokenizer_id == trained.tokenizer_id
    tok = bring_tokenizer(ranks_file.as_uri()).tokenizer
    reference = tiktoken.Encoding(
        "ref", pat_str=CL100K_PATTERN, mergeable_ranks=trained.enc._mergeable_ranks, special_tokens={}
    )
    for text in TEXTS:
        assert tok.encode(text) == reference.encode_ordinary(text)
    assert (tok.bos, tok.vocab_size) == (trained.bos, trained.vocab_size)


def test_a_ghostvis_export_comes_back_as_the_same_tokenizer(files, tmp_path):
    """tokenizer.json written by the HF export, brought back: the same id, so its tokenized shards are reused; a
    brought ChatML tokenizer exported renders transformers' apply_chat_template as render_chat does."""
    transformers = pytest.importorskip("transformers")
    from ghostvis_core.run.hf.tokenizer_json import save_hf_tokenizer

    trained = train_tokenizer(CORPUS, 400)
    save_hf_tokenizer(trained, tmp_path / "trained", 128)
    back = bring_tokenizer(str(tmp_path / "trained" / "tokenizer.json")).tokenizer
    assert (back.tokenizer_id, dict(back.markers)) == (trained.tokenizer_id, {})

    chatml = bring_tokenizer(files["chatml"][0]).tokenizer
    save_hf_tokenizer(chatml, tmp_path / "chatml", 128)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "chatml")
    assert hf.apply_chat_template(CHAT, tokenize=True)["input_ids"] == render_chat(chatml, CHAT)[0]
    assert hf.apply_chat_template(CHAT[:2], add_generation_prompt=True)["input_ids"] == render_prompt(chatml, CHAT[:2])
    assert bring_tokenizer(str(tmp_path / "chatml" / "tokenizer.json")).tokenizer.tokenizer_id == chatml.tokenizer_id


def unigram(path) -> str:
    hf = HFTokenizer(models.Unigram())
    hf.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=100, show_progress=False))
    return write(hf, path)


def lowercased(path) -> str:
    hf = hf_bpe(CHATML)
    hf.normalizer = normalizers.Lowercase()
    return write(hf, path)


REFUSED = {
    "unigram": (
        lambda files, tmp: (unigram(tmp / "spm.json"), {}),
        "model type Unigram (SentencePiece/Unigram or WordPiece) is not byte-level BPE; GhostVis serves byte-level "
        "BPE tokenizers (GPT-2, Llama 3, Qwen2 style) through tiktoken: bring one of those or let the `tokenizer` "
        "asset train one",
    ),
    "normalizer": (
        lambda files, tmp: (lowercased(tmp / "lower.json"), {}),
        "normalizer Lowercase changes the text before it is split, which tiktoken does not",
    ),
    "no chat tokens": (
        lambda files, tmp: (files["gpt2"][0], {}),
        "it has no token for GhostVis's <|bos|>, <|eot|>, <|system|>, <|user|>, <|assistant|> (its special tokens: "
        "<|endoftext|>) and is not ChatML or Llama 3; map each onto the file's own with the tokenizer asset's "
        'special_tokens, e.g. {"bos": "<s>", "eot": "</s>", "user": "<|user_start|>"}, or bring a tokenizer with '
        "chat tokens",
    ),
    "ChatML without a BOS": (
        lambda files, tmp: (write(hf_bpe(CHATML[1:]), tmp / "no-bos.json"), {}),
        "it has no token for GhostVis's <|bos|> (its special tokens: <|im_end|>, <|im_start|>)",
    ),
    "misspelt token": (
        lambda files, tmp: (files["chatml"][0], {"eot": "<|im_ende|>"}),
        "<|eot|> is mapped to '<|im_ende|>', but <|im_ende|> is not one of its special tokens (<|endoftext|>, "
        "<|im_end|>, <|im_start|>); fix the mapping (special_tokens)",
    ),
    "unknown name": (
        lambda files, tmp: (files["chatml"][0], {"tool": "<|im_start|>"}),
        "special_tokens names <|tool|>; GhostVis maps only bos, eot, system, user, assistant, image, pad",
    ),
    "not a tokenizer": (
        lambda files, tmp: ((tmp / "notes.txt").write_text("hello world\n") and str(tmp / "notes.txt"), {}),
        "neither a tokenizer.json (JSON) nor a tiktoken BPE file ('base64 rank' lines)",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_be_served_exactly_is_refused_naming_the_file_and_the_fix(case, files, tmp_path):
    make, message = REFUSED[case]
    path, mapping = make(files, tmp_path)
    with pytest.raises(GhostvisError) as exc:
        bring_tokenizer(path, mapping)
    assert str(exc.value).startswith(f"tokenizer file {path}: ")
    assert message in str(exc.value)


def test_a_missing_file_and_a_model_without_room_are_refused(files, tmp_path):
    with pytest.raises(GhostvisError, match=r"tokenizer file /nowhere/tokenizer.json: no such file; give a"):
        bring_tokenizer("/nowhere/tokenizer.json")
    path, hf = files["chatml"]
    with pytest.raises(GhostvisError, match=f"its ids go up to {hf.get_vocab_size() + 1} but the model has vocab_size"):
        bring_tokenizer(path, vocab_size=hf.get_vocab_size())
    mapped = {"image": "<|im_start|>", "pad": "<|endoftext|>"}  # the fix the message names
    assert bring_tokenizer(path, mapped, vocab_size=hf.get_vocab_size()).tokenizer.vocab_size == hf.get_vocab_size()


def test_the_tokenizer_asset_brings_a_file_and_the_ledger_rows_carry_its_id(files, tmp_path):
    """tokenizer (from_file) materialized in process; a text source and a chat shard tokenized with its id: each
    ledger row names it, the token files hold the file's own ids (the chat with ChatML's markers), and the token
    ledger's checks of what is inside the token files pass."""
    from dagster import DagsterInstance, materialize

    from ghostvis_core.data.catalog import load_manifest
    from ghostvis_core.data.ledger import Ledger
    from ghostvis_core.data.tokenize_shards import TokenizeJob, job_for_shard
    from ghostvis_core.store.files import sha256_file
    from ghostvis_core.verify.audit.invariants import ledger_matches_token_files
    from ghostvis_core.verify.audit.token_files import TokenFile
    from ghostvis_pipeline.assets.data import tokenizer
    from ghostvis_pipeline.launchers import Launcher
    from ghostvis_pipeline.resources import GhostvisHome
    from tests.test_bad_inputs import run_manifest
    from tests.test_token_integrity import outcomes, tokenize

    listing = tmp_path / "listing"
    listing.mkdir()
    docs = {"a": TEXTS[1:3], "b": [CORPUS[1]]}
    for name, texts in docs.items():
        pq.write_table(pa.table({"text": texts}), listing / f"{name}.parquet")
    home = tmp_path / "home"
    assert run_manifest(home, [{"name": "web", "listing": listing.as_uri()}], selection="raw_shards").success
    path, hf = files["chatml"]
    with DagsterInstance.ephemeral() as instance:
        result = materialize(
            [tokenizer],
            instance=instance,
            resources={"home": GhostvisHome(root=str(home)), "launcher": Launcher()},
            run_config={"ops": {"tokenizer": {"config": {"from_file": path}}}},
        )
        [mat] = result.asset_materializations_for_node("tokenizer")
    md = {k: v.value for k, v in mat.metadata.items()}
    tok = bring_tokenizer(path).tokenizer
    assert md["tokenizer_id"] == tok.tokenizer_id and mat.tags["dagster/data_version"] == tok.tokenizer_id
    assert (md["from_file"], md["source_sha256"], md["train_shards"]) == (path, bring_tokenizer(path).sha256, 0)
    assert md["markers"] == dict(tok.markers) and md["markers"]["<|user|>"] == "<|im_start|>user\n"

    store = FolderStore(home / "store")
    manifest = load_manifest(store, "web")
    jobs = [job_for_shard(store, manifest, f"web/{name}") for name in docs]
    raw = store.writable("raw_shard", "chat/00000")  # a chat shard, as raw_shards stores one
    pq.write_table(
        pa.table({"messages": [CHAT, [{"role": "user", "content": "<|image|> what is it?"}, *CHAT[2:]]]}), raw
    )
    store.publish("raw_shard", "chat/00000")
    jobs.append(TokenizeJob("chat/00000", "chat", "train", sha256_file(raw), "chat"))
    tokenize(store, tmp_path, tok, jobs)
    ledger = Ledger.in_store(store)
    rows = {r.shard_id: r for r in ledger.shards(tokenizer_id=tok.tokenizer_id)}
    assert sorted(rows) == ["chat/00000", "web/a", "web/b"]
    for name, texts in docs.items():
        shard = f"web/{name}"
        tf = TokenFile(store.fetch("token_shard", tok.tokenizer_id, shard, rows[shard].content_sha256), shard)
        assert tf.tokenizer_id == tok.tokenizer_id
        assert [tf.doc(i).tolist() for i in range(tf.num_docs)] == [
            [tok.bos, *hf.encode(t, add_special_tokens=False).ids] for t in texts
        ]
    sha = rows["chat/00000"].content_sha256
    chat = TokenFile(store.fetch("token_shard", tok.tokenizer_id, "chat/00000", sha), "chat/00000")
    assert chat.doc(0).tolist() == render_chat(tok, CHAT)[0]
    out = outcomes(store, ledger, tok.tokenizer_id)
    out["ledger_matches_token_files"] = ledger_matches_token_files(store, ledger, tok.tokenizer_id)
    assert all(o.passed for o in out.values()), {n: o.failures for n, o in out.items()}
    sampled = out["sampled_documents_decode_to_raw_text"].figures["sampled_documents"]
    assert sampled == 5  # first, middle and last of web/a (2 documents), web/b (1), chat/00000 (2)
