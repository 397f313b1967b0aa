"""The API's list item cache (``jobfence.ops.ItemCache``): a page read through it is the page
PostgreSQL renders without it, whatever changed since an item was cached (a resolution, a
database restored to an earlier state that hands an id out again), and it keeps to its size.
Over HTTP, ``/metrics`` shows its hits and misses; a negative size is refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from jobfence import ops
from jobfence.api import ApiSettings
from jobfence.cli import main
from jobfence.errors import ConfigError
from test_api_metrics import _samples
from test_api_rendering import AWKWARD, _insert, _seed
from test_api_support import PREFIX, SECRET, auth, running_api

ALL = ops.DeadLetterFilter()
# Enough reads of one kind of page for the cache to read the next one as ids (7 with the
# weights of jobfence.ops.ItemCache.plan).
WARM_READS = 12


async def _page(
    conn: AsyncConnection[Any],
    items: ops.ItemCache | None,
    flt: ops.DeadLetterFilter = ALL,
    **kwargs: Any,
) -> bytes:
    return await ops.list_dead_letters_json(conn, flt, items=items, **kwargs)


async def test_a_page_served_from_the_item_cache_equals_the_page_rendered_without_it(
    conn: AsyncConnection[Any],
) -> None:
    # Escapes, non-ASCII text, a summarised payload, a base64 one, a discarded row.
    await _seed(conn)
    cache = ops.ItemCache(1 << 20)
    for flt, limit in (
        (ALL, 50),
        (ALL, 2),
        (ops.DeadLetterFilter(status="discarded"), 50),
        (ops.DeadLetterFilter(status="pending_review"), 50),
    ):
        uncached = await _page(conn, None, flt, limit=limit)
        # Read with its items at first, then (found whole lately) as ids and the cached items.
        for _ in range(WARM_READS):
            assert await _page(conn, cache, flt, limit=limit) == uncached
        hits = cache.hits
        assert await _page(conn, cache, flt, limit=limit) == uncached
        assert cache.hits - hits == len(json.loads(uncached)["items"])  # every item cached
        cursor = json.loads(uncached)["next_cursor"]
        if cursor is not None:
            after = await _page(conn, None, flt, limit=limit, cursor=cursor)
            for _ in range(WARM_READS):
                assert await _page(conn, cache, flt, limit=limit, cursor=cursor) == after
    assert len(cache) == 4


async def _statements_run(conn: AsyncConnection[Any]) -> list[str]:
    """The statements run on ``conn`` (prepare_threshold 0: psycopg prepares each one)."""
    cur = await conn.execute("SELECT statement FROM pg_prepared_statements ORDER BY prepare_time")
    return [str(row[0]) for row in await cur.fetchall() if "pg_prepared" not in row[0]]


async def test_a_page_of_a_kind_found_whole_lately_is_read_as_ids_and_only_misses_rendered(
    database_url: str, conn: AsyncConnection[Any]
) -> None:
    for n in range(5):
        await _insert(conn, job_id=f"job-{n}")
    cache = ops.ItemCache(1 << 20)
    async with await AsyncConnection.connect(database_url, autocommit=True) as cold:
        cold.prepare_threshold = 0
        expected = await _page(cold, cache)
        [statement] = await _statements_run(cold)  # never seen: one statement, with the items
        assert "item_as_pending" in statement
        assert len(cache) == 5
    for _ in range(WARM_READS):
        assert await _page(conn, cache) == expected
    async with await AsyncConnection.connect(database_url, autocommit=True) as warm:
        warm.prepare_threshold = 0
        assert await _page(warm, cache) == expected
        [statement] = await _statements_run(warm)  # found whole lately: the ids only
        assert "item_as_pending" not in statement and "resolved_tail" in statement
        newer = await _insert(conn, job_id="newer")
        page = await _page(warm, cache)
        assert page == await _page(conn, None)
        assert json.loads(page)["items"][0]["id"] == newer
        ids, missing = await _statements_run(warm)  # and the one missing item by id
        assert ids == statement
        assert "ANY" in missing and "dead_letter_renderings" in missing


async def test_pages_never_found_whole_leave_the_cache_alone_but_one_in_four(
    conn: AsyncConnection[Any],
) -> None:
    # Random time windows, lookups of one job each: what a cache cannot serve is read as
    # without one, and looked up now and then to notice when the cache could.
    jobs = [f"lookup-{n}" for n in range(8)]
    for job_id in jobs:
        await _insert(conn, job_id=job_id)
    cache = ops.ItemCache(1 << 20)
    for job_id in jobs:
        flt = ops.DeadLetterFilter(job_id=job_id)
        assert await _page(conn, cache, flt) == await _page(conn, None, flt)
    looked_up = len(jobs) // ops.ItemCache.SAMPLE_EVERY
    assert (cache.hits, cache.misses, len(cache)) == (0, looked_up, looked_up)


async def test_a_cached_item_shows_the_status_and_resolution_of_the_moment(
    conn: AsyncConnection[Any],
) -> None:
    first = await _insert(conn, job_id="to discard")
    second = await _insert(conn, job_id="to replay")
    await _insert(conn, job_id="stays pending")
    cache = ops.ItemCache(1 << 20)
    for _ in range(WARM_READS + 1):
        before = json.loads(await _page(conn, cache))
    assert {item["status"] for item in before["items"]} == {"pending_review"}

    resolve = (
        "UPDATE core.dead_letters SET status = %s, discard_reason = %s, resolved_at = now(),"
        " resolved_by = %s WHERE id = %s"
    )
    await conn.execute(resolve, ("discarded", AWKWARD, "ops \u00e9", first))
    await conn.execute(resolve, ("replayed", None, "bob", second))

    hits = cache.hits
    page = await _page(conn, cache)
    assert cache.hits - hits == 3  # every item came from the cache ...
    assert page == await _page(conn, None)  # ... and the page is what PostgreSQL renders
    items = {item["id"]: item for item in json.loads(page)["items"]}
    assert items[first]["status"] == "discarded"
    assert items[first]["discard_reason"] == AWKWARD
    assert items[first]["resolved_by"] == "ops \u00e9"
    assert items[second]["status"] == "replayed"
    assert items[second]["resolved_at"] is not None
    assert items[first]["created_at"] == before["items"][2]["created_at"]


async def test_a_dead_letter_that_reuses_an_id_is_not_answered_from_the_cache(
    conn: AsyncConnection[Any],
) -> None:
    # A database restored to an earlier state hands out ids again, for other dead letters: the
    # cache must not answer one with the item of another that had its id before the restore.
    cache = ops.ItemCache(1 << 20)
    async with conn.transaction(force_rollback=True):  # the state the restore goes back from
        gone = await _insert(conn, job_id="before the restore", last_error="old")
        assert json.loads(await _page(conn, cache))["items"][0]["job_id"] == "before the restore"
    assert len(cache) == 1
    await conn.execute(
        "SELECT setval(pg_get_serial_sequence('core.dead_letters', 'id'), %s, false)", (gone,)
    )
    again = await _insert(conn, job_id="after the restore", last_error="new")
    assert again == gone

    page = await _page(conn, cache)
    [item] = json.loads(page)["items"]
    assert (item["id"], item["job_id"], item["last_error"]) == (gone, "after the restore", "new")
    assert page == await _page(conn, None)


async def test_the_item_cache_keeps_to_its_size_and_pages_stay_right_when_it_evicts(
    conn: AsyncConnection[Any],
) -> None:
    for n in range(60):
        await _insert(conn, job_id=f"job-{n}")
    expected = []
    cursor = None
    while True:
        page = await _page(conn, None, limit=7, cursor=cursor)
        expected.append(page)
        cursor = json.loads(page)["next_cursor"]
        if cursor is None:
            break
    item_bytes = max(len(json.dumps(i).encode()) for i in json.loads(expected[0])["items"])
    per_item = item_bytes + ops.ItemCache.ENTRY_OVERHEAD
    budget = 10 * per_item  # room for about 10 of the 60
    cache = ops.ItemCache(budget)
    for _ in range(WARM_READS):  # every page again and again, each a kind found whole or not
        cursor = None
        for page in expected:
            assert await _page(conn, cache, limit=7, cursor=cursor) == page
            cursor = json.loads(page)["next_cursor"]
            # Each generation holds half the budget, plus at most the page that filled it.
            assert cache.size_bytes <= budget + 2 * 7 * per_item
            assert len(cache) < 60

    nothing = ops.ItemCache(0)
    assert await _page(conn, nothing, limit=7) == expected[0]
    assert (len(nothing), nothing.size_bytes, nothing.hits + nothing.misses) == (0, 0, 0)


def test_the_item_cache_drops_its_older_generation_and_keeps_what_was_found_again() -> None:
    cache = ops.ItemCache(10 * (100 + ops.ItemCache.ENTRY_OVERHEAD))  # 5 items a generation
    key = [(n, n.to_bytes(8, "big")) for n in range(20)]
    cache.store({key[n]: b"x" * 100 for n in range(6)})  # 0-5 fill the younger: now the older
    assert cache.lookup([key[0]]) == [b"x" * 100]  # found in the older: back in the younger
    cache.store({key[n]: b"y" * 100 for n in range(6, 11)})  # younger full again: swapped
    assert cache.lookup([key[1]]) == [None]  # 1 was in the generation dropped
    assert cache.lookup([key[0], key[10]]) == [b"x" * 100, b"y" * 100]
    assert cache.lookup([(0, b"another created_at")]) == [None]  # the key is id and created_at


async def test_list_pages_over_http_use_the_item_cache_and_metrics_count_it(
    pool: AsyncConnectionPool[Any], conn: AsyncConnection[Any]
) -> None:
    for n in range(3):
        await _insert(conn, job_id=f"http-{n}")
    async with running_api(pool) as api:
        headers = auth("core.dead_letters.read")
        first = await api.client.get(PREFIX, headers=headers)
        assert first.status_code == 200
        for _ in range(WARM_READS):
            assert (await api.client.get(PREFIX, headers=headers)).content == first.content
        metrics = _samples((await api.client.get("/metrics")).text)
    assert metrics[("jobfence_api_item_cache_misses_total", ())] == 3  # the first read
    assert metrics[("jobfence_api_item_cache_hits_total", ())] >= 3 * 3  # the cache warmed up
    assert metrics[("jobfence_api_item_cache_bytes", ())] > 3 * ops.ItemCache.ENTRY_OVERHEAD

    no_cache = ApiSettings(jwt_secret=SECRET, item_cache_bytes=0)
    async with running_api(pool, settings=no_cache) as api:
        for _ in range(WARM_READS):
            assert (await api.client.get(PREFIX, headers=headers)).content == first.content
        metrics = _samples((await api.client.get("/metrics")).text)
    assert metrics[("jobfence_api_item_cache_hits_total", ())] == 0
    assert metrics[("jobfence_api_item_cache_misses_total", ())] == 0
    assert metrics[("jobfence_api_item_cache_bytes", ())] == 0


def test_a_negative_item_cache_size_is_refused_with_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["api", "--item-cache-mb", "-1"])
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(
        "argument --item-cache-mb: must be a whole number from 0 to 1048576, got '-1'"
    ), last
    with pytest.raises(ConfigError, match="item_cache_bytes must be >= 0"):
        ApiSettings(jwt_secret=SECRET, item_cache_bytes=-1)
