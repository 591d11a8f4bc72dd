"""serve's engine thread: background work runs only when no request has come for a while."""

from __future__ import annotations

import asyncio
import threading
import time

from contextkit.core.tenant import Tenant
from contextkit.integrations.scheduler import FairScheduler, Job


class _Stream:
    def __init__(self, log: list, name: str, steps: int = 2):
        self.log, self.name, self.steps, self.result = log, name, steps, None

    def __iter__(self):
        for i in range(self.steps):
            self.log.append(("job", self.name, i))
            yield f"{self.name}{i}"
        self.result = "done"


def test_idle_work_waits_for_a_quiet_engine_and_never_delays_a_request():
    log: list = []
    units = [0]
    started = threading.Event()

    def idle() -> bool:  # three units of background work, each logged
        if units[0] >= 3:
            return False
        units[0] += 1
        log.append(("idle", units[0]))
        time.sleep(0.02)
        return True

    loop = asyncio.new_event_loop()
    sched = FairScheduler(idle=idle, on_start=started.set, idle_after_s=1.0)
    try:
        assert started.wait(5)  # on_start ran first, on the engine thread
        job = Job(loop, lambda: _Stream(log, "a"), time.monotonic() + 60, Tenant("t"))
        sched.submit(job)  # arrives before the quiet period is over: served first
        deadline = time.monotonic() + 5
        while units[0] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [e for e in log if e[0] == "job"] == [("job", "a", 0), ("job", "a", 1)]
        assert log.index(("job", "a", 1)) < log.index(("idle", 1))  # no idle unit while the job ran
        assert units[0] == 3  # then the backlog ran, one unit at a time, while nothing came
        time.sleep(1.2)
        assert units[0] == 3  # nothing left: the engine thread sleeps
    finally:
        sched.close()
        loop.close()
