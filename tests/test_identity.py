"""Identities and code versions (ghostvis_core/identity.py): stable, location-free, and blind to how
the code is written down (docstrings, comments, formatting) but not to what it does."""

from __future__ import annotations

from pathlib import Path

from ghostvis_core import identity
from ghostvis_core.launch.start import TRAINING_MODULES


def test_digest_is_independent_of_key_order_and_changed_inputs_names_the_leaves():
    a = {"config": {"lr": 1e-3, "steps": 8}, "train": {"web": ["aa", "bb"]}, "upstream": "pretrain-x-r1"}
    b = {"upstream": "pretrain-x-r1", "train": {"web": ["aa", "bb"]}, "config": {"steps": 8, "lr": 1e-3}}
    assert identity.digest(a) == identity.digest(b)
    c = {**a, "config": {"lr": 1e-3, "steps": 9}, "train": {"web": ["aa", "cc"]}}
    assert identity.digest(c) != identity.digest(a)
    assert identity.changed_inputs(a, c) == ["config.steps", "train.web"]
    assert identity.changed_inputs(a, {**a, "tokenizer": "bpe"}) == ["tokenizer"]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_normalized_source_ignores_docstrings_comments_and_layout_not_code(tmp_path):
    base = _write(tmp_path / "a.py", "def f(x):\n    return x + 1\n")
    cosmetic = _write(
        tmp_path / "b.py",
        '"""Module doc."""\n\n# a comment\ndef f(x):  # why\n    """Doc."""\n\n    return (x +\n            1)\n',
    )
    changed = _write(tmp_path / "c.py", "def f(x):\n    return x + 2\n")
    assert identity._normalized(base) == identity._normalized(cosmetic)
    assert identity._normalized(base) != identity._normalized(changed)


def test_training_code_version_covers_the_trainer_and_what_it_imports_not_the_pipeline():
    files = {p.relative_to(identity.PACKAGE_ROOT).as_posix() for p in identity._closure(TRAINING_MODULES)}
    assert {"run/train/loop.py", "launch/start.py", "run/model/gpt.py", "data/loader.py", "plan/config.py"} <= files
    assert not any(f.startswith("ghostvis_pipeline") for f in files)
    assert identity.code_version(*TRAINING_MODULES) == identity.code_version(*TRAINING_MODULES)
    assert identity.code_version("ghostvis_core.data.ledger") != identity.code_version(*TRAINING_MODULES)
