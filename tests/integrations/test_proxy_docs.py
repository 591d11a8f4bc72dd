"""The shared document renderer: the same tokens as ``render_segments``, caches keyed by content."""

from __future__ import annotations

from contextkit.integrations.proxy_docs import Renderer
from contextkit.prompt import render_segments
from contextkit.tokenizer import Tokenizer
from contextkit.types import Evidence


def test_renderer_matches_render_segments_and_never_trusts_ids(smol_dir, gemma_dir):
    for model_dir in (smol_dir, gemma_dir):  # with a chat template, and a base model without one
        tok = Tokenizer(model_dir)
        docs = [Evidence("Paris is in France.", "Paris", "d1"), Evidence("Rome is in Italy.", None, "d2")]
        r = Renderer(tok, 32)
        msgs = [{"role": "user", "content": "Where is Paris?"}]
        assert r.ids(msgs, docs, [0, 1])[0] == render_segments(tok, "Where is Paris?", docs).ids
        reused = [Evidence("Berlin is in Germany.", "Paris", "d1")]  # a client reuses an id for new text
        assert r.ids(msgs, reused, [0])[0] == render_segments(tok, "Where is Paris?", reused).ids
        aligned, padding = r.ids(msgs, docs, [1, 0], block_align=True)
        assert padding > 0 and len(aligned) % 32 == len(r.frame(msgs)[1]) % 32
