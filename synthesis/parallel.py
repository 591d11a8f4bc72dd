"""Parallel agent branches over one shared prefix, and a synthesizer that reads their KV.

``fork``: N worker branches from a shared prefix live in ONE KV cache: the prefix's slots are written
once and every branch attends to them (the same storage, no copy per branch); each branch's own prompt
and generated tokens are a segment of their own that sees only the prefix and itself
(``KVCache`` segments + ``attend``). Branches decode together, one forward per step for every branch
still running (a batch of rows of different segments). A branch that fails (its hook raises, it runs
out of room) stops with its error; the others go on.

``join``: a synthesizer's context is its own head (system prompt, question), each branch's generated
span, and its tail (the instruction to answer). Each branch span's KV is taken from the fork (keys
rotated back to position 0: position-free), laid at its new position and partly recomputed per the
request's ``ReuseOptions`` (``SpanCache.assemble(provided=...)``), instead of re-prefilling the branches'
text. That KV was computed while the branch read its own inputs, which the synthesizer never sees: it
is approximate by construction, so ``join`` keeps it request-only (never put in the span store) and
the result's report says what was reused and recomputed. ``join_text`` is the baseline: the same
context with the branches' text, prefilled in full. With ``transcripts=True`` the synthesizer reads
each branch's prompt (what the worker read) as well as what it generated, as a lead agent reading its
subagents' transcripts: the prompt's KV was computed after the shared prefix only, like a document
compiled alone, and is re-positioned the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from contextkit.core.engine import KVEngine
from contextkit.core.errors import ConfigError, EmptyInputError
from contextkit.core.generation import SamplingParams
from contextkit.core.kvcache import KVCache
from contextkit.core.plan import PlanItem, RequestPlan
from contextkit.core.policy import ReuseOptions
from contextkit.core.sampling import sample
from contextkit.core.tenant import Tenant
from contextkit.core.types import Span
from contextkit.spans.compile import rotate_layers
from contextkit.spans.key import span_key
from contextkit.spans.store import CompiledSpan

Hook = Callable[[int, int], None]  # (branch index, token id) after each token; raising fails the branch


@dataclass
class Branch:
    """One worker branch: its prompt, what it generated, and where its tokens sit in the fork's cache."""

    index: int
    prompt_ids: tuple[int, ...]
    token_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # slots of prompt + generated tokens, in order
    text: str = ""
    finish_reason: str = "length"
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Fork:
    """N branches sharing one prefix's KV (see the module docstring). Build with ``fork``."""

    def __init__(self, spans, tokenizer, prefix_ids: Sequence[int], prompts: Sequence[Sequence[int]],
                 params: SamplingParams, tenant: Tenant | str = "", limits: Sequence[int] | None = None):
        if not prefix_ids:
            raise EmptyInputError("fork needs a shared prefix (at least one token)")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise EmptyInputError("fork needs one non-empty prompt per branch")
        self.spans, self.tokenizer, self.params = spans, tokenizer, params
        self.engine: KVEngine = spans.engine
        self.tenant = Tenant.of(tenant)
        self.prefix_ids = tuple(prefix_ids)
        self.branches = [Branch(i, tuple(p)) for i, p in enumerate(prompts)]
        # tokens each branch may generate (the params' budget unless a branch has its own)
        self.limits = list(limits) if limits is not None else [params.max_new_tokens] * len(prompts)
        if len(self.limits) != len(prompts) or min(self.limits) < 1:
            raise ConfigError("fork: one limit >= 1 per branch")
        for b, lim in zip(self.branches, self.limits):
            longest = len(self.prefix_ids) + len(b.prompt_ids) + lim
            if longest > self.engine.spec.max_positions:
                raise ConfigError(f"branch {b.index} needs {longest} positions, over the model's "
                                  f"{self.engine.spec.max_positions}; shorten its prompt or lower its max_new_tokens")
        need = len(self.prefix_ids) + sum(len(p) for p in prompts) + sum(self.limits)
        # (layers, kv_heads, slots, head_dim): prefix, then each branch's prompt, then generated tokens
        # of all branches interleaved step by step
        self.cache: KVCache = self.engine.new_cache(need)
        self.attend = {b.index + 1: (0,) for b in self.branches}  # segment b+1 sees the prefix (segment 0)

    def run(self, hook: Hook | None = None) -> list[Branch]:
        """Prefill the prefix once and each branch's prompt, then decode all branches together."""
        eng, cache, p = self.engine, self.cache, self.params
        n0 = len(self.prefix_ids)
        eng.forward(cache, list(self.prefix_ids), positions=torch.arange(n0), segment=0, logits="none")
        logits: dict[int, torch.Tensor] = {}
        for b in self.branches:
            start = cache.length
            out = eng.forward(cache, list(b.prompt_ids), positions=torch.arange(n0, n0 + len(b.prompt_ids)),
                              segment=b.index + 1, attend=self.attend)
            b.slots = list(range(start, cache.length))
            logits[b.index] = out[0]
        stop_ids = set(eng.spec.eos_token_ids if p.stop_token_ids is None else p.stop_token_ids)
        gens = {b.index: torch.Generator().manual_seed(p.seed + b.index) if p.seed is not None else None
                for b in self.branches}
        running = list(self.branches)
        while running:
            step: list[tuple[Branch, int]] = []
            for b in running:
                try:
                    token = sample(logits[b.index], p, gens[b.index])
                    if token in stop_ids:
                        b.finish_reason = "stop"
                        continue
                    if hook is not None:
                        hook(b.index, token)
                except Exception as exc:  # noqa: BLE001 - one branch's failure is recorded, the others go on
                    b.error = f"{type(exc).__name__}: {exc}"
                    continue
                b.token_ids.append(token)
                step.append((b, token))  # its KV is written below (the last token's too: join reads it)
            running = [b for b, _ in step if len(b.token_ids) < self.limits[b.index]]
            if not step:
                break
            start = cache.length
            ids = [t for _, t in step]
            pos = [n0 + len(b.prompt_ids) + len(b.token_ids) - 1 for b, _ in step]
            seg = torch.tensor([b.index + 1 for b, _ in step])
            # one forward for every branch's next token: rows of different segments in one batch
            out = eng.forward(cache, ids, positions=pos, segment=seg, attend=self.attend,
                              logits="all" if running else "none")
            for j, (b, _) in enumerate(step):
                b.slots.append(start + j)
                if out is not None:
                    logits[b.index] = out[j]
        for b in self.branches:
            b.text = self.tokenizer.decode(b.token_ids)
        return self.branches

    def span(self, branch: Branch, transcript: bool = False) -> CompiledSpan:
        """The KV of a branch's generated tokens (``transcript``: its prompt and generated tokens),
        position-free (keys rotated back to position 0).

        Its key depends on what the KV saw before it (the prefix, and the branch's prompt unless that is
        part of the span), so it can never be mistaken for the same tokens compiled alone."""
        if not branch.ok:
            raise ConfigError(f"branch {branch.index} failed ({branch.error}); join the others")
        if not branch.token_ids:
            raise EmptyInputError(f"branch {branch.index} generated nothing")
        ids = self.read(branch, transcript)
        skip = 0 if transcript else len(branch.prompt_ids)
        slots = branch.slots[skip:][: len(ids)]
        seen = self.prefix_ids if transcript else self.prefix_ids + branch.prompt_ids
        context = span_key(self.spans.identity, seen, (), self.tenant)
        return generated_span(self.spans, self.cache, slots, ids, context, self.tenant)

    @staticmethod
    def read(branch: Branch, transcript: bool = False) -> tuple[int, ...]:
        """What a synthesizer reads of a branch: its generated tokens, or its prompt and them."""
        return (branch.prompt_ids if transcript else ()) + tuple(branch.token_ids)


def generated_span(spans, cache: KVCache, slots: Sequence[int], ids: tuple[int, ...], context,
                   tenant: Tenant | str = "") -> CompiledSpan:
    """Tokens generated into ``cache`` at ``slots`` as a position-free span (keys rotated back to position
    0), keyed as depending on ``context`` (the key of what they were generated after)."""
    s = torch.tensor(list(slots))
    first = int(cache.positions[s[0]])
    k, v = cache.k[:, :, s].contiguous(), cache.v[:, :, s].contiguous()  # (layers, kv_heads, n, head_dim)
    rotate_layers(spans.engine, k, -first, k, spans.rerotator)
    return CompiledSpan(span_key(spans.identity, ids, (context,), Tenant.of(tenant)), ids, k, v)


def fork(spans, tokenizer, prefix_ids: Sequence[int], prompts: Sequence[Sequence[int]],
         params: SamplingParams = SamplingParams(max_new_tokens=64), hook: Hook | None = None,
         tenant: Tenant | str = "") -> Fork:
    """Run ``len(prompts)`` worker branches over the shared ``prefix_ids`` and return the fork (its
    ``branches`` hold each one's text, tokens or error)."""
    f = Fork(spans, tokenizer, prefix_ids, prompts, params, tenant)
    f.run(hook)
    return f


def synthesis_plan(head_ids: Sequence[int], notes: Sequence[Sequence[int]], tail_ids: Sequence[int],
                   labels: Sequence[Sequence[int]] = (), options: ReuseOptions | None = ReuseOptions(),
                   tenant: Tenant | str = "") -> tuple[RequestPlan, list[int]]:
    """The synthesizer's plan: head (reused), per branch an optional label (computed in context) and its
    notes (reused), then the tail (the query). Returns the plan and the item index of each branch's notes."""
    items = [PlanItem(Span(tuple(head_ids), "system"))]
    where = []
    for i, note in enumerate(notes):
        if labels:
            items.append(PlanItem(Span(tuple(labels[i]), "tool_output", f"label {i}"), reuse=False))
        where.append(len(items))
        items.append(PlanItem(Span(tuple(note), "tool_output", f"branch {i}")))
    items.append(PlanItem(Span(tuple(tail_ids), "query"), reuse=False))
    return RequestPlan(tuple(items), options, Tenant.of(tenant)), where


def join(f: Fork, head_ids: Sequence[int], tail_ids: Sequence[int], labels: Sequence[Sequence[int]] = (),
         options: ReuseOptions = ReuseOptions(), extra_capacity: int = 64, transcripts: bool = False):
    """The synthesizer's context from the successful branches' KV (see the module docstring); returns
    the ``Assembly`` (cache ready to decode, first logits, report), the branches it read and the plan.

    ``transcripts``: the synthesizer reads each branch's prompt (what the worker read) and what it
    generated, not only the latter (a lead agent reading its subagents' transcripts)."""
    done = [b for b in f.branches if b.ok and b.token_ids]
    if not done:
        raise EmptyInputError("no branch produced anything to synthesize from")
    labels = [labels[b.index] for b in done] if labels else []
    plan, where = synthesis_plan(head_ids, [f.read(b, transcripts) for b in done], tail_ids, labels, options,
                                 f.tenant)
    # a full prefill reads no branch KV: none is cut out for it (the text baseline's time stays its own)
    provided = {} if options.policy == "full" else {i: f.span(b, transcripts) for i, b in zip(where, done)}
    return f.spans.assemble(plan, extra_capacity=extra_capacity, provided=provided), done, plan


def join_text(f: Fork, head_ids: Sequence[int], tail_ids: Sequence[int], labels: Sequence[Sequence[int]] = (),
              extra_capacity: int = 64, transcripts: bool = False):
    """The baseline ``join`` is measured against: the same context with the branches' text prefilled in full."""
    return join(f, head_ids, tail_ids, labels, ReuseOptions(policy="full"), extra_capacity, transcripts)
