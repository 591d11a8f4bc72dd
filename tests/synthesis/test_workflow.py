"""Workflows as DAGs of generation steps: graph checks, dependency order with fan-out batched in one fork,
fan-in and chains reading their inputs' KV, and a failing step that skips only what needs it."""

from __future__ import annotations

import pytest

from contextkit.core.generation import SamplingParams
from contextkit.core.tokenizer import Tokenizer
from contextkit.engine.model import Engine
from contextkit.spans.assemble import SpanCache
from contextkit.synthesis.workflow import Step, Workflow, WorkflowError


def test_the_graph_is_checked():
    with pytest.raises(WorkflowError, match="cycle: a -> b -> a"):
        Workflow([Step("a", "x", ("b",)), Step("b", "y", ("a",))])
    with pytest.raises(WorkflowError, match="reads 'nope'"):
        Workflow([Step("a", "x", ("nope",))])
    with pytest.raises(WorkflowError, match="share a name"):
        Workflow([Step("a", "x"), Step("a", "y")])
    wf = Workflow([Step("w1", "x"), Step("w2", "y"), Step("merge", "z", ("w1", "w2")), Step("final", "f", ("merge",))])
    assert wf.order() == [["w1", "w2"], ["merge"], ["final"]]


@pytest.mark.slow
def test_fan_out_fan_in_and_a_chain_on_the_real_model(smol_dir):
    engine, tok = Engine.from_dir(smol_dir), Tokenizer(smol_dir)
    spans = SpanCache(engine, tokenizer_fingerprint=tok.fingerprint)
    wf = Workflow([
        Step("dates", "List the year the Eiffel Tower opened.\nNote:", max_new_tokens=8),
        Step("people", "Name who built the Eiffel Tower.\nNote:", max_new_tokens=8),
        Step("broken", "This step asks for more tokens than the model holds.", max_new_tokens=9000),
        Step("merge", "\nCombine the notes above into one sentence:", ("dates", "people"), max_new_tokens=12),
        Step("title", "\nA title for that sentence:", ("merge",), max_new_tokens=6),
        Step("after_broken", "\nSummarise:", ("broken",), max_new_tokens=4),
    ])
    out = wf.run(spans, tok, "You are a team of writers working on one short article.\n\n",
                 params=SamplingParams(stop_token_ids=()))
    assert out["dates"].batched_with == out["people"].batched_with == ("dates", "people")  # one fork
    assert "over the model's" in out["broken"].error  # a step past the model's context...
    for n in ("dates", "people", "merge", "title"):
        assert out[n].ok and out[n].token_ids and out[n].span is not None, (n, out[n].error)
    merge, title = out["merge"].report, out["title"].report
    assert merge.hits == 2 and merge.misses == 1  # both inputs' KV; the prefix compiled once, here...
    assert title.hits == 2 and title.misses == 0  # ...and a hit for the next step, beside merge's output
    assert out["after_broken"].error.startswith("skipped: input 'broken'")  # ...skips only what needs it
