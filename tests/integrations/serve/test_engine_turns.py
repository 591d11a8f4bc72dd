"""serve's engine thread: background work runs only when no request has come for a while."""

from __future__ import annotations

import asyncio
import threading
import time

from contextkit.core.tenant import Tenant
from contextkit.integrations.serve.engine_turns import FairScheduler, Job


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


class _Costly:
    """A request whose planning and every step cost one second of a fake engine clock, logged by tenant."""

    def __init__(self, log: list, clock: list, tenant: str, steps: int):
        self.log, self.clock, self.tenant, self.steps, self.result = log, clock, tenant, steps, None
        self._turn()  # planning (make) is a turn too

    def _turn(self) -> None:
        self.clock[0] += 1.0
        self.log.append(self.tenant)

    def __iter__(self):
        for i in range(self.steps):
            self._turn()
            yield str(i)
        self.result = "done"


def test_a_key_gets_one_share_however_many_sub_tenants_it_names():
    """Engine turns are shared per key tenant: acme's requests under four sub-tenants get, together, as
    many turns as globex's one request (per sub-tenant, acme got four turns to globex's one)."""
    log: list = []
    clock = [0.0]
    gate, done = threading.Event(), threading.Semaphore(0)
    loop = asyncio.new_event_loop()
    sched = FairScheduler(max_active=8, on_start=gate.wait, clock=lambda: clock[0])
    try:
        for tenant in ("acme:s0", "acme:s1", "acme:s2", "acme:s3", "globex"):
            job = Job(loop, lambda t=tenant: _Costly(log, clock, t, steps=6), time.monotonic() + 60, Tenant(tenant))
            job.on_done = lambda _job: done.release()
            sched.submit(job)
        gate.set()  # every job is in the inbox before the first turn
        for _ in range(5):
            assert done.acquire(timeout=30)
    finally:
        sched.close()
        loop.close()
    assert log.count("globex") == 7 and len(log) == 35
    until_globex_done = log[: max(i for i, t in enumerate(log) if t == "globex") + 1]
    acme = sum(t.startswith("acme:") for t in until_globex_done)
    assert acme <= 7 + 1, log  # alternating with globex (one turn more at most), not 4 to 1
