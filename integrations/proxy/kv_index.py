"""What one vLLM server's prefix cache holds, kept from the server's own KV events (issue 30).

vLLM publishes a ``BlockStored`` event for every full block it caches (its hash, its parent's hash, its
token ids and the extra keys that went into the hash: the ``cache_salt`` on a prompt's first block),
``BlockRemoved`` when it evicts blocks and ``AllBlocksCleared`` when its cache is reset. vLLM's hashes
cannot be recomputed here (their seed is the server's), so the index names each block by a key of its own,
chained the same way: a block's key digests its parent's key, its tokens and its extra keys. A request's
prompt gets the same keys from its token ids and its salt (``prompt_keys``), and the share of its leading
blocks the index holds is what that server would not prefill.

The salt is part of the first block's key and every later key chains from it, so a request is only ever
scored by blocks cached under its own salt (its tenant's): two tenants' identical prompts have disjoint
keys. Memory is bounded (``max_blocks`` per server; the oldest stored block is forgotten first, which can
only under-count what the server holds). Nothing an event carries is trusted beyond its shape: a block whose
parent the index does not know (joined late, or forgotten) cannot be keyed and is skipped, counted.
"""

from __future__ import annotations

import array
import hashlib
import json
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence

KEY_BYTES = 16
_ROOT = b"\x00" * KEY_BYTES


def block_key(parent: bytes | None, tokens: Sequence[int], extra: Sequence | None) -> bytes:
    """The index's key of one block: its parent's key (None: the prompt's first block), its token ids and
    the extra keys vLLM hashed into it (the salt on a first block; None or empty: none)."""
    h = hashlib.blake2b(parent or _ROOT, digest_size=KEY_BYTES)
    h.update(array.array("q", tokens).tobytes())
    if extra:
        h.update(json.dumps(list(extra), default=str, separators=(",", ":")).encode())
    return h.digest()


def prompt_keys(ids: Sequence[int], *, block_size: int, salt: str | None, parent: bytes | None = None) -> list[bytes]:
    """The keys of a prompt's full blocks as a server that cached it under ``salt`` names them (what
    ``block_key`` gives block by block, with the prompt's bytes made once). ``parent``: the key of the block
    before ``ids[0]`` when ``ids`` continue a prompt from a block boundary (the salt is in that chain
    already); None: ``ids`` start the prompt."""
    n = len(ids) // block_size
    data = memoryview(array.array("q", ids[: n * block_size]).tobytes())
    step = 8 * block_size
    keys: list[bytes] = []
    first, parent = parent is None, parent or _ROOT
    for i in range(n):
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(data[i * step : (i + 1) * step])
        if i == 0 and first and salt:
            h.update(json.dumps([salt], separators=(",", ":")).encode())
        parent = h.digest()
        keys.append(parent)
    return keys



def keys_by(*, salt: str | None, block_size: int):
    """``prompt_keys`` under one tenant's salt as ``ordering.event_order`` asks for it: ``(ids, parent) ->``
    the keys of ``ids``' full blocks."""
    return lambda ids, parent: prompt_keys(ids, block_size=block_size, salt=salt, parent=parent)

class BlockIndex:
    """The blocks one server holds, by the index's keys (module docstring).

    Args:
        block_size: the server's block size (an event of another size is refused).
        max_blocks: blocks remembered at most; past it the oldest stored is forgotten.
        fleet: the fleet's index, told each key this server comes to hold or stops holding, as ``server``.
    """

    def __init__(self, *, block_size: int, max_blocks: int = 100_000, fleet: FleetIndex | None = None,
                 server: int = 0):
        if block_size <= 0 or max_blocks <= 0:
            raise ValueError("block_size and max_blocks must be positive")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.fleet, self.server = fleet, server
        self._keys: OrderedDict[Hashable, bytes] = OrderedDict()  # vLLM's hash -> our key, oldest first
        self._held: Counter[bytes] = Counter()  # our key -> how many of vLLM's hashes (and one expectation) name it
        self._expected: OrderedDict[bytes, float] = OrderedDict()  # our key -> until when, soonest first
        self.counts = Counter()  # stored, removed, cleared, unknown_parent, refused, forgotten

    def __len__(self) -> int:
        return len(self._keys)

    def stored(self, hashes: Sequence[Hashable], parent: Hashable | None, token_ids: Sequence[int],
               block_size: int, extra_keys: Sequence | None = None) -> int:
        """A ``BlockStored`` event: ``hashes`` chained from ``parent``, ``block_size`` tokens each. Returns
        the blocks indexed (0 when the parent is unknown or the event is malformed: counted)."""
        n = len(hashes)
        if block_size != self.block_size or len(token_ids) != n * block_size or (
                extra_keys is not None and len(extra_keys) != n):
            self.counts["refused"] += 1
            return 0
        key = None
        if parent is not None:
            key = self._keys.get(parent)
            if key is None:
                self.counts["unknown_parent"] += n
                return 0
        keys = []
        try:  # all keyed before any is kept: a bad block refuses the whole event
            for i in range(n):
                key = block_key(key, token_ids[i * block_size : (i + 1) * block_size],
                                extra_keys[i] if extra_keys else None)
                keys.append(key)
        except (OverflowError, TypeError, ValueError):  # a token id that is no int64, extra keys of odd types
            self.counts["refused"] += 1
            return 0
        for h, key in zip(hashes, keys):
            self._put(h, key)
        self.counts["stored"] += n
        return n

    def _put(self, h: Hashable, key: bytes) -> None:
        old = self._keys.pop(h, None)
        if old is not None:
            self._drop(old)
        self._keys[h] = key
        self._held[key] += 1
        if self.fleet is not None and self._held[key] == 1:
            self.fleet.add(key, self.server)
        while len(self._keys) > self.max_blocks:
            _, forgotten = self._keys.popitem(last=False)
            self._drop(forgotten)
            self.counts["forgotten"] += 1

    def _drop(self, key: bytes) -> None:
        self._held[key] -= 1
        if self._held[key] <= 0:
            del self._held[key]
            if self.fleet is not None:
                self.fleet.drop(key, self.server)

    def expect(self, keys: Sequence[bytes], until: float) -> None:
        """A prompt with these keys was just sent to the server: count its blocks as held until ``until``
        (or until its own ``BlockStored`` arrives and holds them for good). This covers the time between
        sending a request and its events arriving, in which the next turn of a conversation is often
        routed already. ``until`` must not go back in time between calls (a monotonic clock's now + a
        fixed delay): the expectations expire oldest first."""
        for key in keys:
            if key in self._expected:
                self._expected.move_to_end(key)
            else:
                self._held[key] += 1
                if self.fleet is not None and self._held[key] == 1:
                    self.fleet.add(key, self.server)
            self._expected[key] = until
        while len(self._expected) > self.max_blocks:
            self._drop(self._expected.popitem(last=False)[0])

    def expire(self, now: float) -> None:
        """Drop the expectations whose time has passed (what the events did not confirm is not held)."""
        while self._expected:
            key, until = next(iter(self._expected.items()))
            if until > now:
                return
            del self._expected[key]
            self._drop(key)

    def removed(self, hashes: Sequence[Hashable]) -> None:
        """A ``BlockRemoved`` event (a hash the index never saw is ignored)."""
        for h in hashes:
            key = self._keys.pop(h, None)
            if key is not None:
                self._drop(key)
                self.counts["removed"] += 1

    def cleared(self) -> None:
        """An ``AllBlocksCleared`` event, or a gap in the events that cannot be replayed: start over."""
        if self.fleet is not None:
            for key in self._held:
                self.fleet.drop(key, self.server)
        self._keys.clear()
        self._held.clear()
        self._expected.clear()
        self.counts["cleared"] += 1

    def held_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a prompt's, from ``prompt_keys``) the server holds, from the first on: the
        blocks it would not prefill (vLLM reuses a cached prefix only up to its first missing block)."""
        n = 0
        for k in keys:
            if k not in self._held:
                break
            n += 1
        return n


class FleetIndex:
    """Every server's blocks in one map, key -> a bitmask of the servers that hold it (each server's
    ``BlockIndex`` keeps it current). Scoring a prompt against the whole fleet is one pass over its keys,
    ANDing masks, instead of one walk per server: the cost follows the prompt's length, not the fleet's
    size (``bench fleet``'s simulation measures it at 16-256 servers)."""

    def __init__(self) -> None:
        self._mask: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._mask)

    def add(self, key: bytes, server: int) -> None:
        self._mask[key] = self._mask.get(key, 0) | (1 << server)

    def drop(self, key: bytes, server: int) -> None:
        mask = self._mask.get(key, 0) & ~(1 << server)
        if mask:
            self._mask[key] = mask
        else:
            self._mask.pop(key, None)

    def depth_groups(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """The servers holding at least the first of ``keys``, grouped by how many they hold from the first
        on: ``(blocks, bitmask of servers)``, deepest first. One AND per key and one entry per distinct
        depth, whatever the fleet's size."""
        groups: list[tuple[int, int]] = []
        alive = -1  # every server, until the first key says which
        for depth, key in enumerate(keys):
            now = alive & self._mask.get(key, 0)
            if depth and alive & ~now:
                groups.append((depth, alive & ~now))
            alive = now
            if not alive:
                break
        if alive > 0 and keys:
            groups.append((len(keys), alive))
        groups.reverse()
        return groups

    def held_prefixes(self, keys: Sequence[bytes]) -> dict[int, int]:
        """For each server holding at least the first of ``keys``: how many of them, from the first on."""
        out: dict[int, int] = {}
        for depth, mask in self.depth_groups(keys):
            while mask:
                low = mask & -mask
                out[low.bit_length() - 1] = depth
                mask ^= low
        return out
