"""The docs name only what the tree holds: every file, `path:name`, `module.name` and `Class.member` that README.md
and docs/ cite resolves (tests/doc_refs.py says what counts as a reference), so a move or a rename that leaves a
doc behind fails here. The checker itself is shown to fail on a doc with broken references of every shape."""

from __future__ import annotations

import ast
import re
from collections import Counter

from tests.doc_refs import ROOT, as_reference, broken_refs, check_ref, doc_spans, project_docs


def test_every_code_reference_in_the_docs_names_something_in_the_tree():
    docs = project_docs()
    kinds = Counter(found[0] for doc in docs for _, span in doc_spans(doc.read_text()) if (found := as_reference(span)))
    assert set(kinds) == {"path", "name", "dotted"} and min(kinds.values()) >= len(docs), kinds
    broken = broken_refs(docs)
    assert not broken, "these doc references name nothing in the tree; fix the doc:\n" + "\n".join(map(str, broken))


def test_a_doc_with_broken_references_of_every_shape_fails_naming_each(tmp_path):
    doc = tmp_path / "broken.md"
    doc.write_text(
        "Good: `ghostvis_core/run/train/trainer.py`, `train/feeds.py`, `trainer.py:Trainer.train_step`,\n"
        "`CheckpointManager.newest`, `presets.resolve`, `checkpoint.every_steps` and `torch.cuda.synchronize`.\n"
        "Bad: `ghostvis_core/run/train/missing.py` and `trainer.py:train_steps`,\n"
        "`presets.resolved`, `CheckpointManager.oldest`, `checkpoint.every_hours`, `checkpointing.share_shard`,\n"
        "(`stages_below` in `assets/training.py`) and `test_loader.py::test_no_such_test`.\n"
        "```\n`ghostvis_core/not_checked_in_a_fence.py`\n```\n"
    )
    broken = broken_refs([doc])
    assert [(b.line, b.ref) for b in broken] == [
        (3, "ghostvis_core/run/train/missing.py"),
        (3, "trainer.py:train_steps"),
        (4, "presets.resolved"),
        (4, "CheckpointManager.oldest"),
        (4, "checkpoint.every_hours"),
        (4, "checkpointing.share_shard"),
        (5, "test_loader.py::test_no_such_test"),
        (5, "assets/training.py:stages_below"),
    ]
    whys = {b.ref: b.why for b in broken}
    assert whys["trainer.py:train_steps"] == "train_steps is not defined in ghostvis_core/run/train/trainer.py"
    assert whys["checkpoint.every_hours"].startswith("every_hours is not defined in ghostvis_core/run/train/checkpoint")
    assert "and its bases define no oldest" in whys["CheckpointManager.oldest"]
    missing = "ghostvis_core/run/train/missing.py"
    assert str(broken[0]) == f"{doc}:3 `{missing}`: no file or folder {missing} in the tree"


def test_the_newcomers_path_to_the_optimizer_step_is_at_most_eight_checked_places():
    text = (ROOT / "docs/architecture.md").read_text()
    section = text.split("### From `ghostvis train sft` to the optimizer step\n", 1)[1].split("\n#", 1)[0]
    places = [" ".join(p.split()) for p in re.findall(r"^\d+\. (.+?)(?=^\d+\. |\Z)", section, flags=re.M | re.S)]
    assert 1 < len(places) <= 8, places
    for place in places:
        refs = [ref for ref in re.findall(r"`([^`]+)`", place) if ":" in ref and not ref.startswith("ghostvis ")]
        assert refs, f"this place names no `path:name`: {place}"
        assert all(check_ref(ref) is None for ref in refs), place
    assert "Optimizer.step" in places[-1]
    trainer = ast.parse((ROOT / "ghostvis_core/run/train/trainer.py").read_text())
    step = next(n for n in ast.walk(trainer) if isinstance(n, ast.FunctionDef) and n.name == "train_step")
    assert "self.optimizer.step()" in ast.unparse(step)
