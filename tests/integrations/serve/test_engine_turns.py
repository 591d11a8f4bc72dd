"""serve's engine thread: background work runs only when no request has come for a while."""

from __future__ import annotations

import asyncio
import threading
import time

from contextkit.core.tenant import Tenant
from contextkit.integrations.serve.engine_turns import EngineThreadScheduler, Job


class _Stream:
    def __init__(self, log: list, name: str, steps: int = 2):
        self.log, self.name, self.steps, self.result = log, name, steps, None

    def __iter__(self):
        for i in range(self.steps):
            self.log.append(("job", self.name, i))
            yield f"{self.name}{i}"
        self.result = "done"


class _Work:
    """An ``EngineThreadWork`` for tests: ``start_engine_thread`` logs and waits for ``gate``; the
    background units are logged, and ``during`` runs inside the unit of that number."""

    def __init__(self, log: list, units: int = 0, during: dict | None = None):
        self.log, self.units, self.during = log, units, during or {}
        self.gate, self.started = threading.Event(), threading.Event()
        self.calls = 0  # background_unit calls, the ones that found nothing to do included

    def start_engine_thread(self) -> None:
        self.log.append(("start", threading.current_thread().name))
        self.started.set()
        self.gate.wait()

    def background_unit(self) -> bool:
        self.calls += 1
        done = sum(e[0] == "idle" for e in self.log)
        if done >= self.units:
            return False
        self.log.append(("idle", done + 1))
        if done + 1 in self.during:
            self.during[done + 1]()
        return True


def _job(loop, log: list, name: str, on_done=None) -> Job:
    job = Job(loop, lambda: _Stream(log, name), time.monotonic() + 600, Tenant("t"))
    job.on_done = on_done
    return job


def test_idle_work_waits_for_a_quiet_engine_and_never_delays_a_request():
    """Ordered by events, not by time: ``idle_after_s=0`` lets background units run as soon as the
    engine is quiet, and what the test checks is the order of the log, which no timing can change."""
    log: list = []
    loop = asyncio.new_event_loop()
    work = _Work(log, units=3)
    sched = EngineThreadScheduler(work, idle_after_s=0.0)
    try:
        assert work.started.wait(30)  # start_engine_thread runs first, on the engine thread
        # arrives before the engine thread's first turn: it goes before any background unit
        work.during[1] = lambda: sched.submit(_job(loop, log, "b"))  # arrives during the first unit
        sched.submit(_job(loop, log, "a"))
        work.gate.set()
        assert sched.wait_until_idle(60)
        assert log == [("start", "engine"), ("job", "a", 0), ("job", "a", 1),
                       ("idle", 1),  # the engine was quiet: one unit
                       ("job", "b", 0), ("job", "b", 1),  # b came during it: it waited for that one only
                       ("idle", 2), ("idle", 3)]  # then the backlog, one unit per quiet turn
        # parked: the last call found nothing, and the thread waits for a job (it polls no more)
        assert work.calls == 4
        sched.submit(_job(loop, log, "c"))
        assert sched.wait_until_idle(60) and log[-2:] == [("job", "c", 0), ("job", "c", 1)] and work.calls == 5
    finally:
        sched.close()
        loop.close()


def test_without_work_the_engine_thread_only_runs_jobs():
    log: list = []
    loop = asyncio.new_event_loop()
    finished = threading.Event()
    sched = EngineThreadScheduler()
    try:
        sched.submit(_job(loop, log, "a", on_done=lambda _job: finished.set()))
        assert finished.wait(60) and sched.wait_until_idle(60)
        assert log == [("job", "a", 0), ("job", "a", 1)]
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
    done = threading.Semaphore(0)
    loop = asyncio.new_event_loop()
    work = _Work([])
    sched = EngineThreadScheduler(work, max_active=8, clock=lambda: clock[0])
    gate = work.gate
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
