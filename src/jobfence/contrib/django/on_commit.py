"""``transaction.on_commit`` callbacks of the handlers :class:`~jobfence.contrib.django.
DjangoRunner` runs (docs/django.md).

Django runs a transaction's callbacks inside the exit of its outermost atomic block, just after
the COMMIT: an exception of one would leave the block as if the job had failed, although its
work and fence are committed (retried, or dead-lettered as a ``HardFailure``; in a group, the
group taken for rolled back and the callbacks of the jobs after it never run). So the runner
takes the callbacks out of the block once the handlers are done (:func:`take`) and runs them
itself once the block has committed (:func:`run_after_commit`), each job's by the rules Django
gives a transaction's:

- in the order they were registered, each once; none when the transaction rolled back (or
  the savepoint it was registered in);
- one that raises is logged (ERROR, naming the job and the callback, never a payload value)
  and, unless registered with ``robust=True``, the later callbacks of the same job do not
  run. It does not fail its job, which is committed: acked, neither retried nor
  dead-lettered. In a group, the other jobs' callbacks run all the same.

A callback that leaves Django's connection in a transaction (autocommit turned off, a ``BEGIN``
sent, an atomic block entered and not left) would make the next job's atomic block a savepoint
that never commits: the connection is closed, which rolls back what the callback left open, and
reopened for the next job (:func:`_left_open`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import psycopg
from django.db.backends.base.base import BaseDatabaseWrapper
from psycopg.pq import TransactionStatus

from jobfence.harness import error_class_of, first_line
from jobfence.limits import shown_value
from jobfence.model import JobMeta, job_log_fields
from jobfence.sync import RUNNING_JOB

log = logging.getLogger("jobfence.django")

# jobfence's own frames are left out of the front of a callback's traceback when it is logged.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Registered:
    """A callback a handler registered, with the job whose handler registered it."""

    __slots__ = ("func", "job")

    def __init__(self, func: Callable[[], object], job: JobMeta | None) -> None:
        self.func = func
        self.job = job

    def __call__(self) -> object:
        return self.func()


def registering(wrapper: BaseDatabaseWrapper) -> Callable[..., None]:
    """``wrapper.on_commit`` while a handler runs: Django's, the callback tagged with the job
    whose handler registers it (:data:`jobfence.sync.RUNNING_JOB`)."""
    register = type(wrapper).on_commit

    def on_commit(func: Any, robust: bool = False) -> None:
        if callable(func):  # else Django refuses it, as usual
            func = Registered(func, RUNNING_JOB.get())
        register(wrapper, func, robust)

    return on_commit


def take(wrapper: BaseDatabaseWrapper) -> list[tuple[Callable[[], object], bool]]:
    """Inside the outermost atomic block, once the handlers are done: the callbacks Django would
    run at its commit (those of rolled-back savepoints already dropped), taken out of it, so
    that Django's commit runs none."""
    # Django's entries are (savepoint ids, func, robust) (its stubs miss the third)
    entries: list[tuple[Any, ...]] = list(wrapper.run_on_commit)
    pending = [(entry[1], len(entry) > 2 and bool(entry[2])) for entry in entries]
    wrapper.run_on_commit = []
    return pending


def run_after_commit(
    wrapper: BaseDatabaseWrapper, callbacks: list[tuple[Callable[[], object], bool]]
) -> None:
    """After the commit: each callback once, in order; an exception is logged, never raised
    (the job is committed), and stops its own job's later callbacks unless ``robust``."""
    stopped: list[JobMeta | None] = []
    for index, (func, robust) in enumerate(callbacks):
        job = _job_of(func)
        if any(job is other for other in stopped):
            continue
        try:
            func()
        except BaseException as exc:  # in a worker thread, it stops nothing but this callback
            skipped = 0
            if not robust:
                stopped.append(job)
                skipped = sum(1 for later, _ in callbacks[index + 1 :] if _job_of(later) is job)
            _log_failure(job, func, exc, skipped)
        _left_open(wrapper, job, func)


def callback_name(func: object) -> str:
    """``module.qualname`` of a callback (of the function a ``functools.partial`` wraps), never
    its ``repr``, which would show the arguments it was given."""
    while isinstance(func, (Registered, functools.partial)):
        func = func.func
    name = getattr(func, "__qualname__", None)
    if not isinstance(name, str):
        name = type(func).__qualname__
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if isinstance(module, str) else name


def _job_of(func: object) -> JobMeta | None:
    return func.job if isinstance(func, Registered) else None


def _whose(job: JobMeta | None) -> str:
    if job is None:
        return "a job"
    return f"job {shown_value(job.job_id)} for {shown_value(job.consumer)}"


def _fields(job: JobMeta | None, func: object, **more: object) -> dict[str, object]:
    fields: dict[str, object] = {"callback": callback_name(func)}
    if job is not None:
        fields.update(job_log_fields(job))
    fields.update(more)
    return fields


def _log_failure(job: JobMeta | None, func: object, exc: BaseException, skipped: int) -> None:
    error_class = error_class_of(exc)
    text = first_line(exc)
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:  # from the callback's own frame
        if not tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR + os.sep):
            break
        tb = tb.tb_next
    exc = exc.with_traceback(tb)
    after = f"; the {skipped} callback(s) it registered after this one did not run" * bool(skipped)
    log.error(
        "%s: its transaction.on_commit callback %s raised %s%s after the job committed; the"
        " job is done (its work and fence are committed: acked, not retried)%s",
        _whose(job),
        callback_name(func),
        error_class,
        f" ({text})" if text else "",
        after,
        exc_info=exc,
        extra=_fields(job, func, error_class=error_class),
    )


def _left_open(wrapper: BaseDatabaseWrapper, job: JobMeta | None, func: object) -> None:
    """After a callback: when it left Django's connection in a transaction, close the
    connection (the server rolls back what the callback left uncommitted) and reset Django's
    record of it, so that the next job's atomic block begins, and commits, a transaction."""
    raw = wrapper.connection
    if raw is None:
        return
    in_transaction = (
        isinstance(raw, psycopg.Connection)
        and not raw.closed
        and raw.info.transaction_status != TransactionStatus.IDLE
    )
    if not (wrapper.in_atomic_block or not wrapper.autocommit or in_transaction):
        return
    log.warning(
        "%s: its transaction.on_commit callback %s left Django's connection in a transaction"
        " (autocommit turned off, a BEGIN, or an atomic block not left); closing the"
        " connection, which rolls back what the callback did not commit, so that the next job"
        " commits in a transaction of its own",
        _whose(job),
        callback_name(func),
        extra=_fields(job, func),
    )
    wrapper.in_atomic_block = False
    wrapper.savepoint_ids = []
    wrapper.atomic_blocks = []
    wrapper.needs_rollback = False
    wrapper.commit_on_exit = True
    wrapper.closed_in_transaction = False
    wrapper.run_on_commit = []
    with contextlib.suppress(Exception):  # closing a broken connection: it is gone all the same
        wrapper.close()
    wrapper.connection = None
