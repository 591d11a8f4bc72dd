"""Block-aligned rendering: every document starts on a block boundary; the padding is counted."""

from __future__ import annotations

import random

import pytest

from contextkit.core.align import align, pad_to_block
from contextkit.core.errors import ConfigError


def test_every_document_starts_on_a_block_boundary():
    rng = random.Random(0)
    for _ in range(50):
        block = rng.choice([1, 16, 32])
        prefix = list(range(rng.randint(0, 70)))
        docs = [list(range(rng.randint(1, 200))) for _ in range(rng.randint(0, 6))]
        a = align(prefix, docs, block, pad_id=-1)
        start = len(a.prefix)
        assert start % block == 0
        for padded, doc in zip(a.documents, docs):
            assert start % block == 0
            assert list(padded[: len(doc)]) == doc and set(padded[len(doc):]) <= {-1}
            start += len(padded)
        assert a.padding == len(a.ids([])) - len(prefix) - sum(map(len, docs))
        assert a.ids([7, 8])[-2:] == [7, 8]


def test_aligned_input_is_unchanged_and_bad_block_size_is_refused():
    assert pad_to_block(range(64), 32, 0) == tuple(range(64))
    assert pad_to_block((), 32, 0) == ()
    assert align(list(range(32)), [list(range(32))], 32, 0).padding == 0
    with pytest.raises(ConfigError):
        pad_to_block([1], 0, 0)
