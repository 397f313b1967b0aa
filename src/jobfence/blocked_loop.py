"""Noticing an event loop that does not run: blocking code in an ``async def`` handler.

A worker runs every ``async def`` handler, and its own fetches, acks and lease extensions, on
one event loop. A handler that calls blocking code (``time.sleep``, ``requests``, a sync
database driver, CPU-heavy work) holds that loop: meanwhile every other job of the worker
stalls, no lease is extended, and nothing else says why.

While a worker runs, a callback on its loop notes the time every ``blocked_loop_seconds / 10``
(at most every 0.1 s), and a daemon thread wakes every ``blocked_loop_seconds / 2`` (at most
every 0.5 s). When the callback has not run for more than ``blocked_loop_seconds``, the thread
logs ONE WARNING for that block: how long the loop has been blocked so far, the job whose async
handler holds it (the handler's frame found on the loop thread's stack: the harness notes the
coroutine of each handler call it makes), and where: the innermost frames of that stack, as
``file:line in function`` only, never a variable's value. When the loop runs again, the callback
logs one INFO line with how long it was blocked in all. Both are counted through a
:class:`~jobfence.ports.LoopMetricsSink` when the worker has one.

One watchdog watches a loop however many workers run on it (the smallest threshold applies);
it stops with the last of them. Its thread never keeps the process alive (a daemon) and never
raises into the worker. A ``def`` handler runs in a worker thread and does not hold the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from inspect import CO_COROUTINE, CO_ITERABLE_COROUTINE
from types import FrameType

from jobfence.errors import ConfigError
from jobfence.limits import shown_value
from jobfence.model import JobMeta, job_log_fields
from jobfence.ports import LoopMetricsSink

log = logging.getLogger("jobfence.blocked_loop")

DEFAULT_BLOCKED_LOOP_SECONDS = 1.0
MIN_BLOCKED_LOOP_SECONDS = 0.1
MAX_BLOCKED_LOOP_SECONDS = 86400.0
# Frames of the loop thread's stack shown in the WARNING, innermost first.
SHOWN_FRAMES = 5

# The async handlers running now (their coroutines, by id) and their jobs. Set and cleared by
# the harness around each handler call, on the event loop's thread; the watchdog's thread reads
# it only when it finds the loop blocked, to tell whose handler frame is on the loop's stack.
RUNNING_HANDLERS: dict[int, tuple[object, JobMeta]] = {}

ADVICE = (
    "blocking code in an async def handler (time.sleep, requests, a sync database driver,"
    " CPU-heavy work) holds the event loop: make it a def handler, which runs in a worker"
    " thread, or use an async library"
)


def checked_blocked_loop_seconds(value: object) -> float:
    """``value`` as ``blocked_loop_seconds``: 0 (off) or a number of seconds from 0.1 to
    86,400; else :class:`~jobfence.errors.ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(
            f"blocked_loop_seconds must be a number of seconds, not {type(value).__name__}"
        )
    seconds = float(value)
    if seconds == 0:
        return 0.0
    if not MIN_BLOCKED_LOOP_SECONDS <= seconds <= MAX_BLOCKED_LOOP_SECONDS:  # NaN fails too
        raise ConfigError(
            f"blocked_loop_seconds must be 0 (off) or a number of seconds from"
            f" {MIN_BLOCKED_LOOP_SECONDS:g} to {MAX_BLOCKED_LOOP_SECONDS:g}, got {value}"
        )
    return seconds


@dataclass(frozen=True, slots=True)
class _Episode:
    """One block of the loop, noticed: the job whose handler held it (None: no handler)."""

    job: JobMeta | None
    seconds: float  # blocked so far when noticed


class Watching:
    """A worker's hold on its loop's watchdog: :meth:`close` lets go (the last one stops it)."""

    def __init__(self, dog: _Watchdog, token: object) -> None:
        self._dog: _Watchdog | None = dog
        self._token = token

    def close(self) -> None:
        dog, self._dog = self._dog, None
        if dog is not None:
            dog.remove(self._token)


_WATCHDOGS: dict[asyncio.AbstractEventLoop, _Watchdog] = {}
_WATCHDOGS_LOCK = threading.Lock()


def watch(seconds: float, metrics: LoopMetricsSink | None = None) -> Watching | None:
    """Watch the running loop for blocks longer than ``seconds`` (0: not at all, None
    returned), until the returned :class:`Watching` is closed. Call it on the loop."""
    if seconds <= 0:
        return None
    loop = asyncio.get_running_loop()
    token = object()
    with _WATCHDOGS_LOCK:
        dog = _WATCHDOGS.get(loop)
        if dog is None:
            dog = _WATCHDOGS[loop] = _Watchdog(loop, _runner_frame(sys._getframe(1)))
        dog.add(token, seconds, metrics)
    return Watching(dog, token)


class _Watchdog:
    """The watchdog of one event loop (see the module's docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, runner: FrameType | None) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._runner = runner  # the loop thread's innermost frame while uvloop waits
        self._watchers: dict[object, tuple[float, LoopMetricsSink | None]] = {}
        self._threshold = DEFAULT_BLOCKED_LOOP_SECONDS
        self._lock = threading.Lock()  # the last beat and the episode, between the two threads
        self._ran = time.monotonic()  # when the loop last ran its beat
        self._episode: _Episode | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, token: object, seconds: float, metrics: LoopMetricsSink | None) -> None:
        self._watchers[token] = (seconds, metrics)
        self._threshold = min(s for s, _ in self._watchers.values())
        if self._thread is None:
            self._beat()
            self._thread = threading.Thread(
                target=self._run, name="jobfence-blocked-loop", daemon=True
            )
            try:
                self._thread.start()
            except RuntimeError as exc:  # no thread to be had: the worker runs all the same
                log.warning(
                    "cannot start the thread that watches the event loop for blocking code"
                    " (%s); the worker runs without it",
                    exc,
                )

    def remove(self, token: object) -> None:
        with _WATCHDOGS_LOCK:
            self._watchers.pop(token, None)
            if self._watchers:
                self._threshold = min(s for s, _ in self._watchers.values())
                return
            if _WATCHDOGS.get(self._loop) is self:
                del _WATCHDOGS[self._loop]
        self._stopped.set()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        with self._lock:
            ended, self._episode = self._episode, None
        if ended is not None:
            self._ended(ended, max(time.monotonic() - self._ran, ended.seconds))

    def _sinks(self) -> list[LoopMetricsSink]:
        sinks: dict[int, LoopMetricsSink] = {}
        for _, metrics in list(self._watchers.values()):
            if metrics is not None:
                sinks.setdefault(id(metrics), metrics)
        return list(sinks.values())

    # On the loop's thread.

    def _beat(self) -> None:
        """The loop ran: note when it should run this again, and end a block noticed."""
        if self._stopped.is_set():
            return
        now = time.monotonic()
        with self._lock:
            blocked, self._ran = now - self._ran, now
            ended, self._episode = self._episode, None
        try:
            self._timer = self._loop.call_later(min(self._threshold / 10, 0.1), self._beat)
        except RuntimeError:  # the loop is closing
            self._timer = None
        if ended is not None:
            self._ended(ended, max(blocked, ended.seconds))

    def _ended(self, episode: _Episode, seconds: float) -> None:
        try:
            log.info(
                "the event loop runs again after being blocked for %.1fs %s",
                seconds,
                _whose(episode.job),
                extra=_fields(episode.job, seconds),
            )
            queue, consumer = _labels(episode.job)
            for sink in self._sinks():
                sink.event_loop_unblocked(queue, consumer, seconds)
        except Exception:
            log.debug("the blocked event loop's end could not be reported", exc_info=True)

    # On the watchdog's thread.

    def _run(self) -> None:
        try:
            while not self._stopped.wait(min(self._threshold / 2, 0.5)):
                self._check()
        except Exception:
            log.exception("internal error watching the event loop for blocking code; it stops")

    def _check(self) -> None:
        with self._lock:  # held while logging: the INFO line that ends the block comes after
            if self._episode is not None or self._stopped.is_set():
                return  # one WARNING per block
            if self._loop.is_closed():
                self._stopped.set()  # closed without its workers letting go: nothing to watch
                return
            if not self._loop.is_running():
                return
            blocked = time.monotonic() - self._ran
            if blocked <= self._threshold:
                return
            frame = sys._current_frames().get(self._loop_thread)
            if frame is None or frame is self._runner or _waiting_for_io(frame):
                return  # not blocked: the whole process was paused, or starved of CPU
            job, where = _inspect(frame)
            del frame
            self._episode = _Episode(job, blocked)
            log.warning(
                "the event loop has been blocked for %.1fs (over %gs) %s, at %s: the worker's"
                " other jobs, its fetches, acks and lease extensions wait until it runs again; %s",
                blocked,
                self._threshold,
                _whose(job),
                where,
                ADVICE,
                extra=_fields(job, blocked),
            )
        queue, consumer = _labels(job)
        for sink in self._sinks():
            try:
                sink.event_loop_blocked(queue, consumer)
            except Exception:
                log.debug("the blocked event loop could not be counted", exc_info=True)


def _runner_frame(frame: FrameType | None) -> FrameType | None:
    """The frame below the coroutines that ``frame`` (a coroutine's, on the loop) is called
    from: the code that runs the loop (``asyncio.Runner.run``, say). A loop written in C
    (uvloop) waits for I/O in C, called from that frame: it is then the loop thread's innermost
    Python frame. None under asyncio's own loop, which waits in :func:`_waiting_for_io`'s
    frame instead (and runs each callback from a frame of its own)."""
    while frame is not None and frame.f_code.co_flags & (CO_COROUTINE | CO_ITERABLE_COROUTINE):
        frame = frame.f_back
    if frame is None or os.path.basename(frame.f_code.co_filename) == "events.py":
        return None  # asyncio's own Handle._run: a frame of one callback's run
    return frame


def _waiting_for_io(frame: FrameType) -> bool:
    """Whether the loop thread is in the selector's wait, idle: not held by any code."""
    code = frame.f_code
    return code.co_name == "select" and os.path.basename(code.co_filename) == "selectors.py"


def _inspect(innermost: FrameType) -> tuple[JobMeta | None, str]:
    """The job whose async handler is on the loop thread's stack (None: none), and the
    innermost frames of that stack down to the handler's own, as ``file:line in function``:
    code positions only, never a variable's value."""
    handlers: dict[object, JobMeta] = {}
    for running, meta in list(RUNNING_HANDLERS.values()):
        frame = getattr(running, "cr_frame", None)  # None once finished, or not a coroutine
        if frame is not None:
            handlers[frame] = meta
    frames: list[FrameType] = []
    job: JobMeta | None = None
    walked: FrameType | None = innermost
    while walked is not None and job is None:
        frames.append(walked)
        job = handlers.get(walked)
        walked = walked.f_back
    del walked, handlers
    if job is None:
        frames = frames[:SHOWN_FRAMES]  # the innermost ones (the rest: the loop's own)
    if len(frames) <= SHOWN_FRAMES:
        shown = [_position(f) for f in frames]
    else:  # the innermost ones, and the handler's own line
        shown = [*(_position(f) for f in frames[: SHOWN_FRAMES - 1]), "...", _position(frames[-1])]
    return job, " <- ".join(shown) or "an unknown place"


def _position(frame: FrameType) -> str:
    code = frame.f_code
    name = getattr(code, "co_qualname", code.co_name)
    return f"{_short_path(code.co_filename)}:{frame.f_lineno} in {name}"


def _short_path(path: str) -> str:
    """``path`` from the import path entry it is under (``myproject/jobs.py``), or whole."""
    best = ""
    for entry in sys.path:
        if entry and path.startswith(entry.rstrip(os.sep) + os.sep) and len(entry) > len(best):
            best = entry
    return path[len(best.rstrip(os.sep)) + 1 :] if best else path


def _whose(job: JobMeta | None) -> str:
    if job is None:
        return "outside any async handler"
    return f"by the async handler of job {shown_value(job.job_id)} for {shown_value(job.consumer)}"


def _labels(job: JobMeta | None) -> tuple[str, str]:
    return ("", "") if job is None else (job.queue, job.consumer)


def _fields(job: JobMeta | None, seconds: float) -> dict[str, object]:
    fields: dict[str, object] = {"blocked_seconds": round(seconds, 3)}
    if job is not None:
        fields.update(job_log_fields(job))
    return fields
