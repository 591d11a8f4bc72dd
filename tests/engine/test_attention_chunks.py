"""Scattered rows (selective recomputation) run attention per row chunk over the keys they may see."""

from __future__ import annotations

import pytest
import torch

import contextkit.engine.model as model_mod
from contextkit.engine.model import Engine, _row_chunks


@pytest.fixture(scope="module")
def engine(smol_dir):
    return Engine.from_dir(smol_dir)


def test_chunks_cover_every_row_and_every_visible_key():
    torch.manual_seed(0)
    slots = torch.randperm(2000)[:700].sort().values
    mask = torch.arange(2000)[None, :] <= slots[:, None]
    chunks = _row_chunks(mask)
    assert chunks is not None
    covered = torch.zeros_like(mask)
    for rows, lo, hi in chunks:
        covered[rows, lo:hi] = True
    assert bool((covered | ~mask).all())  # every visible key of every row is inside its chunk's range
    assert sum(r.stop - r.start for r, _, _ in chunks) == 700
    assert sum((r.stop - r.start) * (hi - lo) for r, lo, hi in chunks) < 0.7 * mask.numel()


def test_few_rows_or_rows_that_see_everything_make_one_call():
    assert _row_chunks(None) is None
    assert _row_chunks(torch.ones(100, 500, dtype=torch.bool)) is None  # too few rows to split
    assert _row_chunks(torch.ones(600, 500, dtype=torch.bool)) is None  # nothing to cut


@pytest.mark.slow  # the slowest of the fast tier (a real model, both dtypes)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_recomputing_scattered_rows_matches_one_masked_call(smol_dir, dtype, monkeypatch):
    """Overwriting 60% of a 900-token cache in place, chunked and unchunked, gives the same KV and logits."""
    engine = Engine.from_dir(smol_dir, dtype)
    torch.manual_seed(1)
    ids = torch.randint(100, 20000, (900,))
    base = engine.new_cache(920)
    engine.forward(base, ids, logits="none")
    slots = torch.randperm(880)[:540].sort().values
    rows = torch.cat([slots, torch.arange(900, 910)])
    new_ids = torch.randint(100, 20000, (rows.numel(),))
    out = {}
    for name in ("chunked", "one call"):
        if name == "one call":
            monkeypatch.setattr(model_mod, "_row_chunks", lambda mask: None)
        cache = base.clone()
        logits = engine.forward(cache, new_ids, positions=rows, slots=rows)
        out[name] = (logits, cache)
    # bf16: the two call shapes sum in another order, so they differ by bf16 rounding (~1e-2 relative)
    tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
    for a, b in ((out["chunked"][0], out["one call"][0]), (out["chunked"][1].k, out["one call"][1].k),
                 (out["chunked"][1].v, out["one call"][1].v)):
        a, b = a.float(), b.float()
        assert float((a - b).norm() / b.norm()) < tol
