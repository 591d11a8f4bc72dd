"""``bench robustness``'s abuser: a process of its own, at a lower CPU priority (``nice`` +10), that sends
schemathesis cases from the server's OpenAPI document in one thread and hand-made abuse in others
(malformed, oversized, spoofed and dropped requests; against the proxy the boundary cases of
``bench.boundary``), counting what the server answered: 5xx other than the documented 502/503/504, no
answer in time (a hang), an undocumented status, a spoofed request answered 2xx.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import socket
import threading
import time

from contextkit.bench.boundary import abuse_cases, large_ids_body
from contextkit.bench.tenants import ABUSER_KEY
from contextkit.core.errors import ConfigError

# hand-made abuse (fanout, planning, large: the proxy's, issue 46; recompute: a proxy whose upstreams run
# the contextkit connector, ``--set kv_connector=contextkit``)
KINDS = ("malformed", "oversized", "spoofed", "dropped", "injected", "routes", "headers", "fanout", "planning", "large",
         "recompute")
RECOMPUTE_POOL = 12  # passages the recompute case draws its 6 from
# words of the recompute case's passages: varied, so that no two passages share a KV block
_WORDS = "archive ledger museum river harbor station library garden tower bridge market valley".split()


def raw_status(port: int, data: bytes, timeout_s: float, *, read: bool = True,
               drop_after: int | None = None) -> int | None:
    """Send raw bytes; the status answered (None: none within ``timeout_s``, or not asked for)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(data if drop_after is None else data[:drop_after])
        if not read or drop_after is not None:
            return None
        head = b""
        try:
            while b"\r\n" not in head:
                part = s.recv(4096)
                if not part:
                    return -1  # closed without an answer
                head += part
        except TimeoutError:
            return None
        return int(head.split(b" ", 2)[1])


def _http(path: str, body: bytes, key: str | None, ctype: str = "application/json", extra: str = "") -> bytes:
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: {ctype}\r\n{extra}{auth}content-length: {len(body)}"
            f"\r\nconnection: close\r\n\r\n").encode() + body


# what the recompute case asks for: the most recompute a client can ask (every span token, all layers), or,
# the control arm, no reuse at all (the same long prompts, prefilled by vLLM: what any tenant can send)
RECOMPUTE_ASKS = {"max": {"policy": "query_attention", "ratio": 1.0, "max_recompute": None, "probe_layers": 0},
                  "full": {"policy": "full"}}


def _recompute_case(model: str, me: str, entries: list[int], ask: str = "max") -> bytes:
    """Item 5 of issue 46: a documents request of ~2k tokens asking ``RECOMPUTE_ASKS[ask]`` (the connector's
    operator limits clamp the most inside vLLM). Its 6 passages are ``entries`` of a pool of
    ``RECOMPUTE_POOL``: once the connector has saved them (``prime_recompute``), each request in another
    order loads them moved and repairs them."""
    docs = [{"id": f"r{i}", "text": f"Entry {i}: " + " ".join(
        _WORDS[(i * k) % len(_WORDS)] + str((i * k * 7919) % 99991) for k in range(1, 60))} for i in entries]
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Which entry is first?"}],
            "documents": docs, "contextkit": {"reuse": RECOMPUTE_ASKS[ask]}}
    return _http("/v1/chat/completions", json.dumps(body).encode(), me)


def prime_recompute(url: str, model: str, timeout_s: float) -> list[int | None]:
    """Send the recompute case's whole pool once, in order (6 passages a request), before the abuse: the
    connector saves each passage's span out of the request that computed it, so that the abuse's requests
    find them and run the repair they ask for (on a server that never idles, saves wait for a turn and the
    first abuse requests would otherwise load nothing). The statuses answered."""
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    return [raw_status(port, _recompute_case(model, ABUSER_KEY, list(range(i, i + 6))), timeout_s)
            for i in range(0, RECOMPUTE_POOL, 6)]


def _handmade(server: str, max_body: int, model: str, recompute: str | None = None,
              pick: int = 0) -> list[tuple[str, bytes, dict]]:
    """(kind, raw request, how to send it) of one round of hand-made abuse."""
    chat = "/v1/chat/completions"
    q = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Who wrote it?"}]}
    me = ABUSER_KEY
    out = [
        ("malformed", _http(chat, b"{not json", me), {}),
        ("malformed", _http(chat, b"[" * 3000, me), {}),
        ("malformed", _http(chat, os.urandom(300), me), {}),
        ("malformed", _http(chat, b'{"messages": [{"role": "user", "content": "q"}], "temperature": NaN}', me), {}),
        ("malformed", _http(chat, json.dumps(q).encode(), me, "text/plain"), {}),
        ("malformed", _http(chat, json.dumps({**q, "documents": [{"text": "x"}] * 1100}).encode(), me), {}),
        ("oversized", _http(chat, json.dumps({**q, "documents": [{"text": "word " * 9000}]}).encode(), me), {}),
        ("spoofed", _http(chat, json.dumps(q).encode(), None), {}),
        ("spoofed", _http(chat, json.dumps(q).encode(), "key-good-00x"), {}),
        ("spoofed", _http(chat, json.dumps({**q, "documents": [{"text": "x"}],
                                            "contextkit": {"tenant": "good0"}}).encode(), me), {"must_refuse": True}),
        ("dropped", _http(chat, json.dumps(q).encode(), me), {"drop_after": 60}),
        ("dropped", _http(chat, json.dumps({**q, "stream": True, "max_tokens": 64}).encode(), me),
         {"drop_stream": True}),
        ("dropped", b"", {"read": False}),
    ]
    if server == "proxy":
        out.append(("spoofed", _http("/v1/completions", json.dumps(
            {"model": model, "prompt": "Hello", "max_tokens": 2, "cache_salt": "good0"}).encode(), me), {}))
        out += abuse_cases(_http, model, me)  # connector params, every generation route, header tricks, fan-out
        out.append(("large", _http("/v1/completions", large_ids_body(model, max_body), me), {"big": True}))
        if recompute is not None:
            entries = random.Random(pick).sample(range(RECOMPUTE_POOL), 6)
            out.append(("recompute", _recompute_case(model, me, entries, recompute), {}))
    out.append(("oversized", _http(chat, b'{"pad": "' + b"x" * (max_body + 16) + b'"}', me), {"big": True}))
    return out


def _drop_stream(port: int, raw: bytes) -> None:
    """Send a streamed request, read its first bytes (or wait 2 s for its turn), then hang up."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as sock:
            sock.sendall(raw)
            try:
                sock.recv(64)
            except TimeoutError:
                pass
    except OSError:
        pass


def _send(port: int, raw: bytes, how: dict, timeout_s: float) -> int | None:
    """The status the server answered ``raw`` with (None: no answer in time; -1: it closed on the body)."""
    try:
        return raw_status(port, raw, timeout_s, read=how.get("read", True), drop_after=how.get("drop_after"))
    except TimeoutError:
        return None
    except OSError:
        return -1  # the server closed on an oversized body: an answer of its own kind


def _abuse(url: str, server: str, model: str, seconds: float, timeout_s: float, max_body: int, seed: int,
           handmade_threads: int, rate: float, skip: frozenset[str], recompute: str | None, out) -> None:
    """The abuser process: schemathesis cases in one thread, hand-made abuse in another, for ``seconds``;
    its counts go to ``out``."""
    os.nice(10)
    from contextkit.bench.fuzz import documented, fuzz

    port = int(url.rsplit(":", 1)[1])
    counts = {"fuzz": 0, **{kind: 0 for kind in KINDS}, "server_errors": 0, "hangs": 0, "spoof_accepted": 0,
              "statuses": {},  # kind -> {status: requests}: what each kind of abuse got
              "findings": []}
    lock = threading.Lock()
    allowed = set().union(*documented(server).values())
    deadline = time.monotonic() + seconds

    def note(**inc) -> None:
        with lock:
            for k, v in inc.items():
                if k == "finding":
                    if len(counts["findings"]) < 50:
                        counts["findings"].append(v)
                else:
                    counts[k] += v

    def fuzzer() -> None:
        rounds = 0
        while "schemathesis" not in skip and time.monotonic() < deadline:
            report = fuzz(url, server, 50, ABUSER_KEY, timeout_s=timeout_s, seed=random.randrange(2**32),
                          deadline_s=max(1.0, deadline - time.monotonic()))
            note(fuzz=report.requests, server_errors=report.server_errors, hangs=report.hangs)
            for f in report.findings[:3]:
                note(finding=str(f)[:300])
            rounds += 1

    gap = handmade_threads / rate if rate > 0 else 0.0  # seconds between one thread's sends

    def handmade() -> None:
        rounds = 0
        due = time.monotonic()
        while time.monotonic() < deadline:
            for kind, raw, how in _handmade(server, max_body, model, recompute, random.randrange(1 << 30)):
                if kind in skip:
                    continue
                if how.get("big") and rounds % 10:
                    continue  # a body past the limit every 10th round: its bytes cost the machine, not the server
                if gap:  # paced: the next send is due `gap` after the last was due (none skipped when late)
                    due += gap
                    time.sleep(max(0.0, due - time.monotonic()))
                note(**{kind: 1})
                if how.get("drop_stream"):
                    _drop_stream(port, raw)
                    continue
                status = _send(port, raw, how, timeout_s)
                if status is None and how.get("read", True) and how.get("drop_after") is None:
                    note(hangs=1, finding=f"{kind}: no answer within {timeout_s} s")
                elif status is not None and status >= 500 and status not in (502, 503, 504):
                    note(server_errors=1, finding=f"{kind}: {status}")
                elif status is not None and status > 0 and status not in allowed | {404}:
                    note(finding=f"{kind}: undocumented status {status}")
                with lock:
                    got = counts["statuses"].setdefault(kind, {})
                    got[str(status)] = got.get(str(status), 0) + 1
                if how.get("must_refuse") and status is not None and 200 <= status < 300:
                    note(spoof_accepted=1)
            rounds += 1

    # one fuzzing thread: schemathesis's strategy caches are not thread-safe
    # hand-made requests mostly wait (an engine turn, an answer): more threads keep them coming
    threads = [threading.Thread(target=fuzzer)] + [threading.Thread(target=handmade) for _ in range(handmade_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(counts)


def start_abuser(url: str, server: str, model: str, seconds: float, timeout_s: float, max_body: int, seed: int,
                  handmade_threads: int, rate: float, skip: frozenset[str] = frozenset(),
                  recompute: str | None = None):
    """The abuser in its own process; ``skip`` names kinds it leaves out (``KINDS`` or ``schemathesis``), to
    measure what each costs the good tenants; ``recompute``: what the recompute case asks (a key of
    ``RECOMPUTE_ASKS``; None: no recompute case, a proxy without the connector)."""
    if recompute is not None and recompute not in RECOMPUTE_ASKS:
        raise ConfigError(f"--set recompute_ask takes {' or '.join(RECOMPUTE_ASKS)}, got {recompute!r}")
    unknown = skip - {*KINDS, "schemathesis"}
    if unknown:
        raise ConfigError(f"--set abuse_skip names unknown kinds {sorted(unknown)}; choose from "
                          f"{', '.join((*KINDS, 'schemathesis'))}")
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_abuse, args=(url, server, model, seconds, timeout_s, max_body, seed,
                                            handmade_threads, rate, skip, recompute, q), daemon=True)
    proc.start()
    return proc, q
