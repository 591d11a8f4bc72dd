"""One time budget shared by several store calls.

A remote tier answering just under a per-call deadline, called once per block or span, would hold a
caller for ``calls x timeout`` (issue #26: vLLM's scheduler loop, every tenant behind it). Callers that
make several store calls for one unit of work (the KV connector: a scheduler step's lookups, a worker
step's loads) share one ``Deadline``: once it is spent, the rest answers a miss at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Deadline:
    """``budget_s`` seconds from construction, on ``clock`` (injectable, so that tests hold no sleeps)."""

    budget_s: float
    clock: Callable[[], float] = time.monotonic
    start: float = field(init=False)

    def __post_init__(self) -> None:
        if self.budget_s < 0:
            raise ValueError(f"a deadline's budget is a duration >= 0 s, got {self.budget_s}")
        self.start = self.clock()

    def remaining(self) -> float:
        """Seconds left (0 once spent)."""
        return max(0.0, self.start + self.budget_s - self.clock())

    @property
    def expired(self) -> bool:
        return self.remaining() <= 0.0
