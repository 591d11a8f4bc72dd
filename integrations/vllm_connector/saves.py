"""The connector's saves: what a step completes, copied out of vLLM's paged cache and handed to the store
on a background thread through a queue bounded in bytes, so a slow store never holds a step nor fills
the server's memory (a save past the budget is dropped and counted: a later miss, never a failed step).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contextkit.integrations.vllm_connector.keys import ConnectorKey
from contextkit.integrations.vllm_connector.paged import PagedKV, slots_of
from contextkit.integrations.vllm_connector.stats import Counters
from contextkit.kvstore.entry import make_entry

log = logging.getLogger("contextkit.connector")
# The save thread's nice value. 19 kept saves off the forward's cores entirely and starved them under a
# stream of new prompts (the queue overflowed, a quarter of the blocks was dropped); 10 leaves them ~10%
# of a contended core, which is what saving costs next to a prefill (bench connector).
SAVE_NICE = 10


@dataclass(frozen=True, slots=True)
class SaveOp:
    """Save request tokens ``[start, end)`` (ids ``ids``, in blocks ``block_ids``) under ``key``."""

    key: ConnectorKey
    start: int
    end: int
    ids: tuple[int, ...]
    block_ids: tuple[int, ...]


class SaveQueue:
    """Entries waiting for the store, at most ``budget_bytes`` of them, and the thread that puts them.

    Args:
        store: any kvstore (``put`` may block: it runs on this queue's thread).
        budget_bytes: bytes of entries held for the store at most (``ConnectorSettings.save_queue_bytes``).
        counters: the connector's counters (``saved_entries``, ``saved_tokens``, ``dropped_saves``).
        layout: the entries' layout string (``KVGeometry.layout()``).
    """

    def __init__(self, store, *, budget_bytes: int, counters: Counters, layout: str):
        self.store = store
        self.budget_bytes = budget_bytes
        self.counters = counters
        self.layout = layout
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # bytes of entries queued or being put
        self._thread = threading.Thread(target=self._loop, name="contextkit-connector-save", daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending

    def submit(self, ops: Sequence[SaveOp], *, caches: Sequence[tuple[str, torch.Tensor]], paged: PagedKV) -> None:
        """Queue the step's saves that fit the budget; drop (and count) the rest.

        The budget is checked before anything is copied (a stuck store costs no copy of the step), and each
        admitted entry gets storage of its own: a view of the step's stacked K/V would keep the whole step,
        dropped saves included, alive for as long as any one entry waits for the store."""
        token_bytes = 2 * len(caches) * paged.num_heads * paged.head_size * paged.dtype.itemsize + 8  # k, v, id
        admitted = []
        with self._lock:
            for op in ops:
                need = (op.end - op.start) * token_bytes
                if self._pending + need <= self.budget_bytes:
                    self._pending += need
                    admitted.append((op, need))
        if len(admitted) < len(ops):
            self.counters.add("dropped_saves", len(ops) - len(admitted))
        if not admitted:
            return
        # one read per layer for every admitted save (a torch call costs tens of microseconds in vLLM's
        # worker: per block and layer it added up to hundreds of milliseconds a request)
        bs = paged.block_size
        slots = torch.cat([slots_of(list(op.block_ids), bs, op.start, op.end) for op, _ in admitted])
        ks, vs = zip(*(paged.read(cache, slots) for _, cache in caches))
        k, v = torch.stack(ks), torch.stack(vs)  # (layers, heads, tokens of the admitted saves, head_size)
        del ks, vs
        at = 0
        for op, need in admitted:
            n = op.end - op.start
            tensors = {"k": k[:, :, at : at + n].clone(), "v": v[:, :, at : at + n].clone(),  # own storage
                       "ids": torch.tensor(op.ids, dtype=torch.int64)}
            at += n
            held = _storage_bytes(tensors.values())  # what the entry really keeps alive
            with self._lock:
                self._pending += held - need
            self._queue.put((op.key, make_entry(op.key, tensors, self.layout), held))

    def _loop(self) -> None:
        # saves yield the cores to the forward: on Linux a thread's nice value is its own
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SAVE_NICE)
        except (OSError, AttributeError):  # not Linux, or not allowed: saves run at normal priority
            pass
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, entry, held = item
            try:
                self.store.put(key, entry)
                self.counters.add("saved_entries")
                self.counters.add("saved_tokens", key.num_tokens)
            except Exception as exc:  # noqa: BLE001 - a failed save is a later miss, never a failed step
                log.warning("contextkit connector: save failed (%s)", exc)
                self.counters.add("dropped_saves")
            finally:
                del entry
                with self._lock:
                    self._pending -= held

    def close(self, timeout_s: float = 10.0) -> None:
        """Put what is queued, then stop the thread (waits ``timeout_s`` at most)."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts the whole buffer it keeps)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
