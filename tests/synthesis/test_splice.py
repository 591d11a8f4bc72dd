"""A kept answer whose generated tokens are not how its text tokenizes (``synthesis.splice``): a model may
generate ``' "'`` then ``'__'`` where the text tokenizes as ``' "__'``. The synthesizer's prompt holds the
text; the answer is aligned with it and read from its KV in pieces, each re-based to position 0, with the
tokens between them computed; the prompt is the same token for token."""

from __future__ import annotations

import pytest
import torch

from contextkit.core.plan import PlanItem, RequestPlan
from contextkit.core.policy import ReuseOptions
from contextkit.core.tenant import Tenant
from contextkit.core.tokenizer import Tokenizer
from contextkit.core.types import Span
from contextkit.engine import Engine
from contextkit.spans.assemble import SpanCache
from contextkit.spans.key import span_key
from contextkit.spans.store import CompiledSpan
from contextkit.synthesis.handles import KeptSpans
from contextkit.synthesis.parallel import generated_span
from contextkit.synthesis.splice import MIN_RUN, splice

pytestmark = pytest.mark.slow

ANSWER = ('A file with the name "__init__.py" in the package directory, which marks the folder as a '
          'Python package.')


@pytest.fixture(scope="module")
def spans(smol_dir):
    engine, tok = Engine.from_dir(smol_dir), Tokenizer(smol_dir)
    return SpanCache(engine, tokenizer_fingerprint=tok.fingerprint), tok


def _generated(tok) -> tuple[int, ...]:
    """The answer's text as a model may generate it: the same text, other token boundaries."""
    cut = ANSWER.index("__init__")
    ids = tuple(tok.encode(ANSWER[:cut]) + tok.encode(ANSWER[cut:]))
    assert tok.decode(list(ids)) == ANSWER and ids != tuple(tok.encode(ANSWER))
    return ids


def test_an_answer_that_tokenizes_otherwise_is_read_in_aligned_pieces(spans):
    cache_of, tok = spans
    acme = Tenant("acme")
    worker = tuple(tok.encode("You are a sub-agent. Describe the file name you are given.\nFile name: x\n"))
    ids = _generated(tok)
    cache = cache_of.engine.new_cache(len(worker) + len(ids))
    cache_of.engine.forward(cache, list(worker + ids), logits="none")
    slots = range(len(worker), len(worker) + len(ids))
    context = span_key(cache_of.identity, worker, (), acme)
    kept = generated_span(cache_of, cache, slots, ids, context, acme)
    store = KeptSpans()
    store.put(acme, "w1", kept, ANSWER)

    text = tuple(tok.encode("Note 1:\n" + ANSWER))
    plan = RequestPlan((PlanItem(Span(tuple(tok.encode("You combine notes.\n")), "system")),
                        PlanItem(Span(text, "document")),
                        PlanItem(Span(tuple(tok.encode("\nWhat is the file?")), "query"), reuse=False)),
                       ReuseOptions())
    new, provided, reads = splice(plan, ["w1"], store, acme, spans=cache_of)
    (read,) = reads
    assert read.read == "kv" and len(ids) // 2 <= read.tokens < len(ids)  # most of it, not the odd tokens
    assert new.ids == plan.ids and len(provided) >= 2  # the same prompt; the answer in pieces
    for j, piece in provided.items():
        assert new.items[j].reuse and new.items[j].span.token_ids == piece.token_ids
        assert piece.num_tokens >= MIN_RUN and piece.problem(piece.key) is None
        # each piece is the worker's KV for those tokens, re-based to position 0: as if cut out directly
        b = next(b for b in range(len(ids)) if ids[b:b + piece.num_tokens] == piece.token_ids)
        direct = generated_span(cache_of, cache, slots[b:b + piece.num_tokens], piece.token_ids, context, acme)
        torch.testing.assert_close(piece.k, direct.k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(piece.v, direct.v)
    # the synthesizer's KV path takes the pieces (a forward over what lies between and the query)
    asm = cache_of.assemble(new, extra_capacity=1, provided=provided)
    assert asm.report.hits == len(provided) and asm.logits is not None
    # without the span cache to re-base pieces, only a whole run is read: here, none (the text is used)
    assert [r.read for r in splice(plan, ["w1"], store, acme)[2]] == ["mismatch"]


def test_an_answer_the_prompt_holds_only_scraps_of_is_a_mismatch(spans):
    cache_of, tok = spans
    acme = Tenant("acme")
    ids = _generated(tok)
    k = torch.zeros(cache_of.engine.spec.num_layers, cache_of.engine.spec.num_kv_heads, len(ids),
                    cache_of.engine.spec.head_dim)
    store = KeptSpans()
    store.put(acme, "w1", CompiledSpan(span_key(cache_of.identity, ids, (), acme), ids, k, k.clone()), ANSWER)
    # the prompt quotes the first words only: fewer than half the answer's tokens agree
    scraps = tuple(tok.encode("Note 1:\nA file with the name, and nothing else."))
    plan = RequestPlan((PlanItem(Span(scraps, "document")),
                        PlanItem(Span(tuple(tok.encode("\nWhat is it?")), "query"), reuse=False)), ReuseOptions())
    new, provided, reads = splice(plan, ["w1"], store, acme, spans=cache_of)
    assert [r.read for r in reads] == ["mismatch"] and not provided and new.ids == plan.ids

