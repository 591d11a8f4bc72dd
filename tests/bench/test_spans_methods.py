"""``bench spans --set methods=``: part of the methods table, always with the rows its summary is built on."""

from __future__ import annotations

import pytest

from contextkit.bench.spans_methods import REFERENCE, default_method, methods, selected
from contextkit.core.errors import ConfigError


def test_methods_by_prefix_keep_the_rows_the_summary_needs():
    table = methods("bfloat16", "1.5k", 8)
    got = selected(table, "bfloat16", "all-layer,budget")
    base = {REFERENCE, "full (bfloat16)", default_method(table, "bfloat16"), "reuse"}
    assert set(got) == base | {"all-layer probe r=0.3", "budget 0.02", "budget 0.05"}
    assert list(got) == [n for n in table if n in got]  # the table's order
    assert selected(table, "bfloat16", None) is table and selected(table, "bfloat16", "") is table


def test_a_name_that_starts_no_method_is_refused_with_the_table():
    long_band = methods("float32", "3k", 8)  # a long band's shorter list: no first_k row, which 1.5k has
    assert "first_k k=8" not in long_band and "first_k k=8" not in selected(long_band, "float32", "first_k")
    with pytest.raises(ConfigError, match=r"no method starts with first-k; the methods: full, reuse, default"):
        selected(long_band, "float32", "first-k")
