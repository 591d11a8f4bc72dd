"""The connector's saves: what a step completes, out of vLLM's paged cache and into the store, without
slowing that step or the steps after it (issue 32).

- On the step (``submit``): an admission check against the byte budget, then a raw copy of the step's new
  blocks into a reused staging buffer, one ``index_select`` per layer (``PagedKV.stage``). Nothing else:
  unpacking the CPU cache's packing and checksumming the step's KV on the step had cost more than a
  tenth of a prefill.
- On the save thread, at a low CPU priority: each save unpacked into an entry of its own
  (``PagedKV.unstage``, ``make_entry``), then written when ``pacing.Pacer`` gives a turn (at once while
  vLLM is idle, a bounded share of the time while it serves), several entries per store call, each
  encoded once for every tier (``TieredStore.put_many``).
- The budget: staged and unwritten bytes together at most ``budget_bytes``. A save that does not fit
  evicts unwritten saves worth less, or is dropped itself; counted either way (``dropped_saves``), never
  a failed or a slower step. Worth: a block's place in its prompt. A prompt's first blocks are the prefix
  of every request that continues it, its last ones of few, so deeper blocks go first; writes go in the
  other order.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from contextkit.integrations.vllm_connector.keys import ConnectorKey
from contextkit.integrations.vllm_connector.pacing import Pacer
from contextkit.integrations.vllm_connector.paged import PagedKV
from contextkit.integrations.vllm_connector.stats import Counters
from contextkit.kvstore.entry import Entry, make_entry

log = logging.getLogger("contextkit.connector")
# The save thread's nice value. 19 kept saves off the forward's cores entirely and starved them under a
# stream of new prompts (the queue overflowed, a quarter of the blocks was dropped); 10 leaves them ~10%
# of a contended core. The pacer decides when writes happen; this only ranks the thread's CPU below it.
SAVE_NICE = 10
WRITE_BATCH_BYTES = 8 << 20  # entries per store call at most: LMCache batches a call's puts


@dataclass(frozen=True, slots=True)
class SaveOp:
    """Save request tokens ``[start, end)`` (ids ``ids``, in blocks ``block_ids``) under ``key``, K re-rotated
    by ``shift`` positions first (a span saved out of the request that computed it: ``-start``, so that it
    is stored at positions 0.., as a span compiled alone is)."""

    key: ConnectorKey
    start: int
    end: int
    ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    shift: int = 0


@dataclass(slots=True)
class _Staged:
    """One step's admitted saves and their blocks, staged raw: ``rows[i]`` are op i's rows of ``tiles``."""

    ops: list[SaveOp]
    rows: list[torch.Tensor]
    tiles: torch.Tensor
    buffer: torch.Tensor
    nbytes: int
    paged: PagedKV


@dataclass(order=True, slots=True)
class _Ready:
    """An unwritten entry, ordered by worth (its start in the prompt, then arrival)."""

    start: int
    seq: int
    key: ConnectorKey = field(compare=False)
    entry: Entry = field(compare=False)
    nbytes: int = field(compare=False)


class SaveQueue:
    """The saves between the step and the store, and the thread that writes them (module docstring).

    Args:
        store: a ``TieredStore`` (its ``put_many`` may block: it runs on this queue's thread).
        budget_bytes: staged and unwritten bytes at most (``ConnectorSettings.save_queue_bytes``).
        counters: the connector's counters (``saved_entries``, ``saved_tokens``, ``dropped_saves``).
        layout: the entries' layout string (``KVGeometry.layout()``).
        pacer: when writes may happen; None: at once (tests of the queue alone).
    """

    def __init__(self, store, *, budget_bytes: int, counters: Counters, layout: str, pacer: Pacer | None = None,
                 rope: list | None = None):
        self.store = store
        self.rope = rope  # each layer's RoPE geometry: saves with a shift need it (None: they are dropped)
        self._rotator = None
        self.budget_bytes = budget_bytes
        self.counters = counters
        self.layout = layout
        self.pacer = pacer or Pacer(busy_share=1.0, quiet_s=0.0)
        self._lock = threading.Condition()
        self._pending = 0  # bytes staged, unwritten or being written
        self._intake: list[_Staged] = []
        self._ready: list[_Ready] = []  # sorted: most worth first
        self._free: list[torch.Tensor] = []  # staging buffers to reuse
        self._seq = itertools.count()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="contextkit-connector-save", daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending

    # -- the step's side ----------------------------------------------------------------------------------
    def submit(self, ops: Sequence[SaveOp], *, caches: Sequence[tuple[str, torch.Tensor]], paged: PagedKV) -> None:
        """Stage the step's saves that fit the budget (evicting unwritten ones worth less); drop the rest.
        Checked before anything is copied: a stuck store costs the step no copy."""
        block_bytes = _block_bytes(len(caches), paged)
        rows_of: dict[int, int] = {}  # physical block -> its row in this step's staging
        admitted, rows = [], []
        with self._lock:
            bs = paged.block_size
            for op in sorted(ops, key=lambda o: o.start):  # most worth first
                mine = op.block_ids[op.start // bs : -(-op.end // bs)]
                new = [b for b in dict.fromkeys(mine) if b not in rows_of]
                if not self._make_room(len(new) * block_bytes, op.start):
                    self.counters.add("dropped_saves")
                    continue
                for b in new:
                    rows_of[b] = len(rows_of)
                self._pending += len(new) * block_bytes
                admitted.append(op)
                rows.append(torch.tensor([rows_of[b] for b in mine], dtype=torch.int64))
            if not admitted:
                return
            buffer = self._buffer(len(rows_of), len(caches), paged)
        tiles = paged.stage([c for _, c in caches], torch.tensor(list(rows_of), dtype=torch.int64), buffer)
        with self._lock:
            self._intake.append(_Staged(admitted, rows, tiles, buffer, len(rows_of) * block_bytes, paged))
            self._lock.notify_all()
        self.pacer.poke()

    def prewarm(self, *, layers: int, paged: PagedKV, blocks: int = 64) -> None:
        """Touch one staging buffer now (at most an eighth of the budget), so that the first steps that
        save do not pay the page faults of fresh memory (~4 µs per 4 KiB here)."""
        blocks = min(blocks, max(1, self.budget_bytes // 8 // _block_bytes(layers, paged)))
        with self._lock:
            buf = self._buffer(blocks, layers, paged)
            buf.zero_()
            self._free.append(buf)

    def _make_room(self, need: int, worth: int) -> bool:
        """Evict saves deeper than ``worth`` until ``need`` more bytes fit (lock held): unwritten entries one
        by one, staged steps whole (a step's staging is freed only with all of its saves)."""
        while self._pending + need > self.budget_bytes:
            entry_at = self._ready[-1].start if self._ready else -1
            step = max(self._intake, key=lambda st: min(op.start for op in st.ops), default=None)
            step_at = min(op.start for op in step.ops) if step is not None else -1
            if max(entry_at, step_at) <= worth:
                return False
            if entry_at >= step_at:
                self._pending -= self._ready.pop().nbytes
                self.counters.add("dropped_saves")
            else:
                self._intake.remove(step)
                self._pending -= step.nbytes
                self._free.append(step.buffer)
                self._trim_free(step.buffer.nbytes)
                self.counters.add("dropped_saves", len(step.ops))
        return True

    def _buffer(self, blocks: int, layers: int, paged: PagedKV) -> torch.Tensor:
        """A staging buffer for ``blocks`` blocks, reused when one is free (lock held)."""
        for i, buf in enumerate(self._free):
            if buf.shape[1] >= blocks:
                return self._free.pop(i)
        cap = 1 << max(0, blocks - 1).bit_length()  # powers of two: a few sizes serve every step
        return torch.empty((layers, cap, *paged.block_shape), dtype=paged.dtype)

    # -- the save thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        lower_priority(SAVE_NICE)  # saves yield the cores to the forward
        while True:
            with self._lock:
                while not (self._intake or self._ready or self._closing):
                    self._lock.wait()
                if self._closing and not (self._intake or self._ready):
                    return
            # every piece of work waits for a turn, unpacking too: on a small CPU server any work on this
            # thread while a forward runs slows it (measured: unpacking alone, ~10% of first-time TTFT)
            if not self.pacer.wait_turn():
                continue  # woken for new work: look again
            t0 = time.perf_counter()
            with self._lock:
                staged = self._intake.pop(0) if self._intake else None
            if staged is not None:
                self._unstage(staged)
            elif self._ready:
                self._write_some()
            self.pacer.spent(time.perf_counter() - t0)

    def _unstage(self, staged: _Staged) -> None:
        """Each staged save as an entry of its own; the staging buffer goes back for reuse."""
        paged, made = staged.paged, []
        bs = paged.block_size
        for op, rows in zip(staged.ops, staged.rows):
            off = (op.start // bs) * bs
            k, v = paged.unstage(staged.tiles, rows, op.start - off, op.end - off)
            if op.shift and not self._rotated(k, op.shift):
                continue
            entry = make_entry(op.key, {"k": k, "v": v, "ids": torch.tensor(op.ids, dtype=torch.int64)}, self.layout)
            made.append(_Ready(op.start, next(self._seq), op.key, entry, entry.nbytes))
        with self._lock:
            self._pending -= staged.nbytes
            for r in made:
                if self._make_room(r.nbytes, r.start):
                    self._pending += r.nbytes
                    bisect.insort(self._ready, r)
                else:
                    self.counters.add("dropped_saves")
            self._free.append(staged.buffer)
            self._trim_free(staged.buffer.nbytes)
            self._lock.notify_all()

    def _rotated(self, k: torch.Tensor, shift: int) -> bool:
        """Re-rotate ``k`` (layers, heads, n, head_size) by ``shift`` in place; False (counted as a dropped
        save) when this model's RoPE geometry is unknown."""
        if self.rope is None:
            self.counters.add("dropped_saves")
            return False
        if self._rotator is None:
            from contextkit.kernels.rerotate import Rerotator

            self._rotator = Rerotator()
        for li in range(k.shape[0]):
            self._rotator(k[li], shift, self.rope[li], out=k[li])
        return True

    def _trim_free(self, one: int) -> None:
        """Keep at most a quarter of the budget in free staging buffers (lock held)."""
        while len(self._free) > 1 and sum(b.nbytes for b in self._free) > max(one, self.budget_bytes // 4):
            self._free.pop(0)

    def _write_some(self) -> None:
        with self._lock:
            batch, size = [], 0
            while self._ready and (not batch or size + self._ready[0].nbytes <= WRITE_BATCH_BYTES):
                r = self._ready.pop(0)
                batch.append(r)
                size += r.nbytes
        try:
            self.store.put_many([(r.key, r.entry) for r in batch])
            self.counters.add("saved_entries", len(batch))
            self.counters.add("saved_tokens", sum(r.key.num_tokens for r in batch))
        except Exception as exc:  # noqa: BLE001 - a failed save is a later miss, never a failed step
            log.warning("contextkit connector: save failed (%s)", exc)
            self.counters.add("dropped_saves", len(batch))
        finally:
            with self._lock:
                self._pending -= size

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, at once (no more pacing), then stop the thread (waits ``timeout_s`` at most)."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self.pacer.close()
        self._thread.join(timeout=timeout_s)


def lower_priority(nice: int) -> None:
    """Give the calling thread ``nice`` (on Linux a thread's nice value is its own, and threads it starts
    inherit it); elsewhere, or where it is not allowed, the thread keeps its priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError):
        pass


def _block_bytes(layers: int, paged: PagedKV) -> int:
    """Bytes of one staged block of every layer."""
    return layers * paged.dtype.itemsize * math.prod(paged.block_shape)
