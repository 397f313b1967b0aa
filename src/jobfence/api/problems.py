"""Errors as RFC 9457 problem details (``application/problem+json``), every one of them.

The service layer raises jobfence's own exceptions; the handlers here turn each into one
problem with a stable ``type``, so a client can branch on ``type`` and ``status`` and show
``detail`` to a person. Nothing secret goes into a problem: token errors have fixed texts and
unexpected errors say only that something went wrong (the traceback goes to the log).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus

import psycopg
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from psycopg_pool import PoolTimeout
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from jobfence.errors import (
    DeadLetterConflict,
    DeadLetterNotFound,
    DeadLetterNotReplayable,
    QueueMoved,
)
from jobfence.ops import BulkReplayNotFound, BulkTooLarge, InvalidCursor, InvalidRequest

log = logging.getLogger("jobfence.api")

PROBLEM_JSON = "application/problem+json"
_TYPE = "urn:jobfence:problem:"
TYPE_VALIDATION = _TYPE + "validation"
TYPE_NOT_FOUND = _TYPE + "not-found"
TYPE_NOT_PENDING = _TYPE + "not-pending-review"
TYPE_NOT_REPLAYABLE = _TYPE + "not-replayable"
TYPE_BULK_FINISHED = _TYPE + "bulk-replay-finished"
TYPE_BULK_TOO_LARGE = _TYPE + "bulk-too-large"
TYPE_BODY_TOO_LARGE = _TYPE + "body-too-large"
TYPE_UNAUTHORIZED = _TYPE + "unauthorized"
TYPE_FORBIDDEN = _TYPE + "forbidden"
TYPE_UNAVAILABLE = _TYPE + "database-unavailable"
TYPE_CONFLICT = _TYPE + "transaction-conflict"
TYPE_INTERNAL = _TYPE + "internal"
TYPE_QUEUE_MOVED = _TYPE + "queue-moved"
AUTH_REALM = 'Bearer realm="jobfence"'


class Problem(BaseModel):
    """RFC 9457 problem details. ``type`` is ``about:blank`` for plain HTTP errors (unknown
    route, method not allowed) and a ``urn:jobfence:problem:*`` name for jobfence's own."""

    type: str = Field(default="about:blank", examples=[TYPE_NOT_FOUND])
    title: str
    status: int = Field(ge=400, le=599)
    detail: str | None = None
    instance: str | None = Field(default=None, description="the request path")


class ValidationIssue(BaseModel):
    loc: list[str | int] = Field(description="where: body, query or path, then the field")
    msg: str
    type: str


class ValidationProblem(Problem):
    """422: the request does not fit the API (``errors`` lists each field, when known)."""

    errors: list[ValidationIssue] = Field(default_factory=list)


class ConflictProblem(Problem):
    """409: the resource is no longer in the state the request needs."""

    current_status: str = Field(description="the status it has now")


class BulkTooLargeProblem(Problem):
    """422: more dead letters match the bulk replay's filter than ``max_items`` allows."""

    matching: int
    max_items: int


class ProblemResponse(JSONResponse):
    media_type = PROBLEM_JSON


class ProblemError(Exception):
    """Raised by the edge (auth, route checks) to answer with ``problem``."""

    def __init__(self, problem: Problem, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(problem.detail or problem.title)
        self.problem = problem
        self.headers = dict(headers or {})


def _title(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def problem(
    status: int,
    detail: str | None = None,
    *,
    type_: str = "about:blank",
    title: str | None = None,
) -> Problem:
    return Problem(type=type_, title=title or _title(status), status=status, detail=detail)


def respond(
    request: Request, body: Problem, headers: Mapping[str, str] | None = None
) -> ProblemResponse:
    body = body.model_copy(update={"instance": request.url.path})
    return ProblemResponse(
        jsonable_encoder(body, exclude_none=True), status_code=body.status, headers=headers
    )


def unauthorized(detail: str, *, invalid_token: bool) -> ProblemError:
    """401, with the RFC 6750 challenge (``invalid_token`` when a token was sent)."""
    challenge = AUTH_REALM
    if invalid_token:
        challenge += f', error="invalid_token", error_description="{detail}"'
    return ProblemError(
        problem(401, detail, type_=TYPE_UNAUTHORIZED), headers={"WWW-Authenticate": challenge}
    )


def forbidden(permission: str) -> ProblemError:
    return ProblemError(
        problem(403, f"the token lacks the permission {permission}", type_=TYPE_FORBIDDEN),
        headers={"WWW-Authenticate": f'{AUTH_REALM}, error="insufficient_scope"'},
    )


def _issue(error: Mapping[str, object]) -> ValidationIssue:
    loc = error.get("loc", ())
    parts: list[str | int] = []
    if isinstance(loc, tuple | list):
        parts = [part if isinstance(part, int) else str(part) for part in loc]
    return ValidationIssue(
        loc=parts, msg=str(error.get("msg", "")), type=str(error.get("type", ""))
    )


def install(app: FastAPI) -> None:
    """Register the handlers that make every error a problem."""

    @app.exception_handler(ProblemError)
    async def _problem(request: Request, exc: ProblemError) -> ProblemResponse:
        return respond(request, exc.problem, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> ProblemResponse:
        # Only where, what and why: never the input, which could be long or sensitive.
        issues = [_issue(e) for e in exc.errors()]
        fields = ", ".join(".".join(str(p) for p in i.loc) for i in issues) or "the request"
        detail = f"invalid: {fields}"
        if len(issues) == 1:  # say why, as the CLI would
            detail += f": {issues[0].msg}"
        return respond(
            request,
            ValidationProblem(
                type=TYPE_VALIDATION,
                title="Request validation failed",
                status=422,
                detail=detail,
                errors=issues,
            ),
        )

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest) -> ProblemResponse:
        # The shared layer names its own parameters, which are this API's; a cursor is worded
        # for a client of this API (the CLI words each for its flags).
        detail = (
            "cursor is not one this API returned" if isinstance(exc, InvalidCursor) else str(exc)
        )
        return respond(
            request,
            ValidationProblem(
                type=TYPE_VALIDATION, title="Request validation failed", status=422, detail=detail
            ),
        )

    @app.exception_handler(BulkReplayNotFound)
    @app.exception_handler(DeadLetterNotFound)
    async def _not_found(
        request: Request, exc: DeadLetterNotFound | BulkReplayNotFound
    ) -> ProblemResponse:
        return respond(request, problem(404, str(exc), type_=TYPE_NOT_FOUND))

    @app.exception_handler(DeadLetterConflict)
    async def _conflict(request: Request, exc: DeadLetterConflict) -> ProblemResponse:
        return respond(
            request,
            ConflictProblem(
                type=TYPE_NOT_PENDING,
                title="Dead letter is not pending review",
                status=409,
                detail=str(exc),
                current_status=exc.status,
            ),
        )

    @app.exception_handler(DeadLetterNotReplayable)
    async def _not_replayable(request: Request, exc: DeadLetterNotReplayable) -> ProblemResponse:
        return respond(
            request,
            ConflictProblem(
                type=TYPE_NOT_REPLAYABLE,
                title="Dead letter cannot be replayed",
                status=409,
                detail=str(exc),
                current_status=exc.status,
            ),
        )

    @app.exception_handler(QueueMoved)
    async def _queue_moved(request: Request, exc: QueueMoved) -> ProblemResponse:
        # The database moved to another queue after this service started: nothing was written;
        # the service must be restarted on the queue the database records.
        log.error("%s refused: %s", request.url.path, exc)
        return respond(
            request,
            problem(
                409, str(exc), type_=TYPE_QUEUE_MOVED, title="The database's jobs go elsewhere"
            ),
        )

    @app.exception_handler(BulkTooLarge)
    async def _too_large(request: Request, exc: BulkTooLarge) -> ProblemResponse:
        return respond(
            request,
            BulkTooLargeProblem(
                type=TYPE_BULK_TOO_LARGE,
                title="Too many dead letters match",
                status=422,
                detail=str(exc),
                matching=exc.matching,
                max_items=exc.max_items,
            ),
        )

    @app.exception_handler(psycopg.errors.CheckViolation)
    async def _refused(request: Request, exc: psycopg.errors.CheckViolation) -> ProblemResponse:
        # A value the API let through but a database constraint refuses (whitespace rules
        # differ between locales, say): the request's fault, and nothing was written.
        constraint = exc.diag.constraint_name or "a check constraint"
        return respond(
            request,
            ValidationProblem(
                type=TYPE_VALIDATION,
                title="Request validation failed",
                status=422,
                detail=f"the database refused a value of the request ({constraint})",
            ),
        )

    @app.exception_handler(psycopg.errors.ReadOnlySqlTransaction)
    async def _read_only(
        request: Request, exc: psycopg.errors.ReadOnlySqlTransaction
    ) -> ProblemResponse:
        # A standby, or default_transaction_read_only on: an outage for writing, not a bug.
        # The pool closed the read-only connection when it came back (jobfence.db.open_pool's
        # pools do): the next request is on a new one, writable once the database is.
        log.warning("database read-only for %s: %s", request.url.path, type(exc).__name__)
        return respond(
            request,
            problem(
                503,
                "the database is read-only (a standby, or default_transaction_read_only is on);"
                " try again",
                type_=TYPE_UNAVAILABLE,
            ),
            headers={"Retry-After": "5"},
        )

    @app.exception_handler(PoolTimeout)
    @app.exception_handler(psycopg.OperationalError)
    async def _unavailable(request: Request, exc: Exception) -> ProblemResponse:
        if isinstance(exc, psycopg.Error) and (exc.sqlstate or "").startswith("40"):
            # SQLSTATE class 40 (a serialization failure, a deadlock; psycopg raises each as
            # an OperationalError of its own): the database rolled the request's transaction
            # back for a conflict with another one. Nothing of it was written, and the same
            # request may well work at once: not an outage.
            log.warning("transaction conflict for %s: %s", request.url.path, type(exc).__name__)
            return respond(
                request,
                problem(
                    503,
                    "the database rolled this request back for a conflict with a concurrent"
                    f" transaction ({type(exc).__name__}); nothing was changed: try again",
                    type_=TYPE_CONFLICT,
                ),
                headers={"Retry-After": "1"},
            )
        log.warning("database unavailable for %s: %s", request.url.path, type(exc).__name__)
        return respond(
            request,
            problem(503, "the database cannot be reached; try again", type_=TYPE_UNAVAILABLE),
            headers={"Retry-After": "5"},
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> ProblemResponse:
        detail: str | None = exc.detail if isinstance(exc.detail, str) else None
        if detail == _title(exc.status_code):
            detail = None
        return respond(request, problem(exc.status_code, detail), exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> ProblemResponse:
        # Starlette logs the traceback after this handler answers.
        return respond(
            request,
            problem(500, "an unexpected error occurred; see the server log", type_=TYPE_INTERNAL),
        )
