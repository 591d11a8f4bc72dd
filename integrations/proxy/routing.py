"""Which upstream a request goes to: the one whose prefix cache holds most of its prompt (issue 30).

Every upstream that publishes its KV events (``upstream_events``) has a ``BlockIndex`` kept current by an
``EventSubscriber``; all of them feed one ``FleetIndex``, so a prompt is scored against the whole fleet in
one pass over its block keys. A prompt's keys come from its token ids and the ``cache_salt`` the proxy set
(``kv_index.prompt_keys``): a request is only ever scored by blocks cached under its own tenant's salt.

How a request is placed (``Router.pick``), among the healthy upstreams:

1. Load first: an upstream more than ``route_slack`` requests in flight above the least loaded one is not
   a candidate (a hot prefix must not pile every request onto one server).
2. Then the candidate of most value: the leading blocks of the prompt it holds, by its events when it
   publishes and its index is fresh (rule ``events``), else by the proxy's model of what it was sent
   (documents requests: the Weaver's tree; rule ``model``), less ``route_load_weight`` prompts' worth of
   blocks per request it has in flight above the least loaded one.
3. Nothing held anywhere: when some candidate publishes no fresh events (its cache may hold the session
   unseen), the conversation's own upstream by rendezvous hashing of its session key
   (``prompt_cache_key``, else its first two messages; rule ``affinity``): every proxy replica picks the
   same one, and adding an upstream moves only the sessions that now hash to it. Else the least loaded.

An index that lags is never an error: it scores low (a late ``BlockStored``) or high (a late
``BlockRemoved``, and vLLM then prefills what it lacks). An upstream that accepted new blocks and published
nothing for ``events_stale_s`` since they were sent is stale: it is scored by the fallback until its events
flow again, and ``/metrics`` says so (``contextkit_proxy_upstream_events_fresh``). A request vLLM refuses
(a 4xx: too long, a bad parameter) caches nothing and publishes nothing, so only an accepted one (a 2xx
response started) starts that clock (``Router.sent``, then ``Router.accepted``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from contextkit.integrations.proxy.kv_events import EventFeed, EventSubscriber
from contextkit.integrations.proxy.kv_index import BlockIndex, FleetIndex, prompt_keys
from contextkit.integrations.proxy.settings import ProxySettings, event_endpoints

if TYPE_CHECKING:
    from contextkit.integrations.proxy.upstreams import Upstream

log = logging.getLogger("contextkit.proxy")
MAX_ROUTED_BLOCKS = 8192  # leading blocks of a pass-through prompt scored and expected (262k tokens at 32)
RETRY_S = 5.0  # a subscriber that failed (a bad endpoint) tries again after this long


@dataclass
class EventView:
    """One upstream's published cache: its index, the feed that keeps it, and whether it is fresh."""

    index: BlockIndex
    feed: EventFeed
    subscriber: EventSubscriber
    expect_since: float | None = None  # sent new blocks at this time, no event seen since
    running: bool = False  # the subscriber's socket is up

    def fresh(self, now: float, stale_s: float) -> bool:
        if not self.running:
            return False
        if self.expect_since is None:
            return True
        last = self.feed.last_event_at
        if last is not None and last > self.expect_since:
            self.expect_since = None
            return True
        return now - self.expect_since <= stale_s


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a request goes, why, and how many of its leading blocks that upstream holds (by its score)."""

    upstream: Upstream
    rule: str  # events | model | affinity | least_loaded
    held_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Sent:
    """A request sent to upstream ``position`` at ``at`` with blocks it did not hold: once the upstream accepts
    it, an event is due (``Router.accepted``)."""

    position: int
    at: float


@dataclass(frozen=True, slots=True)
class Routed:
    """A placed request: the choice and its prompt's block keys (empty: not rendered), which
    ``Router.sent`` takes when the request goes out."""

    choice: Choice
    keys: tuple[bytes, ...] = ()


class Router:
    """Scores prompts against the upstreams' caches and picks one (module docstring).

    Args:
        upstreams: the pool's upstreams, in ``--upstream`` order.
        settings: the proxy's (``upstream_events``, ``block_size``, ``events_stale_s``, ``index_blocks``,
            ``route_slack``, ``route_load_weight``, ``session_affinity``).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, upstreams: Sequence[Upstream], settings: ProxySettings,
                 clock: Callable[[], float] = time.monotonic):
        self.upstreams = list(upstreams)
        self._position = {id(u): i for i, u in enumerate(self.upstreams)}
        self.block_size = settings.block_size
        self.stale_s, self.slack, self.affinity = (settings.events_stale_s, settings.route_slack,
                                                   settings.session_affinity)
        self.load_weight = settings.route_load_weight
        self.clock = clock
        self.fleet = FleetIndex()
        self.views: list[EventView | None] = []
        for i, entry in enumerate(settings.upstream_events or [""] * len(self.upstreams)):
            endpoints = event_endpoints(entry)
            if endpoints is None:
                self.views.append(None)
                continue
            index = BlockIndex(block_size=settings.block_size, max_blocks=settings.index_blocks, fleet=self.fleet,
                               server=i)
            feed = EventFeed(index, clock=clock)
            self.views.append(EventView(index, feed, EventSubscriber(endpoints[0], feed=feed,
                                                                     replay_endpoint=endpoints[1])))
        self.decisions: Counter[str] = Counter()  # rule -> requests; "overloaded": a cache passed over for load

    def position(self, u: Upstream) -> int:
        """``u``'s place in ``upstreams`` (the key of ``events`` and ``model`` scores)."""
        return self._position[id(u)]

    @property
    def publishing(self) -> bool:
        return any(v is not None for v in self.views)

    def fresh(self, i: int) -> bool:
        v = self.views[i]
        return v is not None and v.fresh(self.clock(), self.stale_s)

    def held(self, keys: Sequence[bytes]) -> dict[int, int]:
        """Leading blocks of ``keys`` each upstream with a fresh index holds, or was just sent (upstreams
        holding none: absent)."""
        if not keys:
            return {}
        self._expire()
        return {i: n for i, n in self.fleet.held_prefixes(keys).items() if self.fresh(i)}

    def _expire(self) -> None:
        now = self.clock()
        for v in self.views:
            if v is not None:
                v.index.expire(now)

    def depth_reader(self, positions: Sequence[int]):
        """For a planning thread: ``depth(keys)``, the most leading blocks of ``keys`` any of these upstreams
        with a fresh index holds, reading the fleet map only; None when none is fresh. Expectations are
        expired here, on the loop, first (the thread never writes)."""
        self._expire()
        fresh = {i for i in positions if self.fresh(i)}
        if not fresh:
            return None
        fleet = self.fleet

        def depth(keys: Sequence[bytes]) -> int:
            return max((n for i, n in fleet.held_prefixes(keys).items() if i in fresh), default=0)

        return depth

    def pick(self, pool: Sequence[Upstream], *, events: dict[int, int], model: dict[int, int] | None = None,
             session: bytes | None = None, blocks: int = 0) -> Choice:
        """Place a request of ``blocks`` full blocks among ``pool`` (healthy, non-empty) given the leading
        blocks each upstream holds by its events (``events``, keyed by position in ``upstreams``) and by the
        proxy's model (``model``: used for upstreams whose index is not fresh).

        An upstream's value is the blocks it would not prefill minus ``load_weight`` x the prompt's blocks
        for every request it has in flight above the least loaded one: a request ahead in the queue costs
        about a prompt's worth of work, so a few shared blocks (a system prompt every request starts with)
        never pile requests onto one server, while a conversation's long prefix still wins over a small
        difference in load."""
        model = model or {}
        floor = min(u.inflight for u in pool)
        candidates = [u for u in pool if u.inflight <= floor + self.slack]

        def held(u: Upstream) -> tuple[int, str]:
            i = self.position(u)
            if self.fresh(i):
                return events.get(i, 0), "events"
            return model.get(i, 0), "model"

        def value(u: Upstream) -> float:
            return held(u)[0] - self.load_weight * max(blocks, 1) * (u.inflight - floor)

        best = max(candidates, key=lambda u: (value(u), -u.inflight, -u.requests))
        (n, rule), worth = held(best), value(best)
        if any(held(u)[0] > n for u in pool):
            self.decisions["overloaded"] += 1  # a deeper cache passed over for load
        if n > 0 and worth > 0:
            choice = Choice(best, rule, n)
        elif self.affinity and session is not None and not all(self.fresh(self.position(u)) for u in candidates):
            # without every server's events a session's earlier turns may be cached where nothing says so:
            # keep it on its own upstream (with them, a session cached nowhere is a new one: least loaded)
            choice = Choice(rendezvous(session, candidates), "affinity")
        else:
            choice = Choice(min(candidates, key=lambda u: (u.inflight, u.requests)), "least_loaded")
        self.decisions[choice.rule] += 1
        return choice

    def sent(self, u: Upstream, keys: Sequence[bytes]) -> Sent | None:
        """A prompt with these keys is being sent to ``u``: its blocks count as held there until its events
        arrive (at most ``events_stale_s``). When it stores blocks ``u`` does not hold, the answer is the
        ticket ``accepted`` takes once ``u`` accepted the request (else None: no event is due)."""
        i = self.position(u)
        v = self.views[i]
        if v is None or not keys:
            return None
        now = self.clock()
        due = v.index.held_prefix(keys) < len(keys)
        v.index.expect(keys, now + self.stale_s)
        return Sent(i, now) if due else None

    def accepted(self, sent: Sent | None, status: int) -> None:
        """The upstream answered the request ``sent`` (``Router.sent``'s ticket) with ``status``. A 2xx
        means vLLM took it, so its events are due: the stale clock starts from when it was sent, unless
        one is running already or an event came since. A refusal (vLLM publishes nothing for a request it
        refused) starts nothing."""
        if sent is None or not 200 <= status < 300:
            return
        v = self.views[sent.position]
        last = v.feed.last_event_at
        if v.expect_since is None and (last is None or last <= sent.at):
            v.expect_since = sent.at

    async def run(self) -> None:
        """Run every upstream's subscriber until cancelled (one that fails is logged, stale, and retried)."""
        await asyncio.gather(*(self._keep(i, v) for i, v in enumerate(self.views) if v is not None))

    async def _keep(self, i: int, v: EventView) -> None:
        while True:
            v.running = True
            try:
                await v.subscriber.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a broken endpoint must not end the proxy's routing
                log.warning("KV events of %s (%s) failed: %s; routing it by the fallback, retrying in %.0f s",
                            self.upstreams[i].name, v.subscriber.endpoint, exc, RETRY_S)
            finally:
                v.running = False
            v.feed.lost()
            await asyncio.sleep(RETRY_S)


def rendezvous(key: bytes, pool: Sequence[Upstream]) -> Upstream:
    """The upstream ``key`` belongs to by highest-random-weight hashing over the upstreams' URLs: the same
    on every proxy replica, and a new upstream takes over only the keys that now rank it first."""
    return max(pool, key=lambda u: hashlib.blake2b(key + u.url.encode(), digest_size=8).digest())


def session_key(body: dict, salt: str) -> bytes | None:
    """A generation request's session: its ``prompt_cache_key`` (OpenAI's field for this), else a chat's
    first two messages (the system prompt and the opening question name a conversation), within the
    tenant (its ``salt``). None: nothing to tie it to."""
    own = body.get("prompt_cache_key")
    h = hashlib.blake2b(salt.encode(), digest_size=16)
    if isinstance(own, str) and own:
        h.update(b"k" + own.encode())
        return h.digest()
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        h.update(b"m" + repr([(m.get("role"), m.get("content")) if isinstance(m, dict) else m
                              for m in messages[:2]]).encode())
        return h.digest()
    return None


def render_keys(path: str, body: dict, tokenizer, *, block_size: int, salt: str | None) -> tuple[bytes, ...]:
    """The block keys of the prompt vLLM will prefill for a pass-through request (``prompt_ids``); empty
    when the proxy cannot render it. CPU work: run it off the event loop."""
    try:
        ids = prompt_ids(path, body, tokenizer)
    except Exception:  # noqa: BLE001 - a template that rejects the messages: vLLM answers it, routing must not
        return ()
    # a prompt past any served context is refused by vLLM: its keys beyond that place nothing, and each one
    # costs the event loop an index write when the request is sent (Router.sent)
    return tuple(prompt_keys(ids[: MAX_ROUTED_BLOCKS * block_size], block_size=block_size, salt=salt)) if ids else ()


# fields with which vLLM renders a chat differently from the model's default template
_RENDER_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "continue_final_message", "documents",
                  "add_generation_prompt")


def prompt_ids(path: str, body: dict, tokenizer) -> list[int] | None:
    """The token ids vLLM will prefill for a pass-through request, as far as the proxy can render them:
    a chat of text messages with the model's own template, or a completion's first prompt. None: it
    cannot say (other routes, content parts, tools, a template of the client's); the request is routed
    without a cache score."""
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or any(f in body for f in _RENDER_FIELDS):
            return None
        if not tokenizer.has_chat_template:
            return None
        if not all(isinstance(m, dict) and m.keys() <= {"role", "content"} and isinstance(m.get("content"), str)
                   and isinstance(m.get("role"), str) for m in messages):
            return None
        return tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # several prompts: the first places the request
        if isinstance(prompt, str) and prompt:
            return tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
    return None
