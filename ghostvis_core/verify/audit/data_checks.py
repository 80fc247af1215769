"""The one list of the token ledger's checks: the Dagster asset checks on `token_ledger`, the
checks-only job and `ghostvis audit` all run exactly these, in this order (as STAGE_CHECKS is for
a training stage).

Each entry is (name, description, check): the check reads the store, the ledger and the tokenizer
whose shards it checks, and returns a CheckOutcome.
"""

from __future__ import annotations

from collections.abc import Callable

from ghostvis_core.data.ledger import Ledger
from ghostvis_core.store import Store
from ghostvis_core.verify.audit import invariants as inv
from ghostvis_core.verify.audit.check_outcome import CheckOutcome
from ghostvis_core.verify.audit.removed import removed_tokens_reconcile
from ghostvis_core.verify.audit.token_integrity import (
    documents_start_where_ledger_says,
    sampled_documents_decode_to_raw_text,
    token_files_name_their_tokenizer,
)

DataCheck = tuple[str, str, Callable[[Store, Ledger, str], CheckOutcome]]

DATA_CHECKS: list[DataCheck] = [
    (
        "ledger_matches_token_files",
        "Ledger docs/tokens equal a recount of the token files.",
        inv.ledger_matches_token_files,
    ),
    (
        "all_manifest_shards_tokenized",
        "Every shard in the manifests is tokenized with the current tokenizer.",
        inv.all_manifest_shards_tokenized,
    ),
    (
        "no_duplicate_content",
        "No two shards with the same content, and no document in both train and validation.",
        lambda store, ledger, tokenizer_id: inv.no_duplicate_content(ledger, tokenizer_id),
    ),
    (
        "removed_tokens_reconcile",
        "Per text shard and in total: tokens before (every raw document tokenized again) = tokens kept (the token "
        "file) + tokens removed (the ledger's drops, equal to a recount).",
        removed_tokens_reconcile,
    ),
    (
        "token_files_name_their_tokenizer",
        "Every token file was written by the tokenizer its ledger record and path name (the id in its schema "
        "metadata), the one the stages train with: a swapped tokenizer is named.",
        token_files_name_their_tokenizer,
    ),
    (
        "documents_start_where_ledger_says",
        "<|bos|> at every document start of every token file and nowhere else inside a document; chats, preference "
        "pairs and captions end with <|eot|>: a dropped BOS or a shifted document boundary is named.",
        documents_start_where_ledger_says,
    ),
    (
        "sampled_documents_decode_to_raw_text",
        "The first, middle and last document of every token file decode to the normalized words of their raw row.",
        sampled_documents_decode_to_raw_text,
    ),
]
