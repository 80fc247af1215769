"""A problem source's reward rule: how a sampled completion's answer is matched against a problem's `answer`.

Declared per source (`reward:` beside its `kind: problem` in shard_manifest's config) and checked when the
manifest is made, so a typo fails before any download:
- `integer` (the default): the last integer in the completion equals the answer as an integer ("0042" is 42)
- `string`: the completion's last non-empty line equals the answer, both stripped of surrounding space
- `regex:<pattern>`: the pattern's last match in the completion, its first group if it has one, equals
  the answer, both stripped (e.g. `regex:Answer: (\\S+)`)

The rl stage (ghostvis_core/run/train/grpo.py) rewards a completion 1 when `is_correct`, plus a small format
reward when `well_formed`: its last non-empty line is an answer in the rule's form and nothing else (the line
a policy is taught to end on); with grpo.stop_at_answer it stops sampling where `closes_answer_line`. The audit
recomputes both with its own code (ghostvis_core/verify/audit/rollouts.py).
"""

from __future__ import annotations

import re

from ghostvis_core.errors import GhostvisError

INTEGER, STRING, REGEX = "integer", "string", "regex:"
DEFAULT_RULE = INTEGER
_INT = re.compile(r"-?\d+")


def check_reward_rule(source: str, kind: str, rule: str) -> str:
    """The source's rule as the manifest records it ("" for a source that is not of problems)."""
    if kind != "problem":
        if rule:
            raise GhostvisError(
                f"source {source}: reward {rule!r} is set on a {kind} source; a reward rule belongs to a "
                f"problem source (kind: problem): remove it or set the kind"
            )
        return ""
    rule = rule or DEFAULT_RULE
    if rule in (INTEGER, STRING):
        return rule
    if rule.startswith(REGEX):
        try:
            re.compile(rule[len(REGEX) :])
        except re.error as exc:
            raise GhostvisError(
                f"source {source}: reward {rule!r} is not a valid regular expression ({exc}); fix the pattern"
            ) from None
        return rule
    raise GhostvisError(
        f"source {source}: reward {rule!r} is not a reward rule; use integer (the default), string or regex:<pattern>"
    )


def completion_answer(rule: str, completion: str) -> str | None:
    """The answer a completion gives under the rule, or None when it gives none."""
    if rule == INTEGER:
        found = _INT.findall(completion)
        return str(int(found[-1])) if found else None
    if rule == STRING:
        lines = [line.strip() for line in completion.splitlines() if line.strip()]
        return lines[-1] if lines else None
    matches = list(re.finditer(rule[len(REGEX) :], completion))
    if not matches:
        return None
    last = matches[-1]
    return (last.group(1) if last.re.groups else last.group(0)).strip()


def is_correct(rule: str, completion: str, answer: str) -> bool:
    """The completion's answer (completion_answer) equals the problem's answer under the rule."""
    given = completion_answer(rule, completion)
    if given is None:
        return False
    if rule == INTEGER:
        return _INT.fullmatch(answer.strip()) is not None and int(given) == int(answer.strip())
    return given == answer.strip()


def well_formed(rule: str, completion: str) -> bool:
    """The completion's last non-empty line, stripped, is an answer in the rule's form and nothing else: an
    integer (`integer`), any text (`string`), a whole match of the pattern (`regex:`). The rl format reward:
    a line that only holds an answer somewhere (`Answer: 5 13 except 4 packs`) would be rewarded for noise."""
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    if not lines:
        return False
    if rule == INTEGER:
        return _INT.fullmatch(lines[-1]) is not None
    return rule == STRING or re.fullmatch(rule[len(REGEX) :], lines[-1]) is not None


def closes_answer_line(rule: str, completion: str) -> bool:
    """The completion has just ended a line (its text ends with a newline) and that line is well_formed: where
    the rl stage stops sampling with grpo.stop_at_answer. Only the newline closes the line ("Answer: 1" may go on
    to "Answer: 12"); the tokenizer never merges a newline with the letters or digits after it."""
    return completion.endswith("\n") and well_formed(rule, completion)
