"""What a documents request's opt-in to KV reuse does, per kind of upstream connector: one object a kind,
chosen when the proxy starts (``ProxySettings.kv_connector``, ``reuse_path``), never a string tested
inside a request.

- ``Prompts`` ("none"): no opt-in; the prompt as the planner rendered it, its order recorded in the
  upstream's Weaver once accepted (its prefix cache now holds it).
- ``SpanReuse`` ("contextkit", ``span_compiler.py``): the spans' token ranges and the recompute setting go
  in ``kv_transfer_params`` under a ``cache_salt`` of their own; ``"policy": "full"`` runs as an exact
  request; spans the upstream's store lacked are compiled after the answer.
- ``Blending`` ("cacheblend", LMCache's CacheBlend): segments joined by the upstreams' separator; a prompt
  that did not opt in must hold no separator, in pass-through requests too; one tenant per deployment.

Adding a connector kind: a class here with its row in ``PATHS`` (``ProxySettings.kv_connector`` is checked
against it), and its tests in ``tests/integrations/proxy/test_reuse_paths.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from contextkit.core.errors import ConfigError, InputError
from contextkit.integrations.proxy.span_compiler import (
    check_options,
    pic_params,
    pic_salt,
    segments_of,
    spans_of,
    uses_spans,
)
from contextkit.integrations.vllm_connector.cacheblend import blend_prompt_ids, refuse_unasked_blend
from contextkit.integrations.vllm_connector.wire import ConnectorAnswer

if TYPE_CHECKING:
    from contextkit.core.plan import RequestPlan
    from contextkit.core.policy import ReuseOptions
    from contextkit.integrations.proxy.relay import Upstreams
    from contextkit.integrations.proxy.settings import ProxySettings
    from contextkit.integrations.proxy.upstreams import Upstream

log = logging.getLogger("contextkit.proxy")


@dataclass(frozen=True, slots=True)
class Sent:
    """What a reuse path made of one request: the report's start (None: no opt-in), whether the prompt is
    an exact prefix (its order is recorded in the Weaver once accepted), and whether it loads spans."""

    reuse: dict | None
    exact: bool
    spans: bool = False


class Prompts:
    """No connector: documents requests are prompts only (``contextkit.reuse`` is refused)."""

    kind = "none"
    allows_reuse = False
    guards_prompts = False  # pass-through prompts need no check

    def check_deployment(self, settings: ProxySettings, keys: dict[str, str]) -> None:
        """Refuse a deployment this path cannot serve safely (at start)."""

    def check(self, fields: dict) -> None:
        """The request's own ``contextkit.reuse`` fields (``InputError`` for what this path does not take)."""

    def salt(self, salt: str, reuse: ReuseOptions | None) -> str:
        """The ``cache_salt`` the request is placed and sent under."""
        return salt

    def prepare(self, out: dict, plan: RequestPlan, salt: str, reuse: ReuseOptions | None, *, ups: Upstreams,
                tokenizer) -> Sent:
        """Rewrite the completion body ``out`` for this path; what was made of it."""
        return Sent(None, exact=True)

    def streamed(self, ups: Upstreams, u: Upstream, model: str | None, salt: str, plan: RequestPlan,
                 sent: Sent) -> None:
        """A streamed answer began (it carries no connector answer)."""

    def answered(self, ups: Upstreams, u: Upstream, model: str | None, salt: str, plan: RequestPlan, sent: Sent,
                 answer: dict) -> dict | None:
        """The reuse report of a whole answer."""
        return sent.reuse


class SpanReuse(Prompts):
    """The contextkit KV connector: position-independent span reuse (``span_compiler.py``)."""

    kind = "contextkit"
    allows_reuse = True

    def check(self, fields: dict) -> None:
        check_options(fields)

    def salt(self, salt: str, reuse: ReuseOptions | None) -> str:
        return pic_salt(salt, reuse) if uses_spans(reuse) else salt

    def prepare(self, out: dict, plan: RequestPlan, salt: str, reuse: ReuseOptions | None, *, ups: Upstreams,
                tokenizer) -> Sent:
        if reuse is None:
            return Sent(None, exact=True)
        if not uses_spans(reuse):  # policy "full": an exact request
            return Sent({"path": "connector", "policy": "full"}, exact=True)
        out["kv_transfer_params"] = pic_params(plan, salt, reuse)
        out["cache_salt"] = pic_salt(salt, reuse)  # its own namespace: approximate KV stays request-only
        return Sent({"path": "connector", "spans": len(out["kv_transfer_params"]["contextkit"]["spans"])},
                    exact=False, spans=True)

    def streamed(self, ups, u, model, salt, plan, sent) -> None:
        if sent.spans:  # a stream carries no kv_transfer_params: compile every span this proxy has not
            ups.compiler.schedule(u.url, model, salt, [plan.ids[s:e] for s, e in spans_of(plan)], tenant=plan.tenant)

    def answered(self, ups, u, model, salt, plan, sent, answer) -> dict | None:
        if not sent.spans:
            return sent.reuse
        return {**sent.reuse, **connector_report(ups, u, model, salt, plan, answer.get("kv_transfer_params"),
                                                 answer.get("usage"))}


class Blending(Prompts):
    """LMCache's CacheBlend on the upstreams (``integrations/vllm_connector/cacheblend.py``)."""

    kind = "cacheblend"
    allows_reuse = True
    guards_prompts = True  # any prompt holding the separator would be blended: refused unless opted in

    def check_deployment(self, settings: ProxySettings, keys: dict[str, str]) -> None:
        if len(set(keys.values())) > 1 or settings.allow_client_tenant:
            raise ConfigError("LMCache's CacheBlend keys its store without a tenant (LMCache #2878): a blending "
                              "upstream serves one tenant. Give this proxy keys of one tenant and no "
                              "allow_client_tenant, and run one blending deployment per tenant")

    def check(self, fields: dict) -> None:
        """LMCache's KV-deviation recompute, at the ratio the upstreams' LMCache config sets (one a server)."""
        if fields.get("policy") != "kv_deviation" or set(fields) - {"policy"}:
            raise InputError('this proxy\'s upstreams run LMCache\'s CacheBlend: send contextkit.reuse = {"policy": '
                             '"kv_deviation"} (the recompute ratio is the one in the upstreams\' LMCache config)',
                             "contextkit")

    def prepare(self, out: dict, plan: RequestPlan, salt: str, reuse: ReuseOptions | None, *, ups: Upstreams,
                tokenizer) -> Sent:
        if reuse is None:  # not opted in: the blending upstream must find no separator in it
            refuse_unasked_blend(prompt_ids=plan.ids, separator=ups.settings.cacheblend_separator,
                                 separator_ids=ups.blend_separator(tokenizer))
            return Sent(None, exact=True)
        segments = segments_of(plan)  # segments joined by LMCache's separator
        out["prompt"] = blend_prompt_ids(segments, ups.blend_separator(tokenizer))
        return Sent({"path": "cacheblend", "segments": len(segments)}, exact=False)


PATHS: dict[str, type[Prompts]] = {p.kind: p for p in (Prompts, SpanReuse, Blending)}


def reuse_path(kind: str) -> Prompts:
    """The reuse path of upstreams running ``kind`` (``ProxySettings.kv_connector``, which its settings
    check against ``PATHS``: a KeyError here is a caller that skipped them)."""
    return PATHS[kind]()


def connector_report(ups: Upstreams, u: Upstream, model: str | None, salt: str, plan: RequestPlan,
                     params: dict | None, usage: dict | None = None) -> dict[str, Any]:
    """What the connector says it loaded and recomputed. Spans it saved out of this request (those the store
    lacked, computed here in context) need no compile; the others this proxy has not compiled are
    compiled after the answer, and those it found missing (evicted) compiled again."""
    try:
        got = ConnectorAnswer.of(params) or ConnectorAnswer()
    except ConfigError as exc:  # a connector of another release: nothing of its answer is read
        log.warning({"event": "connector answer refused", "upstream": u.name, "why": str(exc)})
        got = ConnectorAnswer()
    missing, saved, ids = set(got.missing_spans), set(got.saved_spans), plan.ids
    for s, e in saved:
        ups.compiler.remember(u.url, salt, ids[s:e])
    for s, e in missing - saved:
        ups.compiler.forget(u.url, salt, ids[s:e])
    ups.compiler.schedule(u.url, model, salt, [ids[s:e] for s, e in spans_of(plan) if (s, e) not in saved],
                          tenant=plan.tenant)
    out = {"loaded_tokens": got.loaded_tokens, "missing_spans": len(missing), "saved_spans": len(saved)}
    rec = got.recompute
    if rec is not None:  # what the connector resolved and recomputed, as serve reports it
        loaded, n = got.loaded_tokens, rec.get("recomputed_tokens") or 0
        reported = ("policy", "ratio", "probe_layers", "first_k", "fidelity_budget", "profile", "band", "requested",
                    "reason", "clamped", "limits")  # clamped / limits: the connector's operator limits cut the setting
        out.update({k: rec[k] for k in reported if k in rec})
        cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        out.update(recomputed_tokens=n, reused_tokens=max(0, loaded - n))
        if isinstance(cached, int):  # vLLM computed the rest of the prompt (the question, spans not loaded)
            out["prefilled_tokens"] = max(0, plan.num_tokens - cached)
    return out
