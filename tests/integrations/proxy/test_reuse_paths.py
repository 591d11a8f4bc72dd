"""``integrations/proxy/reuse_paths.py``: what a documents request's opt-in to reuse does, one object per kind
of upstream connector, chosen at start. Each path is tried on a real plan (the planner on SmolLM2's
tokenizer) and a real ``Upstreams`` (not opened: no request leaves the test)."""

from __future__ import annotations

import pytest

from contextkit.core.errors import ConfigError, InputError
from contextkit.core.planner import ChatRequest, Planner
from contextkit.core.policy import ReuseOptions
from contextkit.core.tenant import Tenant
from contextkit.core.tokenizer import Tokenizer
from contextkit.core.types import Evidence, Message
from contextkit.integrations.proxy.app import ProxyMetrics
from contextkit.integrations.proxy.relay import Upstreams
from contextkit.integrations.proxy.reuse_paths import PATHS, Blending, Prompts, SpanReuse, reuse_path
from contextkit.integrations.proxy.settings import ProxySettings

pytestmark = pytest.mark.slow  # loads the tokenizer


@pytest.fixture(scope="module")
def planner(smol_dir):
    return Planner(Tokenizer(smol_dir), block_size=32)


def _plan(planner, reuse: ReuseOptions | None, text: str = "The bridge opened in 1890."):
    docs = (Evidence(text, id="a"), Evidence("The tower is 300 metres tall.", id="b"))
    request = ChatRequest((Message("user", "When did it open?"),), docs, tenant=Tenant("acme"), reuse=reuse)
    return planner.plan(request)


def _ups(kind: str, tmp_path) -> Upstreams:
    settings = ProxySettings(upstreams=["http://127.0.0.1:9"], kv_connector=kind, cache_dir=tmp_path)
    return Upstreams(settings, ProxyMetrics())


def test_each_connector_kind_has_its_path_and_an_unknown_one_is_refused_at_start():
    assert {k: type(reuse_path(k)) for k in PATHS} == {"none": Prompts, "contextkit": SpanReuse,
                                                        "cacheblend": Blending}
    with pytest.raises(ValueError, match="kv_connector"):  # pydantic's ValidationError, as for every setting
        ProxySettings(upstreams=["http://127.0.0.1:9"], kv_connector="lmcache")


def test_prompts_only_records_the_order_and_changes_nothing(planner, tmp_path):
    path, plan = reuse_path("none"), _plan(planner, None)
    out = {"prompt": list(plan.ids), "cache_salt": "s"}
    sent = path.prepare(out, plan, "s", None, ups=_ups("none", tmp_path), tokenizer=planner.tokenizer)
    assert (sent.reuse, sent.exact, sent.spans) == (None, True, False)
    assert out == {"prompt": list(plan.ids), "cache_salt": "s"} and path.salt("s", None) == "s"
    assert not path.allows_reuse and not path.guards_prompts


def test_span_reuse_sends_its_spans_under_a_salt_of_its_own(planner, tmp_path):
    path, reuse = reuse_path("contextkit"), ReuseOptions(policy="query_attention", ratio=0.2)
    plan, ups = _plan(planner, reuse), _ups("contextkit", tmp_path)
    out = {"prompt": list(plan.ids), "cache_salt": "s"}
    sent = path.prepare(out, plan, "s", reuse, ups=ups, tokenizer=planner.tokenizer)
    assert sent.spans and not sent.exact and sent.reuse["path"] == "connector"
    assert out["cache_salt"] == path.salt("s", reuse) != "s"  # approximate KV: never an exact-prefix hit
    assert out["kv_transfer_params"]["contextkit"]["recompute"]["ratio"] == 0.2
    full = {"prompt": list(plan.ids), "cache_salt": "s"}
    sent = path.prepare(full, plan, "s", ReuseOptions(policy="full"), ups=ups, tokenizer=planner.tokenizer)
    assert sent.exact and not sent.spans and "kv_transfer_params" not in full and full["cache_salt"] == "s"
    with pytest.raises(InputError, match="attention_budget"):
        path.check({"policy": "query_attention", "attention_budget": 0.2})


def test_blending_joins_segments_and_refuses_a_separator_it_was_not_asked_to_blend(planner, tmp_path):
    path, ups = reuse_path("cacheblend"), _ups("cacheblend", tmp_path)
    reuse = ReuseOptions(policy="kv_deviation")
    plan = _plan(planner, reuse)
    out = {"prompt": list(plan.ids)}
    sent = path.prepare(out, plan, "s", reuse, ups=ups, tokenizer=planner.tokenizer)
    assert sent.reuse == {"path": "cacheblend", "segments": sent.reuse["segments"]} and not sent.exact
    assert len(out["prompt"]) > len(plan.ids)  # the separator's ids between segments
    unasked = _plan(planner, None, text="Rome # \nParis")  # its tokens hold the separator's (boundary test)
    with pytest.raises(InputError, match="separator"):
        path.prepare({"prompt": list(unasked.ids)}, unasked, "s", None, ups=ups, tokenizer=planner.tokenizer)
    with pytest.raises(InputError, match="kv_deviation"):
        path.check({"policy": "query_attention"})
    with pytest.raises(ConfigError, match="one tenant"):
        path.check_deployment(ups.settings, {"k1": "acme", "k2": "globex"})
    path.check_deployment(ups.settings, {"k1": "acme", "k2": "acme"})
    assert path.guards_prompts
