"""The server's worker: one thread owns the step engine (and through it the devices).

Requests wait in a bounded queue (`max_queue` requests, however many prompts each carries;
full: `QueueFull` at once) and take turns (`FairQueue`: one job of each waiting request in
turn). The worker moves queued requests into the engine as slots free up (when the engine is
idle it first waits `batch_window_s` for more, so a burst is prefilled as one batch), calls
`engine.step()` and posts every event to its request's asyncio queue
(`loop.call_soon_threadsafe`). A request the client gave up on (`cancel`) leaves the queue at
once (its place goes to the next request), or is aborted in the engine, which frees its slot at
once.

`drain()` refuses new requests (`Draining`) and lets queued and running ones finish; `stop()`
drains, lets the worker finish everything, and joins it. `end_all(reason)` answers every
queued and running request with an `ErrorEvent` (unavailable) and aborts them (the end of a
shutdown's grace period). `fail(reason)`, from any thread, is
for an engine that can run no more steps (a lost process of the mesh): every queued and running
request gets an `ErrorEvent` (unavailable) at once, even while the worker thread is stuck in a
device step, new requests get `Unavailable`, and `on_failure(reason)` is called once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from equarx_serve.generation.engine import StepEngine
from equarx_serve.generation.events import ErrorEvent, ErrorKind, Event, FinishedEvent, TokenEvent
from equarx_serve.generation.runner import FatalRunnerError
from equarx_serve.generation.sampling import SamplingParams
from equarx_serve.server.fair_queue import FairQueue

__all__ = ["Draining", "EngineWorker", "Job", "QueueFull", "Unavailable"]

logger = logging.getLogger("equarx_serve.server")

DEFAULT_BATCH_WINDOW_S = 0.005  # a burst of requests sent together lands in one batch


class QueueFull(Exception):
    pass


class Draining(Exception):
    pass


class Unavailable(Exception):
    """The engine failed for good (the reason is the message)."""


@dataclasses.dataclass(eq=False)
class Job:
    """One request on its way through the worker; `events` receives its `Event`s, the last
    one a FinishedEvent or an ErrorEvent. The jobs of one HTTP request (one per prompt) share
    a `group`: they take one place in the queue, and turns with other requests'."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event]
    arrived: float  # time.perf_counter()
    cancelled: bool = False  # the client went away
    done: bool = False  # its last event has been posted
    first_token_at: float | None = None
    group: str = ""  # the request the job belongs to; "" for the job's own request_id

    def __post_init__(self) -> None:
        self.group = self.group or self.request_id

    def post(self, event: Event) -> None:
        """Posts an event (once `done`, nothing more: a failure may race the worker)."""
        if self.done:
            return
        if isinstance(event, FinishedEvent | ErrorEvent):
            self.done = True
        elif self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True


class EngineWorker:
    """The worker thread and its bounded queue (see the module doc)."""

    def __init__(
        self,
        engine: StepEngine,
        *,
        max_queue: int,
        batch_window_s: float = DEFAULT_BATCH_WINDOW_S,
        on_queue_depth: Callable[[int], None] = lambda depth: None,
        on_dequeue: Callable[[Job], None] = lambda job: None,
        on_failure: Callable[[str], None] = lambda reason: None,
    ):
        if max_queue < 1 or batch_window_s < 0:
            raise ValueError(
                f"need max_queue >= 1 and batch_window_s >= 0; got {max_queue}, {batch_window_s}"
            )
        self.engine = engine
        self.batch_window_s = batch_window_s
        self._on_queue_depth = on_queue_depth
        self._on_dequeue = on_dequeue
        self._on_failure = on_failure
        self.max_queue = max_queue
        self._queue: FairQueue[Job] = FairQueue()  # guarded by _ready
        self._ready = threading.Condition()  # a job was queued, or the stop mark was set
        self._stop_requested = False
        self._cancels: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._jobs: dict[str, Job] = {}  # those in the engine
        self._lock = threading.Lock()  # guards _jobs and failure
        self._thread: threading.Thread | None = None
        self._stopping = False  # the stop mark was taken: exit once the engine is empty
        self.draining = False
        self.failure: str | None = None
        self.steps = 0

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        """The jobs (prompts) waiting."""
        return self._queue.items

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="equarx-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queues `job`; Unavailable, Draining or QueueFull (`max_queue` requests already
        waiting, none of them `job`'s own) at once when it cannot be taken."""
        if self.failure is not None:
            raise Unavailable(self.failure)
        if self.draining or not self.alive:
            raise Draining
        with self._ready:
            if len(self._queue) >= self.max_queue and not self._queue.has_group(job.group):
                raise QueueFull
            self._queue.append(job.group, job)
            self._on_queue_depth(self._queue.items)
            self._ready.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: take the job out of the queue, or abort it if running."""
        job.cancelled = True
        with self._ready:
            if self._queue.remove(job.group, job):
                self._on_queue_depth(self._queue.items)
                return
        self._cancels.put(job)

    def end_all(self, reason: str) -> None:
        """Answers every queued and running request with an ErrorEvent (unavailable), and
        aborts the running ones in the engine (the worker goes on)."""
        with self._ready:
            jobs = self._queue.clear()
            self._on_queue_depth(0)
        with self._lock:
            jobs += self._jobs.values()
        if jobs:
            logger.warning("%s: ending %d requests", reason, len(jobs))
        for job in jobs:
            job.post(ErrorEvent(job.request_id, reason, ErrorKind.UNAVAILABLE))
            self.cancel(job)

    def drain(self) -> None:
        """Refuse new requests from now on; queued and running ones still finish."""
        if not self.draining:
            logger.info("draining: new requests get 503, %d queued", self._queue.items)
        self.draining = True

    def stop(self, timeout_s: float | None = None) -> None:
        """Drain, let the worker finish everything queued and running, join it."""
        self.drain()
        if not self.alive:
            return
        with self._ready:
            self._stop_requested = True  # taken after every queued job
            self._ready.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the worker did not finish within %s s", timeout_s)

    def fail(self, reason: str) -> None:
        """The engine can run no more steps: fail every request now (see the module doc)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            jobs = list(self._jobs.values())
        logger.error("the engine failed: %s; failing %d running requests", reason, len(jobs))
        with self._ready:
            jobs += self._queue.clear()
            self._on_queue_depth(0)
        for job in jobs:
            job.post(ErrorEvent(job.request_id, reason, ErrorKind.UNAVAILABLE))
        self._on_failure(reason)

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self.failure is None:
                self._take_jobs()
                self._abort_cancelled()
                if self.engine.has_unfinished:
                    self._deliver(self.engine.step())
                    self.steps += 1
                elif self._stopping:
                    return
        except FatalRunnerError as e:
            self.fail(str(e))
        except Exception as e:  # a bug: nothing can be trusted; fail loudly, not silently
            logger.exception("the worker failed")
            self.fail(f"internal error in the worker: {type(e).__name__}: {e}")

    def _take_jobs(self) -> None:
        """Moves queued jobs into the engine while it has room; when it is idle, blocks for
        the first and waits up to `batch_window_s` for more."""
        idle = not self.engine.has_unfinished
        deadline = None
        with self._ready:
            while self.engine.room > 0 and not self._stopping:
                if not self._queue:
                    if self._stop_requested:
                        self._stopping = True
                        break
                    if not idle:
                        break
                    timeout = None if deadline is None else deadline - time.perf_counter()
                    if timeout is not None and timeout <= 0:
                        break
                    self._ready.wait(timeout)
                    continue
                job = self._queue.popleft()
                if deadline is None:
                    deadline = time.perf_counter() + self.batch_window_s
                self._admit(job)
            self._on_queue_depth(self._queue.items)

    def _admit(self, job: Job) -> None:
        self._on_dequeue(job)
        try:
            self.engine.add_request(job.request_id, job.prompt, job.params, arrived=job.arrived)
        except ValueError as e:
            job.post(ErrorEvent(job.request_id, str(e), ErrorKind.INVALID_REQUEST))
            return
        with self._lock:
            self._jobs[job.request_id] = job

    def _abort_cancelled(self) -> None:
        while True:
            try:
                job = self._cancels.get_nowait()
            except queue.Empty:
                return
            event = self.engine.abort(job.request_id)
            if event is not None:
                logger.info("%s: cancelled in the engine", job.request_id)
                self._deliver([event])

    def _deliver(self, events: list[Event]) -> None:
        for event in events:
            with self._lock:
                job = self._jobs.get(event.request_id)
                if job is not None and not isinstance(event, TokenEvent):
                    del self._jobs[event.request_id]
            if job is not None:
                job.post(event)
