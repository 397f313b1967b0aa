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


class HardFailure(Exception):
    """Raised by a handler to say "this job can never succeed": it is dead-lettered at once.

    Any other exception is transient and retried per the consumer's retry policy (D7).
    """

    __module__ = "jobfence"


class TransactionAborted(JobfenceError):
    """A handler returned normally from a transaction that a database error had aborted (it
    caught the error): PostgreSQL would turn the COMMIT into a ROLLBACK without an error, and
    the job would look done with nothing written. It fails as a transient error instead."""


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


class DeadLetterConflict(JobfenceError):
    """The dead letter is no longer pending_review; ``status`` is its current status."""

    __module__ = "jobfence"

    def __init__(self, dead_letter_id: int, status: str) -> None:
        super().__init__(f"dead letter {dead_letter_id} is {status}, not pending_review")
        self.dead_letter_id = dead_letter_id
        self.status = status
