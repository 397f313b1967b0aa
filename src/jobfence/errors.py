"""The exceptions jobfence raises, and the one a handler raises to signal a hard failure."""

from __future__ import annotations


class JobfenceError(Exception):
    """Base class of jobfence's own errors."""

    __module__ = "jobfence"


class ConfigError(JobfenceError):
    """Configuration that cannot work: the message says what and how to fix it."""

    __module__ = "jobfence"


class DatabaseUnavailable(JobfenceError):
    """The database cannot be reached (wrong address, server down, bad credentials)."""

    __module__ = "jobfence"


class QueueUnavailable(JobfenceError):
    """The queue's broker cannot be reached: its connection was lost or refused, or a call timed
    out. A broker ``QueuePort`` adapter raises it (the client's own error is its ``__cause__``);
    the worker then pauses and reconnects as for a database outage (D7), instead of counting the
    job's attempt as an error inside jobfence."""

    __module__ = "jobfence"


class PublishRefused(JobfenceError):
    """The broker refuses this one message for good (it is over the broker's size limit, for
    example): publishing it again would fail the same way. A queue adapter raises it from
    ``publish`` and ``publish_many`` for that message only; the outbox relay turns the message
    into a dead letter of error class ``PublishRefused`` (with its alert), replayable once the
    cause is fixed, and goes on with the others."""

    __module__ = "jobfence"


class JobRefused(JobfenceError, ValueError):
    """A job refused at enqueue, before any SQL ran: an identifier breaks a limit, the payload
    holds what PostgreSQL cannot store or is over 64 MiB, or the delay is not a finite number of
    seconds within its limit; or by the enqueue statement itself, which then writes nothing and
    raises nothing in the database: the payload is over the largest message the external
    queue's broker accepts (recorded by the outbox relay, e.g. NATS's ``max_payload``).
    ``field`` names the offender (``job_id``, ``tenant_id``, ``correlation_id``, ``consumer``,
    ``queue``, ``payload`` or ``delay_seconds``); the message says what is wrong and the limit. The
    caller's transaction is untouched and stays usable."""

    __module__ = "jobfence"

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"job refused: {reason}")
        self.field = field
        self.reason = reason


class HardFailure(Exception):
    """Raised by a handler to say "this job can never succeed": it is dead-lettered at once.

    Any other exception is transient and retried per the consumer's retry policy (D7).
    """

    __module__ = "jobfence"


class TransactionAborted(JobfenceError):
    """A handler returned normally from a transaction that a database error had aborted (it
    caught the error): PostgreSQL would turn the COMMIT into a ROLLBACK without an error, and
    the job would look done with nothing written. It fails as a transient error instead."""

    __module__ = "jobfence"


class HandlerExited(JobfenceError):
    """A handler raised an exception that is not an ``Exception``: ``SystemExit``,
    ``KeyboardInterrupt``, ``GeneratorExit``, or an ``asyncio.CancelledError`` of its own
    (raised while nothing cancelled the worker's task; the worker's own cancellation goes on
    up). The original is its ``__cause__``. It stops nothing but the job: its transaction
    rolls back, fence included, and the job fails with this error like with any other
    (transient: retried, then dead-lettered), while the worker goes on."""

    __module__ = "jobfence"


class TransactionMisuse(JobfenceError, HardFailure):
    """A handler (or its SQLAlchemy session, or Django's ``transaction``) tried to end the work
    transaction itself: ``commit()``, ``rollback()``, ``close()`` or ``set_autocommit()`` on the
    connection jobfence lent it, or a ``COMMIT`` it sent. The fence transaction is committed by
    jobfence, with the handler's work and its fence together. The call is refused before
    anything is sent, and once one was refused the job fails with this error even if the handler
    caught it: the transaction rolls back and the job is dead-lettered at once (a handler that
    does this does it every time)."""

    __module__ = "jobfence"


class PoisonMessage(JobfenceError):
    """A payload that can never be processed: not UTF-8 JSON, or rejected by the schema (D6)."""

    __module__ = "jobfence"

    def __init__(self, reason: str, *, error_class: str = "PoisonMessage") -> None:
        super().__init__(reason)
        self.reason = reason
        self.error_class = error_class


class DeadLetterNotFound(JobfenceError):
    """No dead letter has that id."""

    __module__ = "jobfence"


class QueueMoved(ConfigError):
    """The database's jobs moved to another queue (``jobfence migrate --queue-url``) while this
    process publishes to the one it had adopted: what it was about to publish is refused, and
    nothing of it was written. Restart the process with the queue the database records."""

    __module__ = "jobfence"


class DeadLetterConflict(JobfenceError):
    """The dead letter is no longer pending_review; ``status`` is its current status."""

    __module__ = "jobfence"

    def __init__(self, dead_letter_id: int, status: str) -> None:
        super().__init__(f"dead letter {dead_letter_id} is {status}, not pending_review")
        self.dead_letter_id = dead_letter_id
        self.status = status


class DeadLetterNotReplayable(DeadLetterConflict):
    """The dead letter is pending, but its message can never be fenced (an identifier breaks a
    limit: an ``UnfenceableMessage``): a replay would only dead-letter it again. Or
    (``unreadable``) its stored payload is not what its ``payload_encoding`` says (a row written
    by hand), so there is no message to replay. Nothing was changed; discard it with a reason
    once what it was is recorded."""

    __module__ = "jobfence"

    def __init__(self, dead_letter_id: int, reason: str, *, unreadable: bool = False) -> None:
        why = (
            f"its payload is not what its payload_encoding says ({reason}), so there is no"
            " message to replay"
            if unreadable
            else f"its message can never be fenced ({reason}), so a replay would only"
            " dead-letter it again"
        )
        JobfenceError.__init__(
            self,
            f"dead letter {dead_letter_id} cannot be replayed: {why}; nothing was changed."
            f" Record what it was, then discard it with a reason",
        )
        self.dead_letter_id = dead_letter_id
        self.status = "pending_review"
        self.reason = reason
