"""When the connector's save thread may write: at once while vLLM is idle, sparingly while it serves.

Writing KV to the store costs CPU (encoding, the tiers' copies, the remote's socket), and on a small CPU
server that CPU comes out of the next prefill: saving every block as it was computed made first-time
prompts 0.57x as fast as plain prefix caching (issue 32, ``bench connector``). So saves wait for the
engine: the worker marks each step's start and end (``step_began`` / ``step_ended``), and the save thread
asks for a turn before each write (``wait_turn``). A turn comes

- at once when no step runs and none ended in the last ``quiet_s`` (the engine is idle), or
- while the engine serves, once the writes made in busy turns have taken at most ``busy_share`` of the
  time (after a write of ``d`` seconds the next busy turn is ``d * (1 - share) / share`` later), so a
  stream of prompts still lets saves through at a bounded cost; ``busy_share = 0`` writes only when idle.

``due`` is the decision alone, a pure function of the clock, so it is tested without threads or sleeps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Pacer:
    """Turns for the save thread (module docstring). Thread-safe; the worker's calls are a lock each.

    Args:
        busy_share: the share of time writes may take while the engine serves, in [0, 1].
        quiet_s: how long after a step the engine counts as idle (steps of a busy engine follow one
            another within about a millisecond; requests of one client come tens of milliseconds apart).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, *, busy_share: float, quiet_s: float, clock: Callable[[], float] = time.monotonic):
        if not 0.0 <= busy_share <= 1.0 or quiet_s < 0:
            raise ValueError(f"busy_share must be in [0, 1] and quiet_s >= 0, got {busy_share}, {quiet_s}")
        self.busy_share, self.quiet_s, self.clock = busy_share, quiet_s, clock
        self._cond = threading.Condition()
        self._in_step = False
        self._last_end = float("-inf")
        self._next_busy = float("-inf")
        self._busy_turn = False
        self._poked = False
        self._open = True

    # -- the worker's side --------------------------------------------------------------------------------
    def step_began(self) -> None:
        with self._cond:
            self._in_step = True

    def step_ended(self) -> None:
        with self._cond:
            self._in_step = False
            self._last_end = self.clock()
            self._cond.notify_all()

    # -- the save thread's side --------------------------------------------------------------------------
    def due(self, now: float) -> float | None:
        """Seconds until the next turn at ``now``: 0 for now, None for not before a step ends. Callers hold
        no lock: this reads a snapshot (a stale one only delays a turn until the next wake-up)."""
        if not self._open:
            return 0.0
        waits = []
        if not self._in_step:
            idle_in = self._last_end + self.quiet_s - now
            if idle_in <= 0:
                return 0.0
            waits.append(idle_in)
        if self.busy_share > 0:
            busy_in = self._next_busy - now
            if busy_in <= 0:
                return 0.0
            waits.append(busy_in)
        return min(waits) if waits else None

    def wait_turn(self) -> bool:
        """Block until the save thread may write (True), or until ``poke`` (False: new work to look at)."""
        with self._cond:
            while True:
                if self._poked:
                    self._poked = False
                    return False
                now = self.clock()
                wait = self.due(now)
                if wait == 0.0:
                    self._busy_turn = self._open and (self._in_step or now < self._last_end + self.quiet_s)
                    return True
                self._cond.wait(wait)

    def spent(self, seconds: float) -> None:
        """The write the last turn allowed took ``seconds``: a busy turn defers the next busy one."""
        with self._cond:
            if self._busy_turn and self.busy_share > 0:
                self._next_busy = self.clock() + seconds * (1.0 - self.busy_share) / self.busy_share

    def poke(self) -> None:
        """Wake the save thread's ``wait_turn`` (new saves were queued)."""
        with self._cond:
            self._poked = True
            self._cond.notify_all()

    def close(self) -> None:
        """From now on every turn comes at once (the queue is being flushed at shutdown)."""
        with self._cond:
            self._open = False
            self._cond.notify_all()
