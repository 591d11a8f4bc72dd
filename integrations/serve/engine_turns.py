"""``serve``'s engine thread: many requests on one engine, shared fairly between tenants.

``EngineThreadScheduler`` owns the built-in engine's one thread and schedules requests (``Job``) onto it;
what else that thread does (its start, background work when quiet) comes from an ``EngineThreadWork``.

The built-in engine runs one forward pass at a time and keeps each request's KV on its own, so requests
can take turns token by token (time slicing, not batching): a new request is planned and prefilled at
its turn, then every started request decodes one step per turn. Turns go to the tenant that has had the
least engine time so far (the engine seconds its steps took; a tenant arriving idle starts level with
the least-served busy tenant, so idle time banks no credit), and within a tenant to its requests in
turn, a request not yet started first. A tenant here is a key tenant (``Tenant.key_tenant``): a key's
sub-tenants share its turns, so naming more of them gets a key no more of the engine. So one tenant's
8000-token answers or 200 queued requests cost every other tenant at most one step each per turn, and a
new request's first token waits for one turn of the others, not for their whole answers. At most
``max_active`` requests hold KV at once; the rest wait for a place, planned at their turn. Background
work (compiling spans requests computed in context) runs in bounded units once no request has arrived
for ``idle_after_s``: a request queues behind at most one unit, and a client sending requests back to
back behind none.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from contextkit.core.errors import ContextKitError, DeadlineExceededError, OverloadedError
from contextkit.core.tenant import Tenant

_LATE = "the request ran past its deadline and was stopped; ask for fewer tokens or retry when the server is less busy"
_WAITED = "the request waited past its deadline; retry when the server is less busy"


class Job:
    """One request: ``make()`` plans it and returns a stream of text deltas, decoded a step per turn into
    a queue the event loop reads. It ends at its next turn once ``cancel`` is set (the client is gone) or
    past ``deadline``; ``stopped`` says which (counted by the server)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, make: Callable, deadline: float, tenant: Tenant):
        self.loop, self.make, self.deadline, self.tenant = loop, make, deadline, tenant
        self.stopped: str | None = None
        self.cancel = threading.Event()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stream = None
        self._deltas = None
        self.on_done: Callable[[Job], None] | None = None

    def _put(self, kind: str, value=None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))

    def step(self) -> bool:
        """One turn on the engine thread: plan and start (the first turn) or decode to the next delta.
        False once the job is over (finished, failed, cancelled or past its deadline)."""
        try:
            if self.cancel.is_set():
                if self.stream is not None and self.stream.result is None:
                    self.stopped = "disconnect"
                return self._end()
            if time.monotonic() > self.deadline:
                self.stopped = "deadline"
                raise DeadlineExceededError(_LATE if self.stream is not None else _WAITED)
            if self.stream is None:
                self.stream = self.make()  # planning and the prompt (or the span assembly)
                self._deltas = iter(self.stream)
                self._put("planned", self.stream)
                return True
            try:
                self._put("delta", next(self._deltas))
                return True
            except StopIteration:
                return self._end()
        except Exception as exc:  # noqa: BLE001 - every failure reaches the client as an OpenAI error
            self._put("error", exc if isinstance(exc, ContextKitError) else ContextKitError(f"engine error: {exc}"))
            return self._end()

    def _end(self) -> bool:
        self._deltas = None  # a generator left unfinished is closed with it
        self._put("done")
        return False

    async def next(self) -> tuple[str, object]:
        return await self.queue.get()

    async def next_or_disconnect(self, request, poll_s: float = 0.25) -> tuple[str, object]:
        """The next item; a client that hung up cancels the job (it ends at its next turn)."""
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), poll_s)
            except TimeoutError:
                if await request.is_disconnected():
                    self.cancel.set()
                    return ("done", None)


class EngineThreadWork(Protocol):
    """What the engine thread does besides requests (serve: set its torch threads, compile the spans
    requests computed in context). Both run on the engine thread, so they may use the engine."""

    def start_engine_thread(self) -> None:
        """Runs first, once, on the engine thread."""

    def background_unit(self) -> bool:
        """One bounded unit of background work, run while no request is queued or running; True if it
        did any (the next unit then waits for the next quiet turn), False when there is none left."""


class EngineThreadScheduler:
    """Schedules requests onto the built-in engine's one thread, turn by turn, fairly between key tenants.

    ``submit`` hands it a job from any thread; ``close`` stops it (jobs not yet ended get ``done``).
    ``work`` (optional) starts the thread and fills its quiet time; ``clock`` prices a turn for its tenant
    (a test's fake clock makes turns deterministic)."""

    def __init__(self, work: EngineThreadWork | None = None, max_active: int = 8, idle_after_s: float = 0.05,
                 clock: Callable[[], float] = time.perf_counter):
        self.max_active = max_active
        self._clock = clock
        # background units run once no job has arrived for idle_after_s: a client sending requests back
        # to back never waits behind one
        self.work = work
        self.idle_after_s = idle_after_s
        self._cv = threading.Condition()
        self._inbox: deque[Job] = deque()
        self._closed = False
        # set while the thread is parked: no job queued or running, no background unit left
        self._parked = threading.Event()
        self.served_s: dict[Tenant, float] = {}  # engine seconds of key tenants with jobs (dropped when idle)
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closed:
                raise OverloadedError("the server is shutting down; retry on another replica or shortly")
            self._inbox.append(job)
            self._parked.clear()
            self._cv.notify()

    def wait_until_idle(self, timeout_s: float | None = None) -> bool:
        """Block until the engine thread has nothing left to do: every submitted job ended (the thread
        holds none of them) and no background unit left. False if ``timeout_s`` passed first. For
        drains and tests: an event, where a sleep would guess."""
        return self._parked.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        if self.work is not None:
            self.work.start_engine_thread()
        waiting: dict[Tenant, deque[Job]] = {}  # key tenant -> its jobs not started
        active: dict[Tenant, deque[Job]] = {}  # key tenant -> its jobs started: holding KV
        n_active = 0

        def quiet() -> bool:  # nothing to run and not closing (read under self._cv)
            return not self._inbox and not waiting and not active and not self._closed

        while True:
            if self.work is not None:
                with self._cv:
                    if quiet():
                        self._cv.wait(self.idle_after_s)  # a request arriving meanwhile goes first
                    free = quiet()
                if free and self.work.background_unit():
                    continue  # a unit of background work done: look for jobs again before the next one
            with self._cv:
                while quiet():
                    self._parked.set()  # cleared by the next submit, under the same lock
                    self._cv.wait()
                if self._closed:
                    for job in [*self._inbox, *(j for q in (*waiting.values(), *active.values()) for j in q)]:
                        job.cancel.set()
                        job.step()
                        self._finished(job)
                    self._parked.set()  # nothing left: a drain waiting on it ends
                    return
                while self._inbox:
                    job = self._inbox.popleft()
                    share = job.tenant.key_tenant  # sub-tenants of one key take turns as that key
                    if share not in self.served_s:  # arriving idle: level with the least-served busy tenant
                        self.served_s[share] = min(self.served_s.values(), default=0.0)
                    waiting.setdefault(share, deque()).append(job)
            room = n_active < self.max_active
            ready = [t for t in self.served_s if active.get(t) or (room and waiting.get(t))]
            if not ready:  # every waiting job waits for a place: only started ones can run
                ready = [t for t in self.served_s if active.get(t)]
            tenant = min(ready, key=self.served_s.__getitem__)
            start = room and bool(waiting.get(tenant))
            queue = waiting[tenant] if start else active[tenant]
            job = queue.popleft()
            t0 = self._clock()
            alive = job.step()
            self.served_s[tenant] += self._clock() - t0
            if start:
                n_active += 1
                if not waiting[tenant]:
                    del waiting[tenant]
            if alive:
                active.setdefault(tenant, deque()).append(job)  # the back of its tenant's line
            else:
                n_active -= 1
                self._finished(job)
            if not start and not active[tenant]:
                del active[tenant]
            if tenant not in waiting and tenant not in active:
                del self.served_s[tenant]
            job = queue = None  # a finished job's KV must not wait for the next turn to be freed

    @staticmethod
    def _finished(job: Job) -> None:
        # dropped before the call: a callback closing over its job is a reference cycle, and a cycle
        # keeps the job's KV (tens of MB) until a full garbage collection (RSS climbed by GBs under load)
        done, job.on_done = job.on_done, None
        if done is not None:
            done(job)
