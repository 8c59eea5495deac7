"""The pattern families' example corpus (``patterns/corpus/``) as golden tests: each example model
gives exactly the regions and the near misses (with their reasons) its case lists."""

from __future__ import annotations

import pytest

from fusion_backend.match.engine import registered_patterns
from fusion_backend.patterns.corpus import FAMILIES, cases
from fusion_backend.testing import dry_run

CASES = [(family, case) for family in FAMILIES for case in cases(family)]


@pytest.mark.parametrize("family, case", CASES, ids=[f"{f}-{c.name}" for f, c in CASES])
def test_corpus_case(family, case):
    model, inputs = case.build()
    found = dry_run(model, inputs, patterns=list(registered_patterns()))  # the opt-in families too
    assert [summary for _, summary, _ in found.regions] == list(case.regions)
    got = sorted((m.pattern, m.reason.value) for m in found.near_misses)
    assert got == sorted((pattern, reason) for pattern, reason, _ in case.near_misses)
    for pattern, reason, words in case.near_misses:
        messages = [m.message for m in found.near_misses if (m.pattern, m.reason.value) == (pattern, reason)]
        assert any(words in message for message in messages), (words, messages)


def test_every_family_has_a_corpus_with_matches_and_near_misses():
    from fusion_backend.match.engine import registered_patterns

    assert set(FAMILIES) == set(registered_patterns())
    for family in FAMILIES:
        assert any(c.regions for c in cases(family)) and any(c.near_misses for c in cases(family))
    with pytest.raises(ValueError, match="no corpus for 'nope'"):
        cases("nope")
