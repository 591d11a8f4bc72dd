"""One vLLM server's KV events, read off its ZMQ publisher into a ``BlockIndex`` (issue 30).

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`` publishes each batch of events as three
frames: the topic, a sequence number (8 bytes, big-endian) and the batch, msgpack-encoded
(``vllm.distributed.kv_events.KVEventBatch``). Its replay socket (ZMQ ROUTER) answers a starting sequence
number with every batch it still buffers from there, then an end marker.

The wire format is mirrored here with msgspec structs instead of importing vLLM (the proxy installs
without it); fields this code does not read are ignored, an unknown event type is skipped and counted.
Nothing in a batch is trusted beyond its declared shape: a batch that does not decode is dropped and
counted, and the index refuses events whose blocks do not add up. The sequence numbers keep the index
honest: a gap (a batch lost under load, the subscriber joined late, the server restarted) is replayed when
the server has a replay socket, and otherwise the index starts over, since a missed ``BlockRemoved`` would
make it claim blocks the server no longer holds.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import msgspec

from contextkit.integrations.proxy.kv_index import BlockIndex

log = logging.getLogger("contextkit.proxy")
END_SEQ = -1
_Hash = bytes | int  # vLLM's ExternalBlockHash


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    extra_keys: list[list | None] | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[_Hash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_BATCH = msgspec.msgpack.Decoder(_Batch)
_EVENT = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)


class EventFeed:
    """Applies one server's event stream to its index, in order (the socket side is ``EventSubscriber``).

    Args:
        index: the server's ``BlockIndex``.
        can_replay: whether the server has a replay socket (then a gap is asked for, not cleared).
        clock: for ``last_event_at`` (tests pass their own).
    """

    def __init__(self, index: BlockIndex, *, can_replay: bool = False, clock: Callable[[], float] = time.monotonic):
        self.index = index
        self.can_replay = can_replay
        self.clock = clock
        self.next_seq: int | None = None  # the sequence number expected next (None: none seen yet)
        self.last_event_at: float | None = None
        self.counts: Counter[str] = Counter()  # batches, malformed, unknown_events, gaps, restarts, duplicates
        self.replayed = False  # batches were just replayed: published ones up to next_seq are duplicates

    def frames(self, frames: list[bytes]) -> int | None:
        """Apply one published message (topic, seq, payload). Returns the sequence number to replay from
        when the message showed a gap the server can replay (the caller replays, then this message comes
        again with the replay), else None."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counts["malformed"] += 1
            return None
        seq = int.from_bytes(frames[1], "big", signed=True)
        if self.next_seq is not None and seq < self.next_seq and self.replayed:
            self.counts["duplicates"] += 1  # published while the replay ran: already applied
            return None
        self.replayed = False
        if self.next_seq is not None and seq != self.next_seq:
            if seq > self.next_seq and self.can_replay:
                self.counts["gaps"] += 1
                return self.next_seq
            # lost events without replay, or a restarted server (its numbers start again): start over
            self.counts["gaps" if seq > self.next_seq else "restarts"] += 1
            self.index.cleared()
        self.batch(seq, frames[2])
        return None

    def lost(self) -> None:
        """A replay could not fill a gap (the server no longer buffers it, or did not answer): start over
        from the next published batch."""
        self.index.cleared()
        self.next_seq = None

    def batch(self, seq: int, payload: bytes) -> None:
        """Apply the batch ``seq`` (replayed ones too)."""
        self.next_seq = seq + 1
        self.last_event_at = self.clock()
        try:
            batch = _BATCH.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.counts["malformed"] += 1
            return
        self.counts["batches"] += 1
        for raw in batch.events:
            try:
                ev = _EVENT.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.counts["unknown_events"] += 1
                continue
            self._apply(ev)

    def _apply(self, ev: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        if isinstance(ev, BlockStored):
            if ev.medium not in (None, "GPU"):  # an offloaded copy is not in the prefix cache vLLM reads
                return
            extra = [tuple(e) if e else None for e in ev.extra_keys] if ev.extra_keys is not None else None
            self.index.stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, extra)
        elif isinstance(ev, BlockRemoved):
            if ev.medium in (None, "GPU"):
                self.index.removed(ev.block_hashes)
        else:
            self.index.cleared()


class EventSubscriber:
    """Reads one server's published events into an ``EventFeed`` (``run`` until cancelled).

    Args:
        endpoint: the server's publisher, e.g. ``tcp://127.0.0.1:5557``.
        feed: where the events go.
        replay_endpoint: the server's replay socket, if it has one: the subscriber first replays what the
            server still buffers (so a proxy started after the server knows its cache), and fills gaps.
        topic: the publisher's topic ("" unless the operator set one).
        hwm: messages queued at most while the proxy is busy; past it ZMQ drops (a gap, handled).
        replay_timeout_s: how long one replay may go without an answer before the feed starts over.
    """

    def __init__(self, endpoint: str, *, feed: EventFeed, replay_endpoint: str | None = None, topic: str = "",
                 hwm: int = 10_000, replay_timeout_s: float = 2.0):
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic.encode()
        self.feed, self.hwm, self.replay_timeout_s = feed, hwm, replay_timeout_s
        feed.can_replay = replay_endpoint is not None

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.hwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        try:
            if self.replay_endpoint is not None:
                await self.replay(0)
            while True:
                frames = await sub.recv_multipart()
                start = self.feed.frames(frames)
                if start is not None:
                    await self.replay(start)
                    self.feed.frames(frames)  # a duplicate if the replay covered it, else applied now
        finally:
            sub.close(linger=0)

    async def replay(self, start: int) -> None:
        """Ask the server for every batch from ``start`` on and apply them; a replay that does not begin at
        ``start`` (the server dropped part of it) or that stops answering makes the feed start over."""
        import zmq
        import zmq.asyncio

        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        self.feed.counts["replays"] += 1
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            expected = start
            while True:
                if not await sock.poll(int(self.replay_timeout_s * 1000)):
                    raise TimeoutError("no answer")
                frames = await sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    raise ValueError(f"a replay message of {len(frames)} frames")
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    break
                if seq != expected and not (expected == 0 and self.feed.next_seq is None):
                    raise ValueError(f"replay began at {seq}, not {expected}")
                expected = seq + 1
                self.feed.batch(seq, frames[3])
            self.feed.replayed = True
        except (TimeoutError, ValueError) as exc:
            log.warning("KV events of %s: replay from %d failed (%s); the index starts over", self.endpoint, start, exc)
            self.feed.lost()
        finally:
            sock.close(linger=0)
