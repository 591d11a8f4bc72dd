"""Where a synthesizer's prompt holds its workers' kept answers, and their KV in its plan.

``splice`` looks for each named handle's kept answer (``synthesis.handles``) in the rendered prompt and makes
that stretch a reused span whose KV is the kept one. The answer's tokens are what the worker generated,
which need not be how its text tokenizes in the synthesizer's prompt: a model may generate ``' "'`` then
``'__'`` where the text tokenizes as ``' "__'`` (a file name in quotes, code, a path: agents' usual output),
and its last tokens may merge with what follows (Qwen's pre-tokenizer joins ``"."`` and ``"\\n\\n"``). So:

1. the answer's tokens as one run (up to ``TAIL_SLACK`` tokens at its end left to the text): one piece;
2. else the answer aligned against the prompt's items (``difflib``'s matching blocks, each at least
   ``MIN_RUN`` tokens, in order, within one item and a stretch not much longer than the answer): each
   agreeing run is a piece of the kept KV (re-based to position 0), the tokens between them computed in
   context. It needs the span cache (``spans``) to re-rotate a piece that does not start the answer.

Fewer than half of the answer's tokens found: the text is prefilled (``mismatch``).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any

from contextkit.core.errors import InputError
from contextkit.core.plan import PlanItem, RequestPlan
from contextkit.core.tenant import Tenant
from contextkit.core.types import Span, handle_name
from contextkit.spans.compile import rotate_layers
from contextkit.spans.key import token_digest
from contextkit.spans.store import CompiledSpan
from contextkit.synthesis.handles import HandleRead, Kept, KeptSpans

TAIL_SLACK = 2  # answer tokens at the end that may be left to the text (they tokenize with what follows)
AUTO = "auto"  # ``contextkit.handles: "auto"``: the tenant's recent kept answers, wherever their text is
MIN_RUN = 4  # an aligned run shorter than this is left to the text (a short run is as likely a coincidence)
SPREAD = 2  # an aligned answer spans at most this many times its length (+ MIN_RUN) of its prompt item

Run = tuple[int, int, int]  # (offset in the item, offset in the answer, tokens)


def splice(plan: RequestPlan, handles: Sequence[Any] | str, store: KeptSpans, tenant: Tenant, *,
           spans=None) -> tuple[RequestPlan, dict[int, CompiledSpan], list[HandleRead]]:
    """``plan`` with each named handle's kept answer, where its tokens are in the prompt, made reused spans
    read from its KV: returns the new plan, the KV it is provided with (item index -> span) and what was
    done with each handle, in the order named. ``spans`` (the kit's span cache): answers whose tokens differ
    from their text's are read in aligned pieces; None: only as one run.

    ``handles`` may be ``AUTO``: the tenant's ``max_per_request`` most recent kept answers are looked for
    (for a framework that passes results on as text and drops response ids); only those found are
    reported."""
    if isinstance(handles, str):
        if handles != AUTO:
            raise InputError(f"contextkit.handles is a list of handles or {AUTO!r}, got {handles[:40]!r}",
                             "contextkit")
        new, provided, reads = splice(plan, store.recent(tenant, store.limits.max_per_request), store, tenant,
                                      spans=spans)
        return new, provided, [r for r in reads if r.read in ("kv", "not_reused")]
    if len(handles) > store.limits.max_per_request:
        raise InputError(f"{len(handles)} handles named; at most {store.limits.max_per_request} per request "
                         "(send the rest as text only)", "contextkit")
    found, reads = _look_up(plan, handles, store, tenant)
    items = list(plan.items)
    provided: dict[int, CompiledSpan] = {}  # by the kept piece's PlanItem identity, until the indices settle
    read: dict[str, int] = {}
    for name, kept in found.items():
        placed = _placed(items, kept.span.token_ids, spans is not None)
        if placed is None:
            continue
        i, runs = placed
        pieces = [_piece(kept.span, b, n, spans) for _, b, n in runs]
        new = _split(items[i], runs, name)
        items[i:i + 1] = new
        for it, piece in zip((it for it in new if _is_kept(it)), pieces):
            provided[id(it)] = piece
        read[name] = sum(n for *_, n in runs)
    provided = {j: provided[id(it)] for j, it in enumerate(items) if id(it) in provided}
    read_tokens = _documents_read(items, {n: found[n] for n in read}, provided)
    reads = [r if r.read != "kv" else (dataclasses.replace(r, tokens=read[r.handle],
                                                           read_tokens=read_tokens.get(r.handle, 0))
                                       if r.handle in read else dataclasses.replace(r, read="mismatch"))
             for r in reads]
    return dataclasses.replace(plan, items=tuple(items)), provided, reads


def _look_up(plan: RequestPlan, handles: Sequence[Any], store: KeptSpans,
             tenant: Tenant) -> tuple[dict[str, Kept], list[HandleRead]]:
    """The kept answers to place (by handle) and, in the order named, how each handle is read so far."""
    reads: list[HandleRead] = []
    found: dict[str, Kept] = {}
    for h in handles:
        name = handle_name(h)
        if name in found or any(r.handle == name for r in reads):
            reads.append(HandleRead(name, "repeated"))
            continue
        kept, why = store.get(tenant, h)
        if kept is None:
            reads.append(HandleRead(name, why))
        elif plan.options is None or plan.options.policy == "full":
            reads.append(HandleRead(name, "not_reused"))
        else:
            found[name] = kept
            reads.append(HandleRead(name, "kv"))
    return found, reads


def _placed(items: list[PlanItem], ids: tuple[int, ...], align: bool) -> tuple[int, list[Run]] | None:
    """Where the answer ``ids`` lies: the item and its runs, or None (fewer than half its tokens found)."""
    for m in range(len(ids), max(len(ids) - TAIL_SLACK, 1) - 1, -1):
        at = _place(items, ids[:m])
        if at is not None:
            return at[0], [(at[1], 0, m)]
    return _align(items, ids) if align else None


def _reusable(items: list[PlanItem], i: int) -> tuple[int, ...]:
    """Item ``i``'s tokens an answer may lie in: the prompt's last token is never reused (its logits start
    the answer)."""
    ids = items[i].span.token_ids
    return ids[:len(ids) - 1] if i == len(items) - 1 else ids


def _place(items: list[PlanItem], needle: tuple[int, ...]) -> tuple[int, int] | None:
    """The first (item, offset) where ``needle`` lies inside one item that is not already a kept answer."""
    n = len(needle)
    for i, it in enumerate(items):
        if _is_kept(it):
            continue
        ids = _reusable(items, i)
        a = 0
        while a <= len(ids) - n:
            try:
                a = ids.index(needle[0], a, len(ids) - n + 1)  # C speed: a prompt is scanned per named handle
            except ValueError:
                break
            if tuple(ids[a:a + n]) == needle:
                return i, a
            a += 1
    return None


def _align(items: list[PlanItem], ids: tuple[int, ...]) -> tuple[int, list[Run]] | None:
    """The item where most of ``ids`` agrees with the prompt in runs of at least ``MIN_RUN`` tokens (in order,
    within ``SPREAD`` times the answer's length), if that is at least half of it."""
    best: tuple[int, int, list[Run]] | None = None
    for i, it in enumerate(items):
        if _is_kept(it):
            continue
        hay = _reusable(items, i)
        blocks = difflib.SequenceMatcher(None, hay, ids, autojunk=False).get_matching_blocks()
        runs = [(a, b, n) for a, b, n in blocks if n >= MIN_RUN]
        while runs and runs[-1][0] + runs[-1][2] - runs[0][0] > SPREAD * len(ids) + MIN_RUN:
            runs = runs[1:] if runs[0][2] < runs[-1][2] else runs[:-1]  # too spread out: drop the smaller end
        covered = sum(n for *_, n in runs)
        if covered * 2 >= len(ids) and (best is None or covered > best[0]):
            best = (covered, i, runs)
    return None if best is None else (best[1], best[2])


def _piece(span: CompiledSpan, b: int, n: int, spans) -> CompiledSpan:
    """Tokens ``[b, b + n)`` of a position-free span, position-free (token ``b`` moved to position 0)."""
    if b == 0 and n == span.num_tokens:
        return span
    ids = span.token_ids[b:b + n]
    k = span.k[:, :, b:b + n].clone()
    if b:
        rotate_layers(spans.engine, k, -b, k, spans.rerotator)
    key = dataclasses.replace(span.key, tokens=token_digest(ids), num_tokens=n)
    return CompiledSpan(key, ids, k, span.v[:, :, b:b + n].contiguous())


def _documents_read(items: list[PlanItem], found: dict[str, Kept],
                    provided: dict[int, CompiledSpan]) -> dict[str, int]:
    """Documents of the prompt that a placed answer's worker read, provided with the worker's KV for them
    (whole documents, the same tokens); returns the tokens read so per handle."""
    out: dict[str, int] = {}
    for name, kept in found.items():
        for doc in kept.read:
            j = next((j for j, it in enumerate(items) if j not in provided and it.reuse
                      and it.span.kind == "document" and it.span.token_ids == doc.token_ids), None)
            if j is not None:
                provided[j] = doc
                out[name] = out.get(name, 0) + doc.num_tokens
    return out


def _is_kept(item: PlanItem) -> bool:
    return item.reuse and item.span.kind == "tool_output" and (item.span.name or "").startswith("handle ")


def _split(item: PlanItem, runs: list[Run], handle: str) -> list[PlanItem]:
    """``item`` as its kept runs (reused: their KV is provided) and what lies around them (computed in
    context)."""
    ids = item.span.token_ids
    out, at = [], 0
    for a, _, n in runs:
        if a > at:
            out.append(PlanItem(Span(ids[at:a], "tool_output"), reuse=False))
        out.append(PlanItem(Span(ids[a:a + n], "tool_output", f"handle {handle}")))
        at = a + n
    if at < len(ids):
        out.append(PlanItem(Span(ids[at:], "tool_output"), reuse=False))
    return out
