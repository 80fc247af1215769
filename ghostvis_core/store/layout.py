"""Where each artifact kind lives under a store's root (a folder, or a bucket prefix): the one map from
(kind, key parts) to a relative location, shared by every store implementation."""

from __future__ import annotations

import re

from ghostvis_core.errors import GhostvisError

# kind -> location under the store root. `{}` is one key part (no "/"); `{path}` may hold "/"
# (shard ids are <source>/<shard>).
LAYOUT: dict[str, str] = {
    "manifest": "manifests/{}.json",  # source
    "raw_shard": "shards/raw/{path}.parquet",  # shard_id
    # shard_id, sha256: an earlier content of a shard whose file changed under its name (catalog.raw_content)
    "raw_shard_version": "shards/raw_versions/{path}/{}.parquet",
    "raw_shard_meta": "shards/raw_meta/{path}.json",  # shard_id: sha256, bytes, split of the downloaded shard
    "tokenizer": "tokenizers/{}",  # tokenizer_id: a folder (tokenizer.json, ...)
    # tokenizer_id, shard_id, sha256 of the raw content tokenized: each version of a shard has its own
    "token_shard": "shards/tokens/{}/{path}/{}.arrow",
    "ledger": "ledger",  # the ledger's Parquet tables (data/ledger/)
    "ledger_file": "ledger/{path}",  # one file of those tables, by its path inside the ledger
    "checkpoints": "checkpoints/{}/{}",  # stage, run_key: the run's step_* folders
    "checkpoint": "checkpoints/{}/{}/{}",  # stage, run_key, step_* folder: one checkpoint
    "checkpoint_marker": "checkpoints/{}/{}/{}/COMPLETE",  # stage, run_key, step_*: written last, when committed
    "run_record": "checkpoints/{}/{}/RUN_COMPLETE.json",  # stage, run_key: the finished run's RunResult
    "run_spec": "runs/{}/{}/spec.json",  # stage, run_key: the LaunchSpec of the run's first launch
    # stage, run_key, n (2, 3, ...): a resume's LaunchSpec where it differs from the newest before it
    # (runs/launch_spec.py)
    "run_spec_resume": "runs/{}/{}/spec.{}.json",
    # stage, run_key, rank: one failing rank's reason, time and host (never overwritten)
    "run_error": "runs/{}/{}/errors/{}.json",
    "run_file": "runs/{}/{}/{path}",  # stage, run_key, name: a launcher's file (job script, job output, Pipes messages)
    "report": "reports/{path}",  # file name under reports/
    "identity": "identities/{}/{path}.json",  # asset, key: what an artifact is made of (ghostvis_core/identity.py)
    # scope, name, generation, file: who holds the one right to write a shared thing (ghostvis_core/store/lease.py)
    "lease": "leases/{}/{}/{}/{}.json",
    # scope, name, sequence number: the lease's fence log, one entry per takeover and per fenced commit
    # (ghostvis_core/store/fence.py); never pruned with the generations
    "fence_log": "leases/{}/{}/log/{}.json",
}


# A checkpoint's folder under its run ("checkpoint" key part 3): step_ and the optimizer step, nine digits.
_STEP_DIR = re.compile(r"^step_(\d{9})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def is_step_dir(name: str) -> bool:
    return bool(_STEP_DIR.match(name))


def known_kind(kind: str) -> str:
    if kind not in LAYOUT:
        raise GhostvisError(f"unknown artifact kind '{kind}'; kinds: {', '.join(LAYOUT)}")
    return kind


def fill(kind: str, key: tuple[str, ...]) -> str:
    template = LAYOUT[known_kind(kind)]
    slots = template.count("{")
    if len(key) != slots:
        raise GhostvisError(f"artifact kind '{kind}' takes {slots} key part(s), got {list(key)}")
    for part in key:
        if not part or part.startswith(".") or "/../" in f"/{part}/":
            raise GhostvisError(f"artifact {kind}: invalid key part {part!r}")
    return template.replace("{path}", "{}").format(*key)


def key_regex(template: str, prefix: tuple[str, ...]) -> str:
    out, given = "", list(prefix)
    for chunk in re.split(r"(\{path\}|\{\})", template):
        if chunk in ("{}", "{path}"):
            out += f"({re.escape(given.pop(0))})" if given else ("(.+)" if chunk == "{path}" else "([^/]+)")
        else:
            out += re.escape(chunk)
    return out


def key_pattern(kind: str, prefix: tuple[str, ...]) -> re.Pattern[str]:
    """Matches the relative location of an artifact of `kind` whose key starts with `prefix`; groups are the key."""
    return re.compile(key_regex(LAYOUT[known_kind(kind)], prefix))


def listing_prefix(kind: str, prefix: tuple[str, ...]) -> str:
    """The longest fixed folder above every artifact of `kind` whose key starts with `prefix`: where a
    listing of those keys starts (listing less of a bucket is faster and cheaper)."""
    template = LAYOUT[known_kind(kind)].replace("{path}", "{}")
    chunks, given, out = template.split("{}"), list(prefix), ""
    for i, chunk in enumerate(chunks[:-1]):
        out += chunk
        if i >= len(given):
            break
        out += given[i]
    else:
        out += chunks[-1]
    return out.rsplit("/", 1)[0] if "/" in out else ""
