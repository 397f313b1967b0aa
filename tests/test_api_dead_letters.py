"""The Ops API's dead letter routes over real HTTP: acceptance 5 and 7 through the API,
replay and discard races, keyset pagination under inserts, filters, problems and health.

Each test runs uvicorn on a loopback port over its own fresh database (``test_api_support``).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

import pointsapp
from jobfence import App, HardFailure, JobMeta, MemoryQueue, PgQueue, PrometheusMetrics, Worker
from jobfence.api import PERMISSION_READ, ApiSettings
from jobfence.api.schemas import DeadLetterQuery
from support import run_jobfence, scalar
from test_api_support import (
    PREFIX,
    SECRET,
    Api,
    assert_problem,
    auth,
    dead_letter_row,
    insert_dead_letter,
    queued_job_ids,
    running_api,
)


@pytest.fixture
async def api(pool: AsyncConnectionPool[Any]) -> AsyncIterator[Api]:
    async with running_api(pool) as running:
        yield running


async def count(conn: AsyncConnection[Any], query: str, params: Any = None) -> int:
    return int(await scalar(conn, query, params))


# -- Acceptance 5 through the API ---------------------------------------------------------------


async def test_acceptance_5_dead_letter_replayed_through_the_api_is_processed_with_one_effect(
    pool: AsyncConnectionPool[Any], points: AsyncConnection[Any]
) -> None:
    """A real worker dead-letters the job; the bug is fixed; an operator replays it over HTTP;
    a worker processes it: one effect. Replaying again is 409, and the provider delivering the
    same job_id once more is absorbed by the fence: still one effect."""
    broken = {"yes": True}

    async def award(payload: pointsapp.Award, job: JobMeta, tx: AsyncConnection[Any]) -> None:
        await pointsapp.apply_award(payload, job, tx)
        if broken["yes"]:
            raise HardFailure("ledger rejected the account")

    app = App()
    app.consumer("award_points", queue=pointsapp.QUEUE, schema=pointsapp.Award)(award)
    metrics = PrometheusMetrics()
    queue = PgQueue(pool, poll_interval_seconds=0.05)

    async def drain() -> None:
        worker = Worker(app, pool, queue, metrics=metrics, poll_seconds=0.05)
        await asyncio.wait_for(worker.run(until="idle"), timeout=20)

    async def awards() -> int:
        return await count(points, "SELECT count(*) FROM public.awards WHERE job_id = 'a5'")

    try:
        async with running_api(pool, queue=queue) as api:
            await app.enqueue(
                points,
                "award_points",
                {"account_id": 3, "points": 21},
                job_id="a5",
                correlation_id="corr-a5",
                tenant_id="t-a5",
            )
            await drain()
            assert await awards() == 0  # the failed work rolled back

            listed = await api.client.get(
                PREFIX, params={"job_id": "a5", "status": "pending_review"}, headers=auth()
            )
            assert listed.status_code == 200, listed.text
            [item] = listed.json()["items"]
            assert (item["attempts"], item["error_class"]) == (1, "jobfence.HardFailure")
            assert item["payload"] == {"account_id": 3, "points": 21, "mode": "ok"}
            dl_id = item["id"]

            broken["yes"] = False  # the bug is fixed
            replayed = await api.client.post(
                f"{PREFIX}/{dl_id}/replay", headers=auth(sub="operator-1")
            )
            assert replayed.status_code == 200, replayed.text
            assert replayed.json() == {
                "dead_letter_id": dl_id,
                "status": "replayed",
                "published": True,
                "already_processed": False,
                "job_id": "a5",
                "queue": pointsapp.QUEUE,
                "consumer": "award_points",
                "tenant_id": "t-a5",
                "correlation_id": "corr-a5",
            }
            assert await queued_job_ids(points) == ["a5"]
            await drain()
            assert await awards() == 1

            again = await api.client.post(f"{PREFIX}/{dl_id}/replay", headers=auth())
            assert_problem(again, 409, current_status="replayed")
            assert await queued_job_ids(points) == []

            # The provider delivers the same job_id once more: the fence absorbs it.
            await app.enqueue(points, "award_points", {"account_id": 3, "points": 21}, job_id="a5")
            await drain()

            detail = (await api.client.get(f"{PREFIX}/{dl_id}", headers=auth())).json()
            # resolved_by is the token's sub
            assert (detail["status"], detail["resolved_by"]) == ("replayed", "operator-1")
            assert detail["fence_exists"] is True
    finally:
        await queue.close()

    assert await awards() == 1
    assert await count(points, "SELECT points FROM public.accounts WHERE id = 3") == 21
    assert await count(points, "SELECT count(*) FROM core.dead_letters") == 1
    assert metrics.count("succeeded") == 1
    assert metrics.count("duplicate") == 1


# -- Acceptance 7 through the API ---------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({}, id="missing"),
        pytest.param({"reason": None}, id="null"),
        pytest.param({"reason": ""}, id="empty"),
        pytest.param({"reason": "  \t\n "}, id="blank"),
        pytest.param({"reason": "\u2003\u00a0"}, id="unicode-blank"),
        pytest.param({"reason": "x" * 2001}, id="overlong"),
        pytest.param({"reason": "nul \x00 inside"}, id="nul"),
        pytest.param({"reason": 42}, id="not-a-string"),
        pytest.param({"reason": "ok", "extra": 1}, id="unknown-field"),
    ],
)
async def test_acceptance_7_discard_without_a_valid_reason_is_422_and_the_row_is_unchanged(
    api: Api, conn: AsyncConnection[Any], body: dict[str, Any]
) -> None:
    dl_id = await insert_dead_letter(conn, job_id="a7")
    before = await dead_letter_row(conn, dl_id)

    response = await api.client.post(f"{PREFIX}/{dl_id}/discard", json=body, headers=auth())

    problem = assert_problem(response, 422, type="urn:jobfence:problem:validation")
    assert problem["errors"], problem
    assert all(error["loc"][0] == "body" for error in problem["errors"])
    assert await dead_letter_row(conn, dl_id) == before
    assert before["status"] == "pending_review"


@pytest.mark.parametrize(
    ("reason", "says"),
    [
        ("", "a discard requires a non-blank reason"),
        (" \t\n\u2003", "a discard requires a non-blank reason"),
        ("x" * 2001, "a discard reason is at most 2000 characters"),
    ],
    ids=["empty", "blank", "overlong"],
)
async def test_a_refused_discard_reason_says_what_the_cli_says_never_a_pattern(
    api: Api, conn: AsyncConnection[Any], database_url: str, reason: str, says: str
) -> None:
    dl_id = await insert_dead_letter(conn, job_id="plain")
    before = await dead_letter_row(conn, dl_id)

    response = await api.client.post(
        f"{PREFIX}/{dl_id}/discard", json={"reason": reason}, headers=auth()
    )

    problem = assert_problem(response, 422, type="urn:jobfence:problem:validation")
    assert problem["detail"] == f"invalid: body.reason: {says}"
    assert [error["msg"] for error in problem["errors"]] == [says]
    assert "pattern" not in response.text and "^" not in response.text
    assert await dead_letter_row(conn, dl_id) == before
    done = await asyncio.to_thread(
        run_jobfence,
        database_url,
        "dead-letters",
        "discard",
        str(dl_id),
        "--reason",
        reason,
        "--actor",
        "carol",
    )
    assert done.returncode == 2
    assert done.stderr == f"jobfence: error: {says}\n"
    assert await dead_letter_row(conn, dl_id) == before


async def test_discard_body_that_is_not_json_is_422_problem(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    dl_id = await insert_dead_letter(conn, job_id="a7-raw")
    response = await api.client.post(
        f"{PREFIX}/{dl_id}/discard",
        content=b'{"reason": ',
        headers={**auth(), "Content-Type": "application/json"},
    )
    assert_problem(response, 422)
    assert (await dead_letter_row(conn, dl_id))["status"] == "pending_review"


async def test_discard_with_a_reason_records_it_and_the_subject_then_both_actions_are_409(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    dl_id = await insert_dead_letter(conn, job_id="d1")
    reason = "order 991 was refunded by hand " + "é" * 1969  # 2,000 characters: the maximum
    assert len(reason) == 2000

    response = await api.client.post(
        f"{PREFIX}/{dl_id}/discard", json={"reason": reason}, headers=auth(sub="bob")
    )

    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "discarded"
    assert body["discard_reason"] == reason
    assert body["resolved_by"] == "bob"
    assert body["resolved_at"] is not None
    row = await dead_letter_row(conn, dl_id)
    assert (row["status"], row["discard_reason"], row["resolved_by"]) == (
        "discarded",
        reason,
        "bob",
    )
    for action, payload in (("discard", {"reason": "again"}), ("replay", None)):
        again = await api.client.post(f"{PREFIX}/{dl_id}/{action}", json=payload, headers=auth())
        problem = assert_problem(again, 409, current_status="discarded")
        assert problem["type"] == "urn:jobfence:problem:not-pending-review"
    assert await queued_job_ids(conn) == []


@pytest.mark.parametrize(
    ("method", "suffix", "body"),
    [
        ("GET", "", None),
        ("POST", "/replay", None),
        ("POST", "/discard", {"reason": "nobody needs it"}),
    ],
)
async def test_unknown_dead_letter_id_is_404_problem(
    api: Api, method: str, suffix: str, body: dict[str, str] | None
) -> None:
    response = await api.client.request(
        method, f"{PREFIX}/987654{suffix}", json=body, headers=auth()
    )
    problem = assert_problem(response, 404, type="urn:jobfence:problem:not-found")
    assert "987654" in problem["detail"]


@pytest.mark.parametrize("bad_id", ["0", "-3", "abc", "1.5", str(2**63)])
async def test_dead_letter_id_that_is_not_a_positive_bigint_is_422_problem(
    api: Api, bad_id: str
) -> None:
    response = await api.client.get(f"{PREFIX}/{bad_id}", headers=auth())
    problem = assert_problem(response, 422)
    assert problem["errors"][0]["loc"] == ["path", "id"]


async def test_show_returns_the_whole_payload_which_the_list_summarises_and_the_fence_flag(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    big = {"lines": [f"line {i}: " + "x" * 60 for i in range(100)]}
    big_id = await insert_dead_letter(conn, job_id="big", payload=big, correlation_id="c-big")
    small_id = await insert_dead_letter(conn, job_id="small", payload={"a": 1})
    await conn.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, expires_at)"
        " VALUES ('small', 'award_points', now() + interval '1 day')"
    )

    listed = await api.client.get(PREFIX, headers=auth(PERMISSION_READ))
    assert listed.status_code == 200
    items = {item["id"]: item for item in listed.json()["items"]}
    assert items[big_id]["payload"] is None
    assert items[big_id]["payload_truncated"] is True
    assert items[big_id]["payload_size"] > 4096
    assert items[big_id]["payload_summary"].startswith('{"lines": ["line 0: ')
    assert len(items[big_id]["payload_summary"]) == 512
    assert items[small_id]["payload"] == {"a": 1}
    assert items[small_id]["payload_truncated"] is False
    assert items[small_id]["payload_summary"] is None

    shown = (await api.client.get(f"{PREFIX}/{big_id}", headers=auth(PERMISSION_READ))).json()
    assert shown["payload"] == big
    assert shown["correlation_id"] == "c-big"
    assert shown["fence_exists"] is False
    assert shown["attempts"] == 6
    small = (await api.client.get(f"{PREFIX}/{small_id}", headers=auth())).json()
    assert small["fence_exists"] is True


async def test_replay_of_a_job_whose_fence_exists_publishes_nothing_and_says_so(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    dl_id = await insert_dead_letter(conn, job_id="fenced", correlation_id="c-f")
    await conn.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, expires_at)"
        " VALUES ('fenced', 'award_points', now() + interval '1 day')"
    )
    response = await api.client.post(f"{PREFIX}/{dl_id}/replay", headers=auth())
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["published"], body["already_processed"]) == (False, True)
    assert body["job_id"] == "fenced"
    assert await queued_job_ids(conn) == []
    assert (await dead_letter_row(conn, dl_id))["status"] == "replayed"


# -- Races --------------------------------------------------------------------------------------


async def test_concurrent_replay_and_discard_of_one_dead_letter_exactly_one_wins(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    """40 rounds of a replay and a discard of the same dead letter sent at once over HTTP
    (in both orders): one is 200, the other 409 naming the winner's status, and the row and
    the queue agree with the winner."""
    rng = random.Random(7)
    wins = {"replayed": 0, "discarded": 0}
    for round_no in range(40):
        dl_id = await insert_dead_letter(conn, job_id=f"race-{round_no}")
        requests = [
            api.client.post(f"{PREFIX}/{dl_id}/replay", headers=auth(sub="r")),
            api.client.post(
                f"{PREFIX}/{dl_id}/discard", json={"reason": "duplicate"}, headers=auth(sub="d")
            ),
        ]
        if rng.random() < 0.5:
            requests.reverse()
        replay, discard = sorted(
            await asyncio.gather(*requests), key=lambda r: not r.request.url.path.endswith("replay")
        )
        statuses = sorted([replay.status_code, discard.status_code])
        assert statuses == [200, 409], (replay.text, discard.text)
        winner = "replayed" if replay.status_code == 200 else "discarded"
        loser = discard if winner == "replayed" else replay
        assert_problem(loser, 409, current_status=winner)
        row = await dead_letter_row(conn, dl_id)
        assert row["status"] == winner
        assert row["resolved_by"] == ("r" if winner == "replayed" else "d")
        wins[winner] += 1
        assert len(await queued_job_ids(conn)) == wins["replayed"]
    assert await count(conn, "SELECT count(*) FROM core.dead_letters") == 40


async def test_concurrent_replays_of_one_dead_letter_publish_once(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    for round_no in range(10):
        dl_id = await insert_dead_letter(conn, job_id=f"twice-{round_no}")
        responses = await asyncio.gather(
            *(api.client.post(f"{PREFIX}/{dl_id}/replay", headers=auth()) for _ in range(4))
        )
        assert sorted(r.status_code for r in responses) == [200, 409, 409, 409]
    assert sorted(await queued_job_ids(conn)) == sorted(f"twice-{i}" for i in range(10))


# -- Listing ------------------------------------------------------------------------------------


async def test_pagination_is_newest_first_and_stable_under_inserts_between_pages(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    """60 dead letters, three per timestamp (the id breaks ties), inserted in random order;
    pages of 7. Before every page, new dead letters arrive: newer than all, inside the range
    already read and inside the range still to read. Every original is seen once, in order;
    no id is ever repeated."""
    rng = random.Random(11)
    base = datetime.now(UTC) - timedelta(hours=1)
    seeds = [(f"orig-{i}", base + timedelta(seconds=i // 3)) for i in range(60)]
    rng.shuffle(seeds)
    originals: dict[int, datetime] = {}
    for job_id, created in seeds:
        originals[await insert_dead_letter(conn, job_id=job_id, created_at=created)] = created
    expected = sorted(originals, key=lambda i: (originals[i], i), reverse=True)

    seen: list[int] = []
    cursor: str | None = None
    pages = 0
    extra = 0
    while True:
        for when in (
            datetime.now(UTC),
            base + timedelta(seconds=rng.uniform(0, 20)),
            base + timedelta(seconds=rng.uniform(-5, 5)),
        ):
            extra += 1
            await insert_dead_letter(conn, job_id=f"new-{extra}", created_at=when)
        params: dict[str, Any] = {"limit": 7}
        if cursor:
            params["cursor"] = cursor
        response = await api.client.get(PREFIX, params=params, headers=auth())
        assert response.status_code == 200, response.text
        page = response.json()
        assert len(page["items"]) <= 7
        keys = [(item["created_at"], item["id"]) for item in page["items"]]
        assert keys == sorted(keys, reverse=True)  # newest first within the page
        seen.extend(item["id"] for item in page["items"])
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
        assert pages < 100

    assert len(seen) == len(set(seen)), "an item was repeated"
    assert [i for i in seen if i in originals] == expected
    assert pages >= 9


async def test_list_filters_each_select_exactly_their_rows(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    now = datetime.now(UTC)
    rows = [
        dict(job_id="j1", queue="q1", consumer="c1", tenant_id="t1", error_class="E1",
             correlation_id="k1", created_at=now - timedelta(days=3)),
        dict(job_id="j2", queue="q1", consumer="c2", tenant_id="t2", error_class="E2",
             correlation_id="k2", created_at=now - timedelta(days=2)),
        dict(job_id="j3", queue="q2", consumer="c1", tenant_id=None, error_class="E1",
             correlation_id=None, created_at=now - timedelta(days=1)),
        dict(job_id="j4", queue="q2", consumer="c2", tenant_id="t1", error_class="E2",
             correlation_id="k1", created_at=now),
    ]  # fmt: skip
    ids = {row["job_id"]: await insert_dead_letter(conn, **row) for row in rows}
    await api.client.post(f"{PREFIX}/{ids['j2']}/replay", headers=auth())
    await api.client.post(f"{PREFIX}/{ids['j3']}/discard", json={"reason": "r"}, headers=auth())

    cases: list[tuple[dict[str, str], list[str]]] = [
        ({}, ["j4", "j3", "j2", "j1"]),
        ({"status": "pending_review"}, ["j4", "j1"]),
        ({"status": "replayed"}, ["j2"]),
        ({"status": "discarded"}, ["j3"]),
        ({"queue": "q1"}, ["j2", "j1"]),
        ({"consumer": "c2"}, ["j4", "j2"]),
        ({"tenant_id": "t1"}, ["j4", "j1"]),
        ({"error_class": "E1"}, ["j3", "j1"]),
        ({"job_id": "j3"}, ["j3"]),
        ({"correlation_id": "k1"}, ["j4", "j1"]),
        ({"created_from": (now - timedelta(days=2)).isoformat()}, ["j4", "j3", "j2"]),
        ({"created_to": (now - timedelta(days=1)).isoformat()}, ["j2", "j1"]),
        (
            {
                "created_from": (now - timedelta(days=2, hours=1)).isoformat(),
                "created_to": now.isoformat(),
            },
            ["j3", "j2"],
        ),
        ({"queue": "q2", "consumer": "c1", "status": "discarded"}, ["j3"]),
        ({"queue": "nope"}, []),
    ]
    for params, expected in cases:
        response = await api.client.get(PREFIX, params=params, headers=auth())
        assert response.status_code == 200, (params, response.text)
        got = [item["job_id"] for item in response.json()["items"]]
        assert got == expected, params


@pytest.mark.parametrize(
    ("since", "until"),
    [
        ("2026-01-01", "2026-01-02"),
        ("2026-01-01T00:00:00", "2026-01-02T00:00"),
        ("2026-01-01T01:00:00+01:00", "2026-01-02T00:00:00Z"),
    ],
    ids=["dates", "naive-date-times", "with-offsets"],
)
async def test_a_time_without_an_offset_is_utc_in_the_api_and_the_cli_alike(
    api: Api, conn: AsyncConnection[Any], database_url: str, since: str, until: str
) -> None:
    def at(text: str) -> datetime:
        return datetime.fromisoformat(text).replace(tzinfo=UTC)

    for job_id, created in (
        ("before", "2025-12-31T23:59:59"),
        ("first", "2026-01-01T00:00:00"),
        ("later", "2026-01-01T23:59:59"),
        ("after", "2026-01-02T00:00:00"),
    ):
        await insert_dead_letter(conn, job_id=job_id, created_at=at(created))

    listed = await api.client.get(
        PREFIX, params={"created_from": since, "created_to": until}, headers=auth()
    )
    assert listed.status_code == 200, listed.text
    done = await asyncio.to_thread(
        run_jobfence,
        database_url,
        "dead-letters",
        "list",
        "--since",
        since,
        "--until",
        until,
        "--json",
    )
    assert done.returncode == 0, done.stderr
    by_cli = [item["job_id"] for item in json.loads(done.stdout)["items"]]
    assert [item["job_id"] for item in listed.json()["items"]] == by_cli == ["later", "first"]


async def test_a_garbage_time_is_refused_with_the_same_plain_message_in_the_api_and_the_cli(
    api: Api, conn: AsyncConnection[Any], database_url: str
) -> None:
    await insert_dead_letter(conn, job_id="kept")
    says = "not an ISO 8601 date or time (e.g. 2026-05-01 or 2026-05-01T12:00:00Z; without an"
    listed = await api.client.get(PREFIX, params={"created_from": "2026-13-01"}, headers=auth())
    problem = assert_problem(listed, 422, type="urn:jobfence:problem:validation")
    [issue] = problem["errors"]
    assert issue["loc"] == ["query", "created_from"]
    assert issue["msg"].startswith(says), issue
    assert "2026-13-01" not in listed.text  # never the value sent
    done = await asyncio.to_thread(
        run_jobfence, database_url, "dead-letters", "list", "--since", "2026-13-01"
    )
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith("jobfence: error: ") and says in line, line
    assert await count(conn, "SELECT count(*) FROM core.dead_letters") == 1


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "501"}, "limit"),
        ({"status": "lost"}, "status"),
        ({"cursor": "not-a-cursor"}, None),
        ({"cursor": "W10"}, None),  # base64 of []
        ({"created_from": "2026-01-32"}, "created_from"),
        ({"created_from": "1700000000"}, "created_from"),  # Unix time is not a date-time
        ({"created_from": "2026-02-01T00:00:00Z", "created_to": "2026-01-01T00:00:00Z"}, None),
        ({"queue": "a\x00b"}, "queue"),
        ({"queue": "q" * 1001}, "queue"),
        ({"qeueu": "typo"}, "qeueu"),
    ],
)
async def test_list_refuses_bad_parameters_with_a_422_problem(
    api: Api, params: dict[str, str], field: str | None
) -> None:
    response = await api.client.get(PREFIX, params=params, headers=auth())
    problem = assert_problem(response, 422, type="urn:jobfence:problem:validation")
    if field is not None:
        assert ["query", field] in [error["loc"] for error in problem["errors"]], problem


async def test_a_bad_cursor_is_refused_in_this_apis_words(api: Api) -> None:
    response = await api.client.get(PREFIX, params={"cursor": "bogus"}, headers=auth())
    problem = assert_problem(response, 422, type="urn:jobfence:problem:validation")
    assert problem["detail"] == "cursor is not one this API returned"


async def test_list_pages_up_to_500_and_defaults_to_50(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    await conn.execute(
        "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts, last_error,"
        " error_class) SELECT 'bulk-' || i, 'q', 'c', '{}', 1, 'e', 'E'"
        " FROM generate_series(1, 520) AS i"
    )
    default = (await api.client.get(PREFIX, headers=auth())).json()
    assert len(default["items"]) == 50
    assert default["next_cursor"]
    biggest = (await api.client.get(PREFIX, params={"limit": 500}, headers=auth())).json()
    assert len(biggest["items"]) == 500
    rest = (
        await api.client.get(
            PREFIX, params={"limit": 500, "cursor": biggest["next_cursor"]}, headers=auth()
        )
    ).json()
    assert len(rest["items"]) == 20
    assert rest["next_cursor"] is None


# -- Health, problems, the document -------------------------------------------------------------


async def test_the_list_route_documents_each_query_parameter_of_its_model_once(api: Api) -> None:
    # The route validates its query itself (cheaper than FastAPI's query model handling) and
    # documents the parameters FastAPI generates from the same model.
    document = (await api.client.get("/openapi.json")).json()
    parameters = document["paths"][PREFIX]["get"]["parameters"]
    assert [p["name"] for p in parameters] == list(DeadLetterQuery.model_fields)
    assert all(p["in"] == "query" and not p["required"] and p["schema"] for p in parameters)
    limit = next(p for p in parameters if p["name"] == "limit")
    assert (limit["schema"]["minimum"], limit["schema"]["maximum"]) == (1, 500)


async def test_healthz_readyz_and_openapi_need_no_token(api: Api) -> None:
    assert (await api.client.get("/healthz")).json() == {"status": "ok"}
    ready = await api.client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok"}
    document = await api.client.get("/openapi.json")
    assert document.status_code == 200
    paths = document.json()["paths"]
    assert set(paths) >= {
        "/healthz",
        "/readyz",
        PREFIX,
        f"{PREFIX}/{{id}}",
        f"{PREFIX}/{{id}}/replay",
        f"{PREFIX}/{{id}}/discard",
        f"{PREFIX}/replay-bulk",
        f"{PREFIX}/replay-bulk/{{run_id}}",
        f"{PREFIX}/replay-bulk/{{run_id}}/items",
        f"{PREFIX}/replay-bulk/{{run_id}}/resume",
    }
    for path, item in paths.items():
        for operation in item.values():
            for code, response in operation["responses"].items():
                if code.startswith(("4", "5")):
                    assert list(response["content"]) == ["application/problem+json"], (
                        path,
                        code,
                    )


async def test_readyz_is_503_problem_when_the_database_is_unreachable() -> None:
    # A pool aimed at a port nobody listens on: it never gets a connection.
    dead = AsyncConnectionPool(
        "postgresql://postgres@127.0.0.1:9/none?connect_timeout=1",
        open=False,
        min_size=0,
        max_size=2,
        timeout=1.0,
        reconnect_timeout=60,
    )
    await dead.open(wait=False)
    try:
        settings = ApiSettings(jwt_secret=SECRET, readiness_timeout_seconds=0.3)
        async with running_api(dead, settings=settings, queue=MemoryQueue()) as api:
            assert (await api.client.get("/healthz")).status_code == 200
            response = await api.client.get("/readyz")
            assert_problem(response, 503, type="urn:jobfence:problem:database-unavailable")
            assert response.headers["retry-after"] == "5"
            listed = await api.client.get(PREFIX, headers=auth())
            assert_problem(listed, 503)
    finally:
        await dead.close()


async def test_unknown_route_and_wrong_method_are_problems(api: Api) -> None:
    missing = await api.client.get("/v2/nothing", headers=auth())
    assert_problem(missing, 404, type="about:blank")
    wrong = await api.client.delete(f"{PREFIX}/1", headers=auth())
    assert_problem(wrong, 405)
    assert "GET" in wrong.headers["allow"]


async def test_a_value_a_database_constraint_refuses_is_a_422_problem_not_a_500(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    """The API's own checks match the database's; should a locale or a later constraint
    disagree, the database's refusal is still the request's fault, and nothing is written."""
    await conn.execute(
        "ALTER TABLE core.dead_letters ADD CONSTRAINT test_reason_is_polite"
        " CHECK (discard_reason IS NULL OR discard_reason NOT LIKE '%%rude%%')"
    )
    dl_id = await insert_dead_letter(conn, job_id="polite")
    response = await api.client.post(
        f"{PREFIX}/{dl_id}/discard", json={"reason": "a rude reason"}, headers=auth()
    )
    problem = assert_problem(response, 422, type="urn:jobfence:problem:validation")
    assert "test_reason_is_polite" in problem["detail"]
    assert (await dead_letter_row(conn, dl_id))["status"] == "pending_review"


async def test_payloads_go_out_exactly_as_stored_however_deep_or_large_their_numbers(
    api: Api, conn: AsyncConnection[Any]
) -> None:
    """A poison payload is whatever failed: 800 levels deep, or numbers no float holds. Show
    and list give the stored JSON text verbatim instead of failing or rounding."""
    deep = "[" * 800 + "1" + "]" * 800
    numbers = '{"huge": 1e400, "precise": 0.1000000000000000000001, "int": 123456789012345678901}'
    ids = []
    for job_id, text in (("deep", deep), ("numbers", numbers)):
        row = await scalar(
            conn,
            "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, attempts,"
            " last_error, error_class) VALUES (%s, 'q', 'c', %s::jsonb, 1, 'e', 'E') RETURNING id",
            (job_id, text),
        )
        ids.append(int(row))
    query = "SELECT payload::text FROM core.dead_letters WHERE id = %s"
    stored = [await scalar(conn, query, (i,)) for i in ids]
    assert "1" + "0" * 400 in stored[1]  # jsonb keeps 1e400 exactly

    listed = await api.client.get(PREFIX, headers=auth())
    assert listed.status_code == 200, listed.text[:300]
    assert listed.headers["content-type"] == "application/json"
    for dead_letter_id, text in zip(ids, stored, strict=True):
        shown = await api.client.get(f"{PREFIX}/{dead_letter_id}", headers=auth())
        assert shown.status_code == 200, shown.text[:300]
        assert f'"payload":{text},' in shown.text
        assert f'"payload":{text},' in listed.text
    body = json.loads(shown.text, parse_float=Decimal)
    assert body["payload"]["huge"] == Decimal("1e400")
    assert body["payload"]["precise"] == Decimal("0.1000000000000000000001")
    assert body["fence_exists"] is False

    discarded = await api.client.post(
        f"{PREFIX}/{ids[1]}/discard", json={"reason": "cannot be represented"}, headers=auth()
    )
    assert discarded.status_code == 200
    assert f'"payload":{stored[1]},' in discarded.text
    assert discarded.json()["status"] == "discarded"
