"""The Ops management API: a FastAPI application over :mod:`jobfence.ops`.

Each route parses its request, calls one service function and formats the result; the
problems module turns the service's exceptions into RFC 9457 problems. The pool and the queue
are injected (``create_app(pool=..., queue=..., settings=...)``) and stay the caller's to close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from importlib.resources import files
from typing import Annotated, Any, TypeVar

import psycopg
from fastapi import Body, Depends, FastAPI, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from jobfence import ops
from jobfence.api import problems
from jobfence.api.auth import (
    PERMISSION_DISCARD,
    PERMISSION_READ,
    PERMISSION_REPLAY,
    ApiSettings,
    Authenticate,
    Principal,
    TokenVerifier,
    require,
)
from jobfence.api.limits import MAX_BODY_BYTES, LimitBody
from jobfence.api.problems import (
    PROBLEM_JSON,
    BulkTooLargeProblem,
    ConflictProblem,
    Problem,
    ProblemError,
    ValidationProblem,
)
from jobfence.api.schemas import (
    BulkDryRunOut,
    BulkItemOut,
    BulkItemsOut,
    BulkItemsQuery,
    BulkReplayId,
    BulkReplayOut,
    BulkReplayRequest,
    DeadLetterDetailOut,
    DeadLetterId,
    DeadLetterPageOut,
    DeadLetterQuery,
    DiscardOut,
    DiscardRequest,
    Health,
    ReplayOut,
)
from jobfence.observability import MetricsApp, metrics_registry
from jobfence.ports import QueuePort

log = logging.getLogger("jobfence.api")

T = TypeVar("T")

PREFIX = "/v1/core/dead-letters"


class BulkRunner:
    """Runs bulk replays in background tasks of this process, one task per run at most."""

    def __init__(
        self, pool: AsyncConnectionPool[Any], queue: QueuePort, *, chunk_size: int
    ) -> None:
        self._pool = pool
        self._queue = queue
        self._chunk_size = chunk_size
        self._tasks: dict[int, asyncio.Task[None]] = {}

    def active(self, run_id: int) -> bool:
        task = self._tasks.get(run_id)
        return task is not None and not task.done()

    def start(self, run_id: int, *, actor: str) -> None:
        """Work on ``run_id`` in the background, unless this process already does."""
        if self.active(run_id):
            return
        task = asyncio.create_task(self._run(run_id, actor), name=f"jobfence-bulk-replay-{run_id}")
        self._tasks[run_id] = task

        def forget(done: asyncio.Task[None]) -> None:
            if self._tasks.get(run_id) is done:
                del self._tasks[run_id]

        task.add_done_callback(forget)

    async def _run(self, run_id: int, actor: str) -> None:
        try:
            run = await ops.run_bulk_replay(
                self._pool, self._queue, run_id, actor=actor, chunk_size=self._chunk_size
            )
        except Exception:  # logged at ERROR by ops.run_bulk_replay, with how to resume it
            return
        log.info(
            "bulk replay %d %s: %s",
            run_id,
            run.status,
            ", ".join(f"{k} {v}" for k, v in sorted(run.counts.items())),
        )

    async def close(self) -> None:
        """Stop every run (each stays resumable: a chunk commits whole or not at all)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


@dataclass(frozen=True, slots=True)
class Services:
    pool: AsyncConnectionPool[Any]
    queue: QueuePort
    settings: ApiSettings
    verifier: TokenVerifier
    bulk: BulkRunner
    items: ops.ItemCache


async def _services(request: Request) -> Services:
    # async: a plain def dependency would cost a thread hand-off on every request.
    services: Services = request.app.state.jobfence
    return services


Svc = Annotated[Services, Depends(_services)]
Reader = Annotated[Principal, Depends(require(PERMISSION_READ))]
Replayer = Annotated[Principal, Depends(require(PERMISSION_REPLAY))]
Discarder = Annotated[Principal, Depends(require(PERMISSION_DISCARD))]

_AUTH_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {
        "model": Problem,
        "description": "no token, or a token that is invalid or expired",
        "headers": {
            "WWW-Authenticate": {
                "description": "the bearer challenge (RFC 6750)",
                "schema": {"type": "string"},
            }
        },
    },
    403: {"model": Problem, "description": "the token lacks the permission"},
    422: {"model": ValidationProblem, "description": "the request does not fit the API"},
    503: {"model": Problem, "description": "the database cannot be reached"},
}
_BAD_BODY: dict[int | str, dict[str, Any]] = {
    400: {"model": Problem, "description": "the body cannot be read (not UTF-8 JSON)"},
    413: {"model": Problem, "description": f"the body is over {MAX_BODY_BYTES} bytes"},
}
_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": Problem, "description": "no such id"}}
_NOT_PENDING: dict[int | str, dict[str, Any]] = {
    409: {"model": ConflictProblem, "description": "no longer pending_review (see current_status)"}
}


async def _dead_letter_query(request: Request) -> DeadLetterQuery:
    """The list route's query, validated here as FastAPI would, with the same 422: FastAPI's
    own handling of a query model inspects every field's annotation on every request, about
    10% of a list request's CPU under load (py-spy). The parameters are documented from the
    model all the same (:data:`_LIST_PARAMETERS`)."""
    try:
        return DeadLetterQuery.model_validate(dict(request.query_params))
    except ValidationError as exc:
        raise RequestValidationError(
            [{**error, "loc": ("query", *error["loc"])} for error in exc.errors()]
        ) from None


def _documented_query_parameters() -> list[dict[str, Any]]:
    """The OpenAPI parameters FastAPI generates for ``DeadLetterQuery`` as a route's query."""
    shadow = FastAPI()

    @shadow.get("/")
    async def route(query: Annotated[DeadLetterQuery, Query()]) -> None:
        """Only documented, never served."""

    parameters: list[dict[str, Any]] = shadow.openapi()["paths"]["/"]["get"]["parameters"]
    return parameters


_LIST_PARAMETERS = _documented_query_parameters()


async def _single_valued_query(request: Request) -> None:
    """Every query parameter of this API takes one value: ``?queue=a&queue=b`` is refused
    rather than read as one of them."""
    query = request.query_params
    repeated = sorted({name for name in query if len(query.getlist(name)) > 1})
    if repeated:
        raise RequestValidationError(
            [
                {"type": "repeated", "loc": ("query", name), "msg": "give this parameter once"}
                for name in repeated
            ]
        )


def _location(run_id: int) -> str:
    return f"{PREFIX}/replay-bulk/{run_id}"


def _bulk_out(services: Services, run: ops.BulkReplay) -> BulkReplayOut:
    return BulkReplayOut.of(run, active=services.bulk.active(run.id))


def create_app(
    *,
    pool: AsyncConnectionPool[Any],
    queue: QueuePort,
    settings: ApiSettings,
    metrics: CollectorRegistry | None = None,
) -> FastAPI:
    """The API on ``pool`` (an open autocommit pool, see :func:`jobfence.open_pool`, best
    with ``lend_checked=True``: no request fails on a connection a network blip broke) and
    ``queue`` (where replays publish). Bulk replays still running at shutdown are interrupted
    and stay resumable.

    ``GET /metrics`` (no token, not in the OpenAPI document) serves ``metrics``, by default a
    registry with the database gauges (dead letters pending and the oldest one's age, queue
    depth) and the process's own metrics; the API adds its item cache's (a registry serves
    one app)."""
    bulk = BulkRunner(pool, queue, chunk_size=settings.bulk_chunk_size)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await bulk.close()

    app = FastAPI(
        title="jobfence Ops API",
        version=_version(),
        summary="Find, inspect, replay and discard dead letters.",
        lifespan=lifespan,
        dependencies=[Depends(_single_valued_query)],
        docs_url=None,  # served from the package instead of a CDN: see _docs
        redoc_url=None,
    )
    verifier = TokenVerifier(settings)
    items = ops.ItemCache(settings.item_cache_bytes)
    app.state.jobfence = Services(
        pool=pool, queue=queue, settings=settings, verifier=verifier, bulk=bulk, items=items
    )
    # The last added runs first: the token is checked before the body is counted or read.
    app.add_middleware(LimitBody, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(Authenticate, verifier=verifier, prefix="/v1/")
    registry = metrics if metrics is not None else metrics_registry(pool)
    registry.register(ItemCacheCollector(items))
    app.add_route(
        "/metrics",
        # An ASGI app, which Starlette serves as is (its type hints name only endpoints).
        _Metrics(MetricsApp(registry)),  # type: ignore[arg-type]
        include_in_schema=False,
    )
    problems.install(app)
    _docs(app)
    _routes(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


class _Metrics:
    """``/metrics`` as the API serves it: a method other than GET or HEAD is a 405 problem
    with ``Allow``, as on every other path (the problem handlers answer the exception)."""

    def __init__(self, app: MetricsApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        methods = self.app.METHODS
        if scope["type"] == "http" and scope["method"] not in methods:
            raise StarletteHTTPException(405, headers={"Allow": ", ".join(methods)})
        await self.app(scope, receive, send)


class ItemCacheCollector:
    """The API's list item cache (:class:`jobfence.ops.ItemCache`) for ``/metrics``, read
    without a lock (the scrape runs in a thread): each figure is one attribute read.

    - ``jobfence_api_item_cache_hits_total`` / ``..._misses_total``: list items looked up in
      the cache and found / not found (rendered by PostgreSQL), since the process started;
    - ``jobfence_api_item_cache_bytes``: what it holds, as it counts it (see ``size_bytes``).
    """

    def __init__(self, items: ops.ItemCache) -> None:
        self.items = items

    def describe(self) -> Iterator[Metric]:
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        prefix = "jobfence_api_item_cache"
        yield CounterMetricFamily(
            f"{prefix}_hits", "list items found in the API's cache", value=self.items.hits
        )
        yield CounterMetricFamily(
            f"{prefix}_misses",
            "list items not in the API's cache, rendered by PostgreSQL",
            value=self.items.misses,
        )
        yield GaugeMetricFamily(
            f"{prefix}_bytes", "bytes the API's list item cache holds", value=self.items.size_bytes
        )


# Swagger UI's files, as the fastapi-swagger package ships them: /docs works without internet.
_DOCS_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
}
DOCS_ASSETS = "/docs/assets"


def _docs(app: FastAPI) -> None:
    """``GET /docs``: Swagger UI on the OpenAPI document, every file it loads served by this
    API from the installed package (no CDN, no other host). No token needed."""
    assets = files("fastapi_swagger.resources")
    content = {name: assets.joinpath(name).read_bytes() for name in _DOCS_ASSETS}

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title}: interactive documentation",
            swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon-32x32.png",
            swagger_ui_parameters={"validatorUrl": None},  # no call to an outside validator
        )

    @app.get(DOCS_ASSETS + "/{name}", include_in_schema=False)
    async def swagger_asset(name: str) -> Response:
        if name not in content:
            raise ProblemError(problems.problem(404))
        return Response(
            content[name],
            media_type=_DOCS_ASSETS[name],
            headers={"Cache-Control": "public, max-age=86400"},
        )


def _version() -> str:
    try:
        return version("jobfence")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0"


def _routes(app: FastAPI) -> None:
    @app.get("/healthz", response_model=Health, tags=["health"])
    async def healthz() -> Health:
        """The process is up. Needs no token."""
        return Health()

    @app.get(
        "/readyz",
        response_model=Health,
        tags=["health"],
        responses={503: {"model": Problem, "description": "the database cannot be reached"}},
    )
    async def readyz(services: Svc) -> Health:
        """The database answers. Needs no token."""
        timeout = services.settings.readiness_timeout_seconds
        try:
            async with asyncio.timeout(timeout):
                await _read(services, _select_one, wait=timeout)
        except (TimeoutError, PoolTimeout, psycopg.Error) as exc:
            log.warning("not ready: database unreachable (%s)", type(exc).__name__)
            raise ProblemError(
                problems.problem(
                    503, "the database cannot be reached", type_=problems.TYPE_UNAVAILABLE
                ),
                headers={"Retry-After": "5"},
            ) from None
        return Health()

    @app.get(
        PREFIX,
        response_model=DeadLetterPageOut,
        tags=["dead letters"],
        responses=_AUTH_ERRORS,
        openapi_extra={"parameters": _LIST_PARAMETERS},
    )
    async def list_dead_letters(
        query: Annotated[DeadLetterQuery, Depends(_dead_letter_query)], services: Svc, _: Reader
    ) -> Response:
        """Dead letters matching every filter given, newest first (``created_at``, then
        ``id``). Follow ``next_cursor`` for the next page: rows inserted meanwhile never shift
        a page (keyset pagination)."""
        flt = query.to_filter()

        async def page(conn: psycopg.AsyncConnection[Any]) -> bytes:
            return await ops.list_dead_letters_json(
                conn, flt, limit=query.limit, cursor=query.cursor, items=services.items
            )

        return _json(await _read(services, page))

    @app.post(
        f"{PREFIX}/replay-bulk",
        tags=["bulk replay"],
        status_code=202,
        response_model=BulkReplayOut,
        responses={
            **_AUTH_ERRORS,
            **_BAD_BODY,
            200: {"model": BulkDryRunOut, "description": "dry run: how many match"},
            202: {
                "model": BulkReplayOut,
                "description": "the run, started on its fixed snapshot",
                "headers": {
                    "Location": {"description": "the run's URL", "schema": {"type": "string"}}
                },
            },
            422: {
                "model": ValidationProblem | BulkTooLargeProblem,
                "description": "an invalid request, or more matches than max_items",
            },
        },
    )
    async def start_bulk_replay(
        request: Annotated[BulkReplayRequest, Body()], services: Svc, principal: Replayer
    ) -> Response:
        """Replay every ``pending_review`` dead letter matching the filter **now**: the
        snapshot is fixed at this call, so dead letters written later are never swept in.
        Every pending dead letter, poison included, only with ``"all": true`` and no filter:
        a body without a filter that does not say so is refused (422), and so is one with
        both; nothing changes.
        ``dry_run`` only counts them. The run goes on in the background; follow it at the
        ``Location``. Each item ends ``replayed``, ``already_processed`` (its fence row exists:
        moved to replayed without republishing), ``not_pending`` or ``failed`` (the publish
        failed: the dead letter stays ``pending_review``)."""
        result = await ops.start_bulk_replay(
            services.pool,
            request.to_filter(),
            max_items=request.max_items,
            requested_by=principal.subject,
            dry_run=request.dry_run,
            select_all=request.all,
        )
        if isinstance(result, int):
            out = BulkDryRunOut(
                matching=result,
                max_items=request.max_items,
                exceeds_max_items=result > request.max_items,
            )
            return JSONResponse(out.model_dump(mode="json"), status_code=200)
        services.bulk.start(result.id, actor=principal.subject)
        return JSONResponse(
            _bulk_out(services, result).model_dump(mode="json"),
            status_code=202,
            headers={"Location": _location(result.id)},
        )

    @app.get(
        f"{PREFIX}/replay-bulk/{{run_id}}",
        tags=["bulk replay"],
        response_model=BulkReplayOut,
        responses={**_AUTH_ERRORS, **_NOT_FOUND},
    )
    async def get_bulk_replay(
        run_id: Annotated[BulkReplayId, Path()], services: Svc, _: Reader
    ) -> BulkReplayOut:
        """A bulk replay's progress: its counts by result so far, out of ``total``."""
        run = await _read(services, lambda conn: ops.get_bulk_replay(conn, run_id))
        return _bulk_out(services, run)

    @app.get(
        f"{PREFIX}/replay-bulk/{{run_id}}/items",
        tags=["bulk replay"],
        response_model=BulkItemsOut,
        responses={**_AUTH_ERRORS, **_NOT_FOUND},
    )
    async def list_bulk_items(
        run_id: Annotated[BulkReplayId, Path()],
        query: Annotated[BulkItemsQuery, Query()],
        services: Svc,
        _: Reader,
    ) -> BulkItemsOut:
        """A bulk replay's items in dead letter id order, optionally only one ``result``
        (``pending``: not processed yet)."""

        async def read(conn: psycopg.AsyncConnection[Any]) -> list[ops.BulkItem]:
            await ops.get_bulk_replay(conn, run_id)  # 404 for an unknown run
            return await ops.list_bulk_items(
                conn, run_id, result=query.result, after=query.after, limit=query.limit
            )

        items = await _read(services, read)
        full = len(items) == query.limit
        return BulkItemsOut(
            items=[BulkItemOut.of(item) for item in items],
            next_after=items[-1].dead_letter_id if full else None,
        )

    @app.post(
        f"{PREFIX}/replay-bulk/{{run_id}}/resume",
        tags=["bulk replay"],
        status_code=202,
        response_model=BulkReplayOut,
        responses={
            **_AUTH_ERRORS,
            **_NOT_FOUND,
            202: {
                "model": BulkReplayOut,
                "description": "the run, being worked on",
                "headers": {
                    "Location": {"description": "the run's URL", "schema": {"type": "string"}}
                },
            },
            409: {"model": ConflictProblem, "description": "the run has finished"},
        },
    )
    async def resume_bulk_replay(
        run_id: Annotated[BulkReplayId, Path()],
        services: Svc,
        principal: Replayer,
        response: Response,
    ) -> BulkReplayOut:
        """Go on with an interrupted run's remaining items (a run this process is working on
        already is left as it is). Safe next to another process resuming the same run."""
        async with services.pool.connection() as conn:
            run = await ops.get_bulk_replay(conn, run_id)
        if run.status == "finished":
            raise ProblemError(
                ConflictProblem(
                    type=problems.TYPE_BULK_FINISHED,
                    title="Bulk replay has finished",
                    status=409,
                    detail=f"bulk replay {run_id} has finished: nothing to resume",
                    current_status=run.status,
                )
            )
        services.bulk.start(run_id, actor=principal.subject)
        response.headers["Location"] = _location(run_id)
        return _bulk_out(services, run)

    @app.get(
        f"{PREFIX}/{{id}}",
        tags=["dead letters"],
        response_model=DeadLetterDetailOut,
        responses={**_AUTH_ERRORS, **_NOT_FOUND},
    )
    async def show_dead_letter(
        id: Annotated[DeadLetterId, Path()], services: Svc, _: Reader
    ) -> Response:
        """One dead letter whole, with whether its job's fence row exists."""
        return await _show(services, id)

    @app.post(
        f"{PREFIX}/{{id}}/replay",
        tags=["dead letters"],
        response_model=ReplayOut,
        responses={**_AUTH_ERRORS, **_NOT_FOUND, **_NOT_PENDING},
    )
    async def replay_dead_letter(
        id: Annotated[DeadLetterId, Path()], services: Svc, principal: Replayer
    ) -> ReplayOut:
        """Republish the payload with the same ``job_id`` and ``correlation_id`` to the
        consumer that failed, and mark the dead letter ``replayed`` (by the token's ``sub``).
        A job whose fence row exists is not republished (``already_processed``)."""
        result = await ops.replay(services.pool, services.queue, id, actor=principal.subject)
        return ReplayOut.of(result)

    @app.post(
        f"{PREFIX}/{{id}}/discard",
        tags=["dead letters"],
        response_model=DeadLetterDetailOut | DiscardOut,
        responses={**_AUTH_ERRORS, **_BAD_BODY, **_NOT_FOUND, **_NOT_PENDING},
    )
    async def discard_dead_letter(
        id: Annotated[DeadLetterId, Path()],
        body: Annotated[DiscardRequest, Body()],
        services: Svc,
        principal: Discarder,
    ) -> Response | DiscardOut:
        """Mark the dead letter ``discarded`` with a non-blank reason (at most 2,000
        characters), by the token's ``sub``. The answer is the dead letter as it is now when
        the token may also read dead letters (``core.dead_letters.read``); otherwise what the
        discard did, with the dead letter's identifiers but not its payload or error."""
        letter = await ops.discard(services.pool, id, reason=body.reason, actor=principal.subject)
        if PERMISSION_READ in principal.permissions:
            return await _show(services, id)
        return DiscardOut.of(letter)


async def _show(services: Services, dead_letter_id: int) -> Response:
    return _json(
        await _read(services, lambda conn: ops.show_dead_letter_json(conn, dead_letter_id))
    )


async def _select_one(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute("SELECT 1")


async def _read(
    services: Services,
    read: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]],
    *,
    wait: float | None = None,
) -> T:
    """``read`` (statements that change nothing) on a pooled connection; once more on another
    when the connection turns out lost (its server went away unnoticed, as in a network
    blip). Never for a write: a write lost with its connection may have committed."""
    for attempt in (1, 2):
        lent: psycopg.AsyncConnection[Any] | None = None
        try:
            async with services.pool.connection(timeout=wait) as lent:
                return await read(lent)
        except psycopg.OperationalError:  # PoolTimeout too, with nothing lent
            if attempt == 2 or lent is None or not lent.broken:
                raise
            # Its pool mates are likely as stale: check each (a round trip per idle
            # connection, on this rare path only), so the pool drops the broken ones.
            log.info("a read lost its database connection; checking the pool, then once more")
            await services.pool.check()
    raise AssertionError("unreachable")


def _json(text: str | bytes) -> Response:
    """A body PostgreSQL rendered (see ``ops.list_dead_letters_json``), sent as it is: the
    route's ``response_model`` documents it, and the tests hold the two to each other."""
    return Response(text, media_type="application/json")


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with error bodies under ``application/problem+json``."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title,
        version=app.version,
        summary=app.summary,
        description="Authenticate with `Authorization: Bearer <JWT>`; the permissions are "
        "`core.dead_letters.read`, `core.dead_letters.replay` and `core.dead_letters.discard`. "
        "Every error is an RFC 9457 problem (`application/problem+json`). Times "
        "(`created_from`, `created_to`) are ISO 8601 dates or date-times; one without an "
        "offset, a bare date included, is UTC.",
        routes=app.routes,
    )
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            for parameter in operation.get("parameters", []):
                # An optional query parameter is absent, never null: document its type only.
                options = parameter["schema"].get("anyOf", [])
                if len(options) == 2 and {"type": "null"} in options:
                    [kept] = [option for option in options if option != {"type": "null"}]
                    rest = {k: v for k, v in parameter["schema"].items() if k != "anyOf"}
                    parameter["schema"] = {**kept, **rest}
            for code, response in operation.get("responses", {}).items():
                content = response.get("content", {})
                if code[:1] in "45" and "application/json" in content:
                    content[PROBLEM_JSON] = content.pop("application/json")
    components = schema.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    app.openapi_schema = schema
    return schema
