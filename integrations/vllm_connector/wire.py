"""The connector's wire format: what ``kv_transfer_params["contextkit"]`` holds, to vLLM and back.

One request's options go from the proxy (``integrations/proxy/span_compiler.py``; benchmarks and tests
build theirs here too) to the connector's scheduler side in the request's ``kv_transfer_params``
(``RequestOptions``); the connector answers what it loaded, saved and recomputed in the finished request's
``kv_transfer_params`` (``ConnectorAnswer``), which the proxy reads and keeps from the client. Both carry
``PROTOCOL_VERSION`` (``"v"``): a proxy and a connector of different versions refuse each other's
messages with a ``WireVersionError`` that says which side to upgrade (the connector then runs the request
as exact reuse and counts it; the proxy reports no reuse), never a silent misreading of a changed field.
Torch-free and vLLM-free: the proxy's light install imports it. vLLM keeps the same for its nixl
connector in one module with a version constant (``nixl/metadata.py``).

Adding a field: add it to the dataclass and to ``encode``/``decode`` here, with its test in
``tests/integrations/vllm_connector/test_wire.py``; bump ``PROTOCOL_VERSION`` when an old reader would
misread the new message (a new optional field an old reader ignores needs no bump).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from contextkit.core.errors import ConfigError, InputError
from contextkit.core.policy import CONNECTOR_FIELDS, REPAIR_POLICIES, ReuseOptions, connector_fields, variant
from contextkit.core.tenancy import pic_salt

PROTOCOL_VERSION = 1
KEY = "contextkit"  # the connector's entry in kv_transfer_params (and in kv_connector_extra_config)
MODES = ("exact", "span", "pic", "off")


class WireVersionError(ConfigError):
    """A message of another protocol version (or of none): refused, never misread."""


def _check_version(raw: Mapping, *, what: str) -> None:
    v = raw.get("v")
    if v != PROTOCOL_VERSION:
        got = "no version" if v is None else f"version {v!r}"
        raise WireVersionError(f"{what} has {got}; this side speaks version {PROTOCOL_VERSION}: run the proxy and "
                               "the vLLM connector from the same contextkit release (upgrade the older one)")


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What one request asks of the connector (``kv_transfer_params["contextkit"]``, set by the proxy).

    Attributes:
        mode: "exact" (default: save and load exact-prefix blocks), "span" (this prompt is one span compiled
            alone at position 0: save it as position-free span KV), "pic" (load the ``spans`` from
            position-free span KV re-rotated to their positions: reuse without recompute), "off" (neither
            load nor save: a measured full prefill).
        spans: for "pic", the ``[start, end)`` token ranges of the prompt that are spans, in order.
        salt: for "pic", the tenant's salt that span keys are named under (the request's own ``cache_salt``
            is ``core.tenancy.pic_salt`` of it, a separate namespace, so that its approximate blocks are
            never an exact-prefix hit). Clients can send ``kv_transfer_params`` to vLLM, so this is
            checked against the request's ``cache_salt`` (``namespace``), never trusted as it is.
        recompute_last: for "pic", compute the last span in its context instead of loading it.
        recompute: for "pic", recompute the loaded spans' most affected tokens in their new context before
            vLLM reads them (the connector's fields of ``core.policy.ReuseOptions``, ``for_connector``;
            None: reuse without recompute).
        probe_end: with ``recompute``, the prompt token where the selection's view of the question ends
            (None: the prompt's end). Benchmarks feeding a reference answer back set it so that the answer
            never steers which tokens are recomputed. Carried inside ``recompute`` on the wire.
    """

    mode: str = "exact"
    spans: tuple[tuple[int, int], ...] = ()
    salt: str | None = None
    recompute_last: bool = False
    recompute: ReuseOptions | None = None
    probe_end: int | None = None

    def encode(self) -> dict[str, Any]:
        """The request's ``kv_transfer_params``."""
        out: dict[str, Any] = {"v": PROTOCOL_VERSION, "mode": self.mode}
        if self.spans:
            out["spans"] = [list(s) for s in self.spans]
        if self.salt is not None:
            out["salt"] = self.salt
        if self.recompute_last:
            out["recompute_last"] = True
        if self.recompute is not None:
            out["recompute"] = connector_fields(self.recompute)
            if self.probe_end is not None:
                out["recompute"]["probe_end"] = self.probe_end
        return {KEY: out}

    @classmethod
    def of(cls, params: Mapping[str, Any] | None, num_prompt_tokens: int) -> RequestOptions:
        """Parse and check a request's options (``kv_transfer_params``); raises ``ConfigError`` saying what is
        wrong (``WireVersionError`` for another protocol version). No entry: an exact request."""
        raw = (params or {}).get(KEY)
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError("kv_transfer_params.contextkit must be an object")
        _check_version(raw, what="kv_transfer_params.contextkit")
        mode = raw.get("mode", "exact")
        if mode not in MODES:
            raise ConfigError(f"kv_transfer_params.contextkit.mode must be exact, span, pic or off, got {mode!r}")
        spans = _spans(raw.get("spans") or (), num_prompt_tokens)
        if mode == "pic" and not spans:
            raise ConfigError("a pic request names its spans: kv_transfer_params.contextkit.spans")
        salt = raw.get("salt")
        if salt is not None and not isinstance(salt, str):
            raise ConfigError("kv_transfer_params.contextkit.salt must be a string")
        repair = probe_end = None
        if raw.get("recompute") is not None:
            if mode != "pic":
                raise ConfigError("kv_transfer_params.contextkit.recompute is for pic requests")
            repair, probe_end = _recompute(raw["recompute"])
        return cls(mode, spans, salt, bool(raw.get("recompute_last", False)), repair, probe_end)

    def namespace(self, cache_salt: str | None) -> str | None:
        """The salt this request's keys are named under; raises ``ConfigError`` for a salt it may not use.

        The request's ``cache_salt`` is set by whoever the operator trusts (the proxy derives it from the
        caller's credentials); ``kv_transfer_params`` may come from the client. So the params' salt is
        used only by a pic request whose ``cache_salt`` is ``pic_salt`` of it (the proxy's own pairing):
        a client cannot name another tenant's namespace (or the unsalted one, ``salt: ""``), and a pic
        request under an exact salt would leave approximate KV in vLLM's prefix cache where exact
        requests hit it, so it loads nothing (it runs as exact reuse under its own salt)."""
        if self.mode != "pic":
            if self.salt is not None and self.salt != cache_salt:
                raise ConfigError("kv_transfer_params.contextkit.salt is only for pic requests (it must equal the "
                                  "request's cache_salt otherwise); keys are named under the request's cache_salt")
            return cache_salt
        named = variant(self.recompute) if self.recompute is not None else ""
        if not self.salt or cache_salt != pic_salt(self.salt, recompute_last=self.recompute_last, variant=named):
            raise ConfigError("a pic request's kv_transfer_params.contextkit.salt must be the tenant salt its "
                              "cache_salt is derived from (cache_salt = contextkit.core.tenancy.pic_salt(salt)); "
                              "send pic requests through the contextkit proxy")
        return self.salt

    def with_probe_end(self, probe_end: int | None) -> RequestOptions:
        """The same request with its recompute's view of the question ending at ``probe_end`` (benchmarks)."""
        if probe_end is None or self.recompute is None:
            return self
        return replace(self, probe_end=probe_end)


def _recompute(raw: Any) -> tuple[ReuseOptions, int | None]:
    """``kv_transfer_params.contextkit.recompute``: the setting and its ``probe_end``; ``ConfigError`` says what
    is wrong. Types are checked where the operator's limits are applied (``core.policy.clamp``)."""
    what = "kv_transfer_params.contextkit.recompute"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{what} must be an object")
    unknown = set(raw) - {*CONNECTOR_FIELDS, "probe_end"}
    if unknown:
        raise ConfigError(f"{what}: unknown fields {sorted(unknown)}; known: {', '.join(CONNECTOR_FIELDS)}, probe_end")
    policy = raw.get("policy", "budget")
    if policy not in REPAIR_POLICIES:
        raise ConfigError(f"recompute policy {policy!r} does not run inside vLLM; choose one of "
                          f"{', '.join(REPAIR_POLICIES)} (or none / full)")
    probe_end = raw.get("probe_end")
    if probe_end is not None and (type(probe_end) is not int or probe_end < 1):
        raise ConfigError(f"recompute.probe_end must be an integer >= 1, got {probe_end!r:.40}")
    try:
        return ReuseOptions(**{k: raw[k] for k in CONNECTOR_FIELDS if k in raw}), probe_end
    except InputError as exc:  # the connector runs such a request as exact reuse: one error type there
        raise ConfigError(str(exc)) from None
    except TypeError as exc:  # a comparison of a value of the wrong type inside the range checks
        raise ConfigError(f"{what}: {exc}") from None


def _spans(items, num_prompt_tokens: int) -> tuple[tuple[int, int], ...]:
    spans: list[tuple[int, int]] = []
    last = 0
    for item in items:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and all(type(x) is int for x in item)):
            raise ConfigError("kv_transfer_params.contextkit.spans holds [start, end] pairs of ints")
        s, e = item
        if not (last <= s < e <= num_prompt_tokens):
            raise ConfigError(f"span [{s}, {e}) is empty, overlaps the one before or ends past the prompt "
                              f"({num_prompt_tokens} tokens)")
        spans.append((s, e))
        last = e
    return tuple(spans)


@dataclass(frozen=True, slots=True)
class ConnectorAnswer:
    """What the connector did for a finished request (``kv_transfer_params["contextkit"]`` of its answer).

    Attributes:
        mode: the request's mode as the connector ran it ("exact" after a fallback).
        loaded_tokens: prompt tokens loaded from the store (exact blocks or re-rotated spans).
        recompute: the recompute report: what was resolved and recomputed (policy, ratio, probe_layers,
            first_k, fidelity_budget, profile, band, recomputed_tokens, clamped, limits, reason...); None:
            none asked.
        missing_spans: spans the store lacked (vLLM computed them in this prompt).
        saved_spans: of those, the ones saved out of this request as span KV.
    """

    mode: str = "exact"
    loaded_tokens: int = 0
    recompute: Mapping[str, Any] | None = None
    missing_spans: tuple[tuple[int, int], ...] = ()
    saved_spans: tuple[tuple[int, int], ...] = field(default=())

    def encode(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": PROTOCOL_VERSION, "mode": self.mode, "loaded_tokens": self.loaded_tokens}
        if self.recompute is not None:
            out["recompute"] = dict(self.recompute)
        if self.missing_spans:
            out["missing_spans"] = [list(m) for m in self.missing_spans]
        if self.saved_spans:
            out["saved_spans"] = [list(m) for m in self.saved_spans]
        return {KEY: out}

    @classmethod
    def of(cls, params: Mapping[str, Any] | None) -> ConnectorAnswer | None:
        """Read an answer's ``kv_transfer_params``; None when it carries none (a streamed answer, or an
        upstream without the connector). Raises ``WireVersionError`` for another version, ``ConfigError``
        for a malformed one."""
        raw = (params or {}).get(KEY)
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ConfigError("the connector's answer (kv_transfer_params.contextkit) must be an object")
        _check_version(raw, what="the connector's answer")
        rec = raw.get("recompute")
        loaded = raw.get("loaded_tokens") or 0
        if type(loaded) is not int or (rec is not None and not isinstance(rec, Mapping)):
            raise ConfigError("the connector's answer has a malformed loaded_tokens or recompute")
        return cls(str(raw.get("mode", "exact")), loaded, rec, _pairs(raw.get("missing_spans")),
                   _pairs(raw.get("saved_spans")))


def _pairs(items) -> tuple[tuple[int, int], ...]:
    return tuple((m[0], m[1]) for m in items or () if isinstance(m, list) and len(m) == 2
                 and all(type(x) is int for x in m))
