"""The one planner: every entry point turns a request into a ``RequestPlan`` here.

The facade (``ContextKit``), ``contextkit serve`` and ``contextkit proxy`` all call ``Planner.plan``, so
a request renders to the same tokens on every path (a test holds them to it):

    ChatRequest -> frame (chat template before / after the documents, every turn kept)
                -> one separately tokenized block per document (same tokens in any request)
                -> order (an ``Orderer``, the Weaver, or retrieval order) -> block alignment (prompt path)
                -> length check -> RequestPlan (spans, reuse options, tenant, order, ids, padding)

Ordering is asked without recording: the caller records the served order (``Orderer.record``) once the
engine has accepted the request, so a refused request never claims KV the engine does not hold.
Rendered tokens are cached by content in LRU caches bounded by bytes, one set per tenant: how fast a
request is planned (a hit skips tokenizing) must not tell one tenant that another sent the same
document, so a tenant's hit depends only on its own requests.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from cachetools import LRUCache

from contextkit.core.align import align
from contextkit.core.errors import ConfigError, EmptyInputError, InputError, PromptTooLongError
from contextkit.core.plan import PlanItem, RequestPlan
from contextkit.core.policy import ReuseOptions
from contextkit.core.prompt import (
    DEFAULT_SYSTEM,
    MARK,
    RELEVANCE_HINTS,
    SKILLS_MARK,
    TURN_MARK,
    Part,
    render_document,
    render_erratum,
    render_pieces,
    render_relevance_hint,
    render_skill,
)
from contextkit.core.tenant import Tenant
from contextkit.core.token_cache import TENANT_OVERHEAD, TenantTokens, TokenCacheStats
from contextkit.core.types import Doc, Evidence, Message, OrderResult, Skill, Span

if TYPE_CHECKING:  # the HTTP client plans nothing: it need not install tokenizers
    from contextkit.core.tokenizer import Tokenizer

Ordering = Literal["weaver", "retrieval"]
ORDERINGS: tuple[str, ...] = ("weaver", "retrieval")
DocumentsAt = Literal["last", "first"]
DOCUMENTS_AT: tuple[str, ...] = ("last", "first")
MAX_DOCUMENTS = 1024  # per request; beyond this a request is certainly malformed
MAX_ID_CHARS = 256  # a document id (kept in ordering trees, so bounded)
MAX_SKILLS = 64  # per request
PROBE = "Document"  # the word after a document block in every prompt (the next block's, or the question's)


class Orderer(Protocol):
    """Orders a request's documents for an engine's prefix cache (``contextkit.ordering.Weaver``)."""

    def order(self, docs: Sequence[Doc], tenant: Tenant = ..., record: bool = True) -> OrderResult: ...

    def record(self, docs: Sequence[Doc], tenant: Tenant = ...) -> None: ...


class FixedOrder:
    """An ``Orderer`` that serves one chosen order, with the prefix-cache hit it expects, and records
    nothing (a bench's own policies; the proxy's order found from KV events, or its Weaver's, asked once)."""

    def __init__(self, order: tuple[int, ...], reusable_tokens: int = 0):
        self._order, self._tokens = tuple(order), reusable_tokens

    def order(self, docs: Sequence[Doc], tenant: Tenant = Tenant(), record: bool = True) -> OrderResult:
        return OrderResult(self._order, self._tokens, 0, 0.0)

    def record(self, docs: Sequence[Doc], tenant: Tenant = Tenant()) -> None:
        pass


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A request as every entry point hands it to the planner.

    Attributes:
        messages: the chat turns, all kept; the last user message is the question.
        documents: retrieved evidence, in retrieval order.
        skills: skills the request needs; rendered at the end of the system message in one canonical
            order (by name, then version), so a popular set is one prefix the engine keeps warm.
        tenant: whose cached state the request may use.
        ordering: ``weaver`` (most reusable order for the tenant's history) or ``retrieval`` (as given).
        block_align: pad the prefix and each document to the orderer's block size (prompt path).
        reuse: the span reuse the request allows on the KV path (None: a plain prefill).
        max_new_tokens: tokens it may generate (the length check counts them).
        default_system: the system message used when a request with documents brings none ("" = none).
        documents_at: the user message the documents open: ``last`` (the question's) or ``first`` (a
            session's layout: its documents stay where they were and later turns follow them, so each
            turn's prompt starts with the previous one's documents).
        relevance_hint: when the documents are served in another order than retrieval's, a line after
            them (before the question, outside the cached prefix) that gives the retrieval order back:
            ``titles`` (each document by its title), ``positions`` (by its place), ``none`` (no line).
    """

    messages: tuple[Message, ...]
    documents: tuple[Evidence, ...] = ()
    skills: tuple[Skill, ...] = ()
    tenant: Tenant = field(default_factory=Tenant)
    ordering: Ordering = "weaver"
    block_align: bool = False
    reuse: ReuseOptions | None = None
    max_new_tokens: int = 16
    default_system: str = DEFAULT_SYSTEM
    documents_at: DocumentsAt = "last"
    relevance_hint: str = "none"

    def __post_init__(self) -> None:
        if not any(m.role == "user" for m in self.messages):
            raise InputError("messages need a user message (the question)", "messages")
        if self.ordering not in ORDERINGS:
            raise InputError(f"ordering must be one of {ORDERINGS}, got {self.ordering!r}", "contextkit")
        if self.documents_at not in DOCUMENTS_AT:
            raise InputError(f"documents_at must be one of {DOCUMENTS_AT}, got {self.documents_at!r}", "contextkit")
        if self.relevance_hint not in RELEVANCE_HINTS:
            raise InputError(f"relevance_hint must be one of {RELEVANCE_HINTS}, got {self.relevance_hint!r}",
                             "contextkit")
        if len(self.documents) > MAX_DOCUMENTS:
            raise InputError(f"{len(self.documents)} documents in one request; at most {MAX_DOCUMENTS}", "documents")
        if len(self.skills) > MAX_SKILLS:
            raise InputError(f"{len(self.skills)} skills in one request; at most {MAX_SKILLS}", "skills")
        if len({s.name for s in self.skills}) < len(self.skills):
            raise InputError("a skill is named twice; send each skill once (one version of it)", "skills")
        if any(MARK in m.content or SKILLS_MARK in m.content or TURN_MARK in m.content for m in self.messages):
            raise InputError("a message contains contextkit's internal marker (NUL characters); remove them",
                             "messages")

    @classmethod
    def ask(
        cls, question: str, documents: Sequence[Evidence | str] = (), system: str | None = None, **kw
    ) -> ChatRequest:
        """A one-question request: ``system`` None uses the default RAG system prompt, "" none."""
        if not question or not question.strip():
            raise EmptyInputError("the question is empty; pass a question (--question or \"question\" in the JSON)")
        docs = tuple(d if isinstance(d, Evidence) else Evidence(text=d) for d in documents)
        msgs = ((Message("system", system),) if system else ()) + (Message("user", question),)
        return cls(msgs, docs, default_system=DEFAULT_SYSTEM if system is None else "", **kw)


def _content_digest(doc: Evidence) -> str:
    return hashlib.sha256(f"{doc.title or ''}\x00{doc.text}".encode()).hexdigest()


def content_id(doc: Evidence) -> str:
    """A document's id from its content (title and text), for documents sent without one."""
    return _content_digest(doc)[:16]


def _ids(pieces: Part) -> tuple[int, ...]:
    return tuple(t for p in pieces for t in p)


def _turns(pieces: Part, query: bool = True) -> tuple[PlanItem, ...]:
    """Plan items of a run of conversation pieces (cut where the model's turns start). With ``query``,
    the last piece is the query: computed in context, and kept as an exact prefix for the next request
    of the conversation. The pieces before it are reused only as an exact prefix (their KV depends on
    every turn before them); without ``query`` (the prompt before documents or skills) the first piece
    is a span like any other, as the system prompt."""
    items = []
    for j, ids in enumerate(pieces):
        if query and j == len(pieces) - 1:
            items.append(PlanItem(Span(ids, "query"), reuse=False, exact=True))
        elif j == 0 and not query:
            items.append(PlanItem(Span(ids, "system")))
        else:
            items.append(PlanItem(Span(ids, "history"), exact=True))
    return tuple(items)


class Planner:
    """Renders requests for one tokenizer (one model). Thread-safe.

    Args:
        tokenizer: the model's tokenizer (the engine's, or the upstream vLLM's model).
        block_size: the engine's KV block size (prompt-path alignment; 1 = none).
        context_limit: the model's context in tokens, checked by every plan unless a call passes its own.
        cache_bytes: bound of the rendered-token caches of all tenants together, in bytes; past it the
            least recently used tenant's caches are dropped whole (what another tenant's traffic can do
            to yours is make it slower, never tell you what they sent).
        tenant_cache_bytes: bound of one tenant's caches (documents and chat frames), in bytes (default: a
            quarter of ``cache_bytes``, so one busy tenant leaves room for others).
    """

    def __init__(self, tokenizer: Tokenizer, block_size: int = 1, context_limit: int | None = None,
                 cache_bytes: int = 64 << 20, tenant_cache_bytes: int | None = None):
        if block_size < 1:
            raise InputError(f"block_size must be >= 1, got {block_size}")
        per_tenant = tenant_cache_bytes if tenant_cache_bytes is not None else cache_bytes // 4
        if not 2 * TENANT_OVERHEAD <= per_tenant <= cache_bytes - TENANT_OVERHEAD:
            raise ConfigError(f"tenant_cache_bytes {per_tenant} must be between {2 * TENANT_OVERHEAD} and "
                              f"cache_bytes ({cache_bytes}) less {TENANT_OVERHEAD}; raise cache_bytes")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.context_limit = context_limit
        self.pad_id = tokenizer.encode("\n")[-1]  # a blank line: the least intrusive filler we can send
        self._probe = tuple(tokenizer.encode(PROBE))
        self._tenant_bytes = per_tenant
        # tenant name -> its caches, least recently used first; weighed by the bytes each holds
        self._tenants: LRUCache = LRUCache(cache_bytes, getsizeof=lambda t: t.nbytes)
        self._lock = threading.Lock()

    def token_cache(self, tenant: Tenant | str = Tenant()) -> TokenCacheStats:
        """``tenant``'s rendered-token caches now (all zero if it has none)."""
        with self._lock:
            mine = self._tenants.get(Tenant.of(tenant).name)
            return TokenCacheStats(mine.hits, mine.misses, mine.nbytes) if mine else TokenCacheStats()

    def _cached(self, tenant: Tenant, table: Literal["blocks", "frames"], key: str, make):
        """``make()``'s value, cached under ``key`` in ``tenant``'s own ``table``."""
        name = Tenant.of(tenant).name
        with self._lock:
            mine = self._tenants.get(name)
            got = getattr(mine, table).get(key) if mine is not None else None
            if got is not None:
                mine.hits += 1
                return got
        value = make()  # outside the lock: tokenizing is the slow part, and other tenants need not wait
        with self._lock:
            mine = self._tenants.pop(name, None) or TenantTokens(self._tenant_bytes)
            mine.misses += 1
            cache = getattr(mine, table)
            if cache.getsizeof(value) <= cache.maxsize:  # a block larger than the whole cache is not kept
                cache[key] = value
            self._tenants[name] = mine  # weighed again: past cache_bytes the least recent tenants go
        return value

    def _block(self, key: str, text, tenant: Tenant) -> tuple[int, ...]:
        """Tokens of a rendered block, cached under ``key`` (``text()`` renders it on a miss)."""
        return self._cached(tenant, "blocks", key, lambda: tuple(self.tokenizer.encode(text())))

    def document_tokens(self, doc: Evidence, tenant: Tenant = Tenant()) -> tuple[int, ...]:
        """The document's block of tokens, cached by content (a client may reuse an id for other text).

        Tokenized as the block reads inside a prompt, where text always follows it (the next document,
        or ``Question: ...``): a tokenizer may split trailing whitespace differently at the end of a
        string than before a word. SmolLM2's encodes a block's closing blank line as one token alone and
        as two before ``Document``; the one-token form put ~1 token per document that the whole prompt,
        tokenized as one string (what a framework sends vLLM), never has, and changed answers (bench
        pipelines: answer F1 -1.6 points against the same prompt sent as text, 7 of 40 answers changed).
        Cached in ``tenant``'s own cache."""
        return self._cached(tenant, "blocks", _content_digest(doc), lambda: self.text_tokens(render_document(doc)))

    def text_tokens(self, text: str) -> tuple[int, ...]:
        """``text``'s tokens as a block inside a prompt, where a word follows it: ``text + probe`` tokenized,
        less the probe's own tokens (plain ``text`` when the tokenizer merges the two, which no tokenizer
        here does). Documents and the relevance line are tokenized this way."""
        probe = self._probe
        ids = self.tokenizer.encode(text + PROBE)
        if len(ids) > len(probe) and tuple(ids[-len(probe):]) == probe:
            return tuple(ids[: -len(probe)])
        return tuple(self.tokenizer.encode(text))

    def skill_tokens(self, skill: Skill, tenant: Tenant = Tenant()) -> tuple[int, ...]:
        """The skill's block of tokens, cached by content in ``tenant``'s cache."""
        key = "skill:" + hashlib.sha256(f"{skill.name}\x00{skill.text}".encode()).hexdigest()
        return self._block(key, lambda: render_skill(skill), tenant)

    def errata_tokens(self, skill: Skill) -> list[tuple[int, ...]]:
        """One block of tokens per erratum of ``skill``, in order."""
        return [tuple(self.tokenizer.encode(render_erratum(old, new))) for old, new in skill.errata]

    def frame(self, request: ChatRequest) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Ids before the skills (or documents), between skills and documents, and after the documents."""
        return tuple(_ids(part) for part in self.pieces(request))  # type: ignore[return-value]

    def pieces(self, request: ChatRequest) -> tuple[Part, Part, Part]:
        """``frame``'s three parts cut where assistant messages start (``render_pieces``); cached per
        conversation."""
        msgs = list(request.messages)
        with_docs, with_skills = bool(request.documents), bool(request.skills)
        if with_docs and request.default_system and not any(m.role == "system" for m in msgs):
            msgs.insert(0, Message("system", request.default_system))
        key = json.dumps([with_docs, with_skills, request.documents_at, [(m.role, m.content) for m in msgs]])
        return self._cached(request.tenant, "frames", key,
                            lambda: render_pieces(self.tokenizer, msgs, with_docs, with_skills, request.documents_at))

    def docs(self, request: ChatRequest) -> tuple[Doc, ...]:
        """The request's documents as an orderer sees them: id and rendered length (rounded up to the
        block size when the request is block-aligned)."""
        out, seen = [], set()
        bs = self.block_size if request.block_align else 1
        for i, d in enumerate(request.documents):
            if not d.text or not d.text.strip():
                raise EmptyInputError(f"document {i + 1} (documents[{i}]) has no text; remove it or give it content",
                                      "documents")
            did = d.id or content_id(d)
            if len(did) > MAX_ID_CHARS:
                raise InputError(f"documents[{i}].id is over {MAX_ID_CHARS} characters", "documents")
            if did in seen:
                raise InputError(f"documents[{i}] repeats id {did!r}; send each document once", "documents")
            seen.add(did)
            n = len(self.document_tokens(d, request.tenant))
            out.append(Doc(id=did, tokens=n + (-n % bs)))
        return tuple(out)

    def plan(self, request: ChatRequest, orderer: Orderer | None = None,
             context_limit: int | None = None) -> RequestPlan:
        """The request's plan: spans in served order, the length checked against ``context_limit``
        (else the planner's). Nothing is recorded in ``orderer``."""
        separator = request.reuse.separator if request.reuse is not None else ()
        if any(t >= self.tokenizer.vocab_size for t in separator):
            raise InputError(f"contextkit.reuse.separator holds token ids past the vocabulary "
                             f"({self.tokenizer.vocab_size}); take them from /tokenize", "contextkit")
        docs = self.docs(request)
        result = None
        if orderer is not None and request.ordering == "weaver" and docs:
            result = orderer.order(docs, request.tenant, record=False)
        order = result.order if result is not None else tuple(range(len(docs)))
        head_pieces, middle_pieces, tail_pieces = self.pieces(request)
        head, middle = _ids(head_pieces), _ids(middle_pieces)
        hint = render_relevance_hint(request.documents, order, request.relevance_hint) if docs else ""
        if hint and tail_pieces:  # after the documents, before the question: the first piece of the tail
            tail_pieces = (self.text_tokens(hint) + tail_pieces[0], *tail_pieces[1:])
        skills = sorted(request.skills, key=lambda s: (s.name, s.version))  # one canonical order
        # each skill, then its errata (computed in context: they must read the skill they correct)
        pre_items = [(b, s, i) for s in skills
                     for i, b in enumerate([self.skill_tokens(s, request.tenant), *self.errata_tokens(s)])]
        pre = [b for b, _, _ in pre_items] + ([middle] if middle else [])
        blocks = [self.document_tokens(request.documents[i], request.tenant) for i in order]
        padding = 0
        if request.block_align and self.block_size > 1:  # the prompt path: the prefix padded as one run
            aligned = align(head, pre + blocks, self.block_size, self.pad_id)
            head, padding = aligned.prefix, aligned.padding
            pre, blocks = list(aligned.documents[: len(pre)]), list(aligned.documents[len(pre):])
            head_pieces, tail_pieces = (tuple(head),), ((_ids(tail_pieces),) if tail_pieces else ())
        if not tail_pieces:  # a chat without documents or skills: the conversation, then the query
            items: tuple[PlanItem, ...] = _turns(head_pieces)
        else:
            items = (
                *_turns(head_pieces, query=False),
                # a skill sits at one canonical place: anchored, it becomes an exact prefix there
                *(PlanItem(Span(b, "skill",
                                (f"{s.name}@{s.version}" if s.version else s.name) + (":erratum" if e else "")),
                           reuse=not e, anchor=not e) for b, (_, s, e) in zip(pre, pre_items)),
                *((PlanItem(Span(pre[-1], "system")),) if middle else ()),
                *(PlanItem(Span(b, "document", docs[i].id)) for b, i in zip(blocks, order)),
                *_turns(tail_pieces),
            )
        plan = RequestPlan(
            items, request.reuse, request.tenant, order, tuple(docs[i].id for i in order),
            tuple(docs[i] for i in order), result.reusable_tokens if result is not None else None, padding,
            request.max_new_tokens,
        )
        self.check_length(plan, context_limit)
        return plan

    def plan_prompt(self, prompt: str | Sequence[int], tenant: Tenant = Tenant(), max_new_tokens: int = 16,
                    context_limit: int | None = None) -> RequestPlan:
        """A completion prompt (text, tokenized with the model's special tokens, or token ids) as a plan."""
        ids = tuple(self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt)
        if not ids:
            raise EmptyInputError("the prompt is empty", "prompt")
        vocab = self.tokenizer.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InputError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        plan = RequestPlan((PlanItem(Span(ids, "query"), reuse=False),), None, tenant, max_new_tokens=max_new_tokens)
        self.check_length(plan, context_limit)
        return plan

    def check_length(self, plan: RequestPlan, context_limit: int | None = None) -> None:
        limit = context_limit or self.context_limit
        if limit and plan.num_tokens + plan.max_new_tokens > limit:
            raise PromptTooLongError(
                f"the rendered prompt is {plan.num_tokens} tokens plus {plan.max_new_tokens} to generate, over "
                f"the model's context of {limit}; send fewer or shorter documents or lower max_tokens",
                "documents" if plan.document_ids else "messages",
            )
