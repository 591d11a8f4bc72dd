"""Benchmark data: halves to tune and to report on, and long contexts padded with other questions' passages."""

from __future__ import annotations

import pytest

from contextkit.bench.data import QARecord, split, with_distractors
from contextkit.core.errors import InputError
from contextkit.core.types import Evidence


def _records(n: int) -> list[QARecord]:
    return [QARecord(f"q{i}", f"question {i}?", ("a",),
                     tuple(Evidence(f"passage {i}.{j} " + "word " * 20, title=f"t{i}.{j}") for j in range(3)),
                     source="hotpotqa" if i % 2 else "musique") for i in range(n)]


def test_halves_are_disjoint_stable_and_cover_the_file():
    recs = _records(200)
    tune, held = split(recs, "tune"), split(recs, "heldout")
    assert {r.id for r in tune}.isdisjoint({r.id for r in held})
    assert len(tune) + len(held) == 200 and 60 < len(tune) < 140
    assert [r.id for r in split(recs[::-1], "tune")] == [r.id for r in tune][::-1]  # by id, not by place
    assert split(recs, "all") == recs
    with pytest.raises(InputError, match="split"):
        split(recs, "test")


def test_distractors_reach_the_band_and_keep_every_own_passage():
    recs = _records(30)
    words = lambda ps: sum(len(p.text.split()) for p in ps)  # noqa: E731 - a stand-in for rendered tokens
    got = with_distractors(recs[0], recs, words, 200, 260, seed=1)
    assert got is not None and 200 <= words(got) <= 260
    own = {p.text for p in recs[0].passages}
    assert own <= {p.text for p in got} and len(got) > 3
    assert len({p.id for p in got}) == len(got)  # ids unique, as the planner requires
    assert with_distractors(recs[0], recs, words, 200, 260, seed=1) == got  # seeded
    assert [p.text for p in got] != [p.text for p in with_distractors(recs[0], recs, words, 200, 260, seed=2)]
    assert with_distractors(recs[0], recs, words, 10, 20, seed=1) is None  # longer than the band alone
    assert with_distractors(recs[0], recs[:1], words, 200, 260, seed=1) is None  # nothing to pad with
