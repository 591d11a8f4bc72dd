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

A restarted server (a new process: an empty cache, sequence numbers from 0 again) must not be taken for the
old one, or the old one's blocks stay indexed as phantoms. Its numbers going back says so, but a subscriber
that reconnects late can first hear one above the number it expects. So the server's epoch is checked by
identity: each batch carries the publisher's wall-clock ``ts``, and a batch number names one batch of one
process. Whenever the connection to the publisher comes up again, and on every gap, the replay starts at the
last batch applied: the same process answers that very batch (same ``ts``); a new one answers another batch
under that number, or none (its numbers have not reached it yet). Then the index starts over from the new
process's replay buffer, counted as a ``restart``. ``ts`` going back is no signal (a wall clock can step back
on the same server; a restarted one's moves on), nor is vLLM's ``/health`` (it carries no start time).
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
        self.last_ts: float | None = None  # the ``ts`` of batch next_seq - 1: which process published it
        self.last_event_at: float | None = None
        self.counts: Counter[str] = Counter()  # batches, malformed, unknown_events, gaps, restarts, duplicates
        self.replayed = False  # batches were just replayed: published ones up to next_seq are duplicates

    def frames(self, frames: list[bytes]) -> bool:
        """Apply one published message (topic, seq, payload). True when the message showed a gap the server
        can replay: the caller replays (``EventSubscriber.replay``), then gives this message again."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counts["malformed"] += 1
            return False
        seq = int.from_bytes(frames[1], "big", signed=True)
        if self.next_seq is not None and seq < self.next_seq and self.replayed:
            self.counts["duplicates"] += 1  # published while the replay ran: already applied
            return False
        self.replayed = False
        if self.next_seq is not None and seq != self.next_seq:
            if seq > self.next_seq and self.can_replay:
                self.counts["gaps"] += 1
                return True
            if seq > self.next_seq:  # lost events, no replay: what the index holds may be stale
                self.counts["gaps"] += 1
                self.lost()
            else:  # the numbers went back: a new process
                self.restarted()
        self.batch(seq, frames[2])
        return False

    def lost(self) -> None:
        """A gap that no replay fills (none, the server no longer buffers it, or it did not answer): start
        over from the next batch."""
        self.index.cleared()
        self.next_seq = self.last_ts = None

    def restarted(self) -> None:
        """The server is a new process (an empty cache, its numbers from 0): forget the old one's blocks."""
        self.counts["restarts"] += 1
        log.info("KV events: the server restarted; its index starts over")
        self.lost()

    def same_epoch(self, payload: bytes) -> bool:
        """Whether ``payload``, replayed as batch ``next_seq - 1``, is the batch applied under that number
        (the same process published it); False when it cannot be told (that batch did not decode)."""
        try:
            return self.last_ts is not None and _BATCH.decode(payload).ts == self.last_ts
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False

    def batch(self, seq: int, payload: bytes) -> None:
        """Apply the batch ``seq`` (replayed ones too)."""
        self.next_seq = seq + 1
        self.last_ts = None
        self.last_event_at = self.clock()
        try:
            batch = _BATCH.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.counts["malformed"] += 1
            return
        self.last_ts = batch.ts
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


class _Restarted(Exception):
    """A replay showed another process behind the server's address."""


class EventSubscriber:
    """Reads one server's published events into an ``EventFeed`` (``run`` until cancelled).

    Args:
        endpoint: the server's publisher, e.g. ``tcp://127.0.0.1:5557``.
        feed: where the events go.
        replay_endpoint: the server's replay socket, if it has one: each time the subscriber connects it
            replays what the server still buffers (so a proxy started after the server knows its cache, and
            a restarted server is told from the old one), and it fills gaps.
        topic: the publisher's topic ("" unless the operator set one).
        hwm: messages queued at most while the proxy is busy; past it ZMQ drops (a gap, handled).
        replay_timeout_s: how long one replay may go without an answer before the feed starts over.
        heartbeat_s: ZMQ heartbeats on the connection: a publisher whose host went away without closing it
            is noticed after three missed ones, and reconnected to (then checked) when it is back.
    """

    def __init__(self, endpoint: str, *, feed: EventFeed, replay_endpoint: str | None = None, topic: str = "",
                 hwm: int = 10_000, replay_timeout_s: float = 2.0, heartbeat_s: float = 2.0):
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic.encode()
        self.feed, self.hwm, self.replay_timeout_s = feed, hwm, replay_timeout_s
        self.heartbeat_ms = int(heartbeat_s * 1000)
        feed.can_replay = replay_endpoint is not None

    async def run(self) -> None:
        import zmq
        import zmq.asyncio
        from zmq.utils.monitor import parse_monitor_message

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.hwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ms)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self.heartbeat_ms)
        # the connection's own events: each time it comes up, the process behind the address may be new
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(self.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        poller = zmq.asyncio.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        connections = 0
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:  # before any message: one that follows a reconnection may be a new process's
                    if parse_monitor_message(await monitor.recv_multipart())["event"] == zmq.EVENT_CONNECTED:
                        await self.connected(again=connections > 0)
                        connections += 1
                    continue
                frames = await sub.recv_multipart()
                if self.feed.frames(frames):
                    await self.replay()
                    self.feed.frames(frames)  # a duplicate if the replay covered it, else applied now
        finally:
            sub.close(linger=0)  # and its monitoring with it
            monitor.close(linger=0)

    async def connected(self, *, again: bool) -> None:
        """The connection to the publisher came up (``again``: not for the first time): learn the server's
        cache, or check that it is still the process the index describes."""
        if again:
            self.feed.counts["reconnects"] += 1
        if self.replay_endpoint is not None:
            await self.replay()
        elif again and self.feed.next_seq is not None:  # no replay: a restart cannot be told from a blip
            self.feed.lost()

    async def replay(self) -> None:
        """Ask the server for the batches it buffers and apply them: all of them when the feed has none
        yet, else from the last one applied, which must come back the same (the same process: module
        docstring); otherwise the index starts over from the new process's buffer. A replay that stops
        answering, or that no longer holds the batches the feed lacks, makes the feed start over."""
        try:
            await self._replay()
        except _Restarted:
            self.feed.restarted()
            await self._replay()

    async def _replay(self) -> None:
        import zmq
        import zmq.asyncio

        feed = self.feed
        verify = check = feed.next_seq is not None  # check: the first batch answered is still to be checked
        start = feed.next_seq - 1 if verify else 0
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        feed.counts["replays"] += 1
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
                    if check:  # the server's numbers have not reached the last batch applied: a new process
                        raise _Restarted
                    break
                if seq != expected and (verify or expected != 0):  # from 0 unchecked: the buffer's first on
                    raise ValueError(f"replay began at {seq}, not {expected}")
                expected = seq + 1
                if check:  # the batch the feed applied last: the same process answers it unchanged
                    check = False
                    if not feed.same_epoch(frames[3]):
                        raise _Restarted
                    continue
                feed.batch(seq, frames[3])
            feed.replayed = True
        except (TimeoutError, ValueError) as exc:
            log.warning("KV events of %s: replay from %d failed (%s); the index starts over", self.endpoint, start, exc)
            feed.lost()
        finally:
            sock.close(linger=0)
