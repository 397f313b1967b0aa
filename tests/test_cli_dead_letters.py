"""``jobfence dead-letters``: the real command, in a subprocess, against the test database.

Each error a person can cause is one line on stderr, a non-zero exit, no traceback, and leaves
the database exactly as it was.
"""

from __future__ import annotations

import asyncio
import base64
import getpass
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from jobfence import MemoryQueue, Message, cli_dead_letters, db, ops
from jobfence.codec import message_payload
from jobfence.ops import BulkReplay, DeadLetterFilter

BASE = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
LIST_COLUMNS = [
    "id",
    "created_at",
    "status",
    "queue",
    "consumer",
    "error_class",
    "attempts",
    "job_id",
    "correlation_id",
]


def dl(
    *args: str, url: str, actor: str | None = "cli-test", tmp: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``jobfence dead-letters ARGS`` in a real process; ``actor`` is $JOBFENCE_ACTOR."""
    env = {**os.environ, "JOBFENCE_DATABASE_URL": url}
    env.pop("JOBFENCE_ACTOR", None)
    if actor is not None:
        env["JOBFENCE_ACTOR"] = actor
    return subprocess.run(
        [sys.executable, "-m", "jobfence.cli", "dead-letters", *args],
        env=env,
        cwd=tmp or Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done
    assert "Traceback" not in done.stderr
    return done.stdout


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The single ``jobfence: error: ...`` line a person sees; fails on anything more."""
    assert done.returncode != 0, done
    assert "Traceback" not in done.stderr + done.stdout
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("jobfence: error: "), lines[0]
    return lines[0]


@pytest.fixture
def db_conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database_url, autocommit=True) as c:
        yield c


def seed(
    conn: psycopg.Connection[Any],
    job_id: str,
    *,
    queue: str = "loyalty",
    consumer: str = "award_points",
    error_class: str = "pointsapp.Flaky",
    correlation_id: str | None = None,
    minutes: int = 0,
    payload: Any = None,
    payload_encoding: str = "json",
    status: str = "pending_review",
) -> int:
    row = conn.execute(
        """INSERT INTO core.dead_letters (job_id, queue, consumer, tenant_id, payload,
               payload_encoding, attempts, last_error, error_class, correlation_id, created_at)
           VALUES (%s, %s, %s, 'tenant-a', %s, %s, 6, %s, %s, %s, %s) RETURNING id""",
        (
            job_id,
            queue,
            consumer,
            json.dumps({"account_id": 1, "points": 5} if payload is None else payload),
            payload_encoding,
            f"{error_class}: ledger timeout\n  File handler.py, line 3, in award",
            error_class,
            correlation_id,
            BASE + timedelta(minutes=minutes),
        ),
    ).fetchone()
    assert row is not None
    dead_letter_id = int(row[0])
    if status == "discarded":
        conn.execute(
            "UPDATE core.dead_letters SET status = 'discarded', discard_reason = 'seeded',"
            " resolved_at = now(), resolved_by = 'seed' WHERE id = %s",
            (dead_letter_id,),
        )
    return dead_letter_id


def row(conn: psycopg.Connection[Any], dead_letter_id: int) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        found = cur.execute(
            "SELECT * FROM core.dead_letters WHERE id = %s", (dead_letter_id,)
        ).fetchone()
    assert found is not None
    return found


def everything(conn: psycopg.Connection[Any]) -> dict[str, list[tuple[Any, ...]]]:
    """Every row the commands could change."""
    tables = {
        "dead_letters": "SELECT * FROM core.dead_letters ORDER BY id",
        "messages": "SELECT * FROM jobfence_queue.messages ORDER BY id",
        "bulk_replays": "SELECT * FROM jobfence.bulk_replays ORDER BY id",
        "bulk_items": "SELECT * FROM jobfence.bulk_replay_items ORDER BY 1, 2",
        "fences": "SELECT * FROM core.processed_jobs ORDER BY 1, 2",
    }
    return {name: conn.execute(query).fetchall() for name, query in tables.items()}


def queued(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT job_id, consumer, queue, correlation_id, body FROM jobfence_queue.messages"
        " ORDER BY id"
    ).fetchall()


# -- list ----------------------------------------------------------------------------------


def test_list_prints_a_table_then_the_next_cursor_and_the_last_page(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    first = seed(db_conn, "order-1", correlation_id="corr-1", minutes=1)
    second = seed(db_conn, "order-2", minutes=2)
    third = seed(db_conn, "order-3", queue="billing", consumer="bill", minutes=3)

    page_1 = ok(dl("list", "--limit", "2", url=database_url)).splitlines()

    assert page_1[0].split() == LIST_COLUMNS
    assert page_1[1].split() == [
        str(third),
        "2026-03-01",
        "12:03:00Z",
        "pending_review",
        "billing",
        "bill",
        "pointsapp.Flaky",
        "6",
        "order-3",
        "-",
    ]
    assert page_1[2].split()[0] == str(second)
    assert page_1[3].startswith("next cursor: ")
    assert len(page_1) == 4
    cursor = page_1[3].removeprefix("next cursor: ")

    page_2 = ok(dl("list", "--limit", "2", "--cursor", cursor, url=database_url)).splitlines()
    assert [line.split()[0] for line in page_2[1:-1]] == [str(first)]
    assert "corr-1" in page_2[1].split()
    assert page_2[-1] == "(last page)"

    billing = ok(dl("list", "--queue", "billing", url=database_url)).splitlines()
    assert [line.split()[0] for line in billing[1:-1]] == [str(third)]
    nothing = ok(dl("list", "--status", "discarded", url=database_url))
    assert nothing == "no dead letters match\n"


def test_list_json_is_one_document_for_scripts(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    ids = [seed(db_conn, f"order-{n}", minutes=n) for n in range(5)]
    big = seed(db_conn, "big", payload={"blob": "x" * 5000}, minutes=10)

    doc = json.loads(ok(dl("list", "--json", "--limit", "2", url=database_url)))

    assert set(doc) == {"items", "next_cursor"}
    assert [i["id"] for i in doc["items"]] == [big, ids[4]]
    summarised, whole = doc["items"]
    assert summarised["payload_truncated"] is True
    assert summarised["payload"] is None
    assert summarised["payload_size"] > ops.PAYLOAD_INLINE_LIMIT
    assert whole["payload"] == {"account_id": 1, "points": 5}
    assert whole["payload_truncated"] is False
    assert whole["created_at"] == "2026-03-01T12:04:00+00:00"
    assert set(whole) >= {
        *LIST_COLUMNS,
        "tenant_id",
        "payload_encoding",
        "last_error",
        "discard_reason",
        "resolved_at",
        "resolved_by",
        "payload_size",
        "payload_summary",
    }

    rest = json.loads(
        ok(dl("list", "--json", "--limit", "10", "--cursor", doc["next_cursor"], url=database_url))
    )
    assert [i["id"] for i in rest["items"]] == [ids[3], ids[2], ids[1], ids[0]]
    assert rest["next_cursor"] is None

    window = json.loads(
        ok(
            dl(
                "list",
                "--json",
                "--since",
                "2026-03-01T12:01:00Z",
                "--until",
                "2026-03-01T13:03:00+01:00",  # 12:03 UTC, exclusive
                url=database_url,
            )
        )
    )
    assert [i["id"] for i in window["items"]] == [ids[2], ids[1]]


def test_list_group_by_counts_pending_dead_letters_per_group(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    for n in range(3):
        seed(db_conn, f"flaky-{n}", minutes=n)
    seed(db_conn, "json-0", error_class="InvalidJson", minutes=5)
    seed(db_conn, "bill-0", queue="billing", consumer="bill", minutes=6)
    seed(db_conn, "gone", status="discarded", minutes=7)

    table = ok(dl("list", "--group-by", "queue,error_class", url=database_url)).splitlines()
    assert table[0].split() == ["queue", "error_class", "pending", "oldest", "newest"]
    assert [line.split()[:3] for line in table[1:]] == [
        ["loyalty", "pointsapp.Flaky", "3"],
        ["loyalty", "InvalidJson", "1"],  # equal counts: the oldest group first
        ["billing", "pointsapp.Flaky", "1"],
    ]

    doc = json.loads(
        ok(dl("list", "--group-by", "consumer", "--queue", "loyalty", "--json", url=database_url))
    )
    assert doc == {
        "groups": [
            {
                "queue": None,
                "consumer": "award_points",
                "error_class": None,
                "pending": 4,
                "oldest": "2026-03-01T12:00:00+00:00",
                "newest": "2026-03-01T12:05:00+00:00",
            }
        ]
    }


# -- show ----------------------------------------------------------------------------------


def test_show_prints_every_field_the_payload_pretty_and_the_fence(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    dl_id = seed(
        db_conn, "order-9", correlation_id="corr-9", payload={"account_id": 3, "points": 7}
    )

    out = ok(dl("show", str(dl_id), url=database_url))

    lines = out.splitlines()
    assert lines[0] == f"dead letter {dl_id}"
    fields = dict(line.strip().split(":", 1) for line in lines[1:15])
    assert {k: v.strip() for k, v in fields.items()} == {
        "status": "pending_review",
        "job_id": "order-9",
        "queue": "loyalty",
        "consumer": "award_points",
        "tenant_id": "tenant-a",
        "correlation_id": "corr-9",
        "attempts": "6",
        "error_class": "pointsapp.Flaky",
        "created_at": "2026-03-01T12:00:00+00:00",
        "resolved_at": "-",
        "resolved_by": "-",
        "discard_reason": "-",
        "payload_encoding": "json",
        "fence_exists": "no",
    }
    assert 'payload:\n{\n  "points": 7,\n  "account_id": 3\n}\n' in out  # jsonb key order
    assert out.endswith(
        "last_error:\npointsapp.Flaky: ledger timeout\n  File handler.py, line 3, in award\n"
    )

    db_conn.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, expires_at)"
        " VALUES ('order-9', 'award_points', now() + interval '1 day')"
    )
    assert "  fence_exists:     yes: this job's work has committed" in ok(
        dl("show", str(dl_id), url=database_url)
    )
    doc = json.loads(ok(dl("show", str(dl_id), "--json", url=database_url)))
    assert doc["fence_exists"] is True
    assert doc["payload"] == {"account_id": 3, "points": 7}
    assert (doc["id"], doc["job_id"], doc["status"]) == (dl_id, "order-9", "pending_review")


def _wrapped(raw: bytes) -> dict[str, str]:
    return {
        "encoding": "base64",
        "data": base64.b64encode(raw).decode(),
        "note": "original bytes kept as base64: payload is not valid JSON",
    }


def test_show_decodes_a_printable_base64_payload_and_escapes_one_that_is_not(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    text_id = seed(
        db_conn, "t", payload=_wrapped(b"order=991;\npoints=5"), payload_encoding="base64"
    )
    binary_id = seed(
        db_conn, "b", payload=_wrapped(b"\xff\xfe\x00ab\x1b[31m"), payload_encoding="base64"
    )

    text = ok(dl("show", str(text_id), url=database_url))
    assert "payload: 19 bytes kept as base64 (original bytes kept as base64: payload is not" in text
    assert "  decoded:\norder=991;\npoints=5\n" in text

    binary = ok(dl("show", str(binary_id), url=database_url))
    assert "  decoded (not printable as text, escaped): \\xff\\xfe\\x00ab\\x1b[31m\n" in binary
    assert "\x1b" not in binary  # a terminal escape in a payload is shown, never interpreted


FIVE_MB = 5 * 1024 * 1024
SHOWN_AT_MOST = 16 * 1024  # the fields, 4 KiB of each payload part, last_error


def _payload_section(out: str) -> str:
    """What show printed between ``payload:`` and ``last_error:``."""
    return out.split("\npayload:\n", 1)[1].split("\nlast_error:\n", 1)[0]


def test_show_cuts_a_5_mb_payload_says_how_much_was_left_out_and_full_prints_it_all(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    payload = {"blob": "é" + "x" * FIVE_MB, "account_id": 1}  # jsonb's key order
    dl_id = seed(db_conn, "big", payload=payload)
    before = everything(db_conn)

    out = ok(dl("show", str(dl_id), url=database_url))
    assert len(out.encode()) < SHOWN_AT_MOST
    whole = json.dumps(payload, indent=2, ensure_ascii=False)
    assert whole.startswith('{\n  "blob"')
    left_out = len(whole.encode()) - len(whole[:4096].encode())
    assert (
        f"\n... {left_out:,} more bytes of the payload not shown; --full prints everything,"
        " --payload-out FILE writes the payload\n"
    ) in out
    assert _payload_section(out).startswith(whole[:4096])
    assert out.endswith(
        "last_error:\npointsapp.Flaky: ledger timeout\n  File handler.py, line 3, in award\n"
    )

    full = ok(dl("show", str(dl_id), "--full", url=database_url))
    assert json.loads(_payload_section(full)) == payload
    assert "more bytes" not in full
    document = json.loads(ok(dl("show", str(dl_id), "--json", url=database_url)))
    assert document["payload"] == payload  # --json is never cut
    assert everything(db_conn) == before


def test_show_payload_out_writes_every_byte_of_a_5_mb_base64_payload_and_full_prints_it(
    database_url: str, db_conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    raw = os.urandom(FIVE_MB)  # not UTF-8: kept as base64 (D6)
    dl_id = seed(db_conn, "binary", payload=_wrapped(raw), payload_encoding="base64")
    target = tmp_path / "payload.bin"

    out = ok(dl("show", str(dl_id), "--payload-out", str(target), url=database_url))
    assert len(out.encode()) < SHOWN_AT_MOST
    assert f"payload: {FIVE_MB} bytes kept as base64 (" in out
    assert f"payload written to {target} ({FIVE_MB:,} bytes)" in out
    assert "more bytes of the payload not shown" in out
    assert target.read_bytes() == raw

    full = ok(dl("show", str(dl_id), "--full", url=database_url))
    [data] = [line for line in full.splitlines() if line.startswith("  base64: ")]
    assert base64.b64decode(data.removeprefix("  base64: ")) == raw


def test_show_payload_out_writes_a_json_payload_as_stored_and_never_overwrites_a_file(
    database_url: str, db_conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    document = '{"amount": 1.00000000000000000001, "big": 12345678901234567890123, "blob": "%s"}'
    inserted = db_conn.execute(
        "INSERT INTO core.dead_letters (job_id, queue, consumer, payload, payload_encoding,"
        " attempts, last_error, error_class) VALUES ('json', 'loyalty', 'award_points', %s,"
        " 'json', 1, 'E: x', 'E') RETURNING id",
        (document.replace("%s", "y" * 9000),),
    ).fetchone()
    assert inserted is not None
    dl_id = inserted[0]
    stored = db_conn.execute("SELECT payload::text FROM core.dead_letters").fetchone()[0]
    target = tmp_path / "payload.json"

    ok(dl("show", str(dl_id), "--payload-out", str(target), url=database_url))
    assert target.read_bytes() == stored.encode()  # the stored document's text, digits and all

    target.write_bytes(b"keep me")
    line = one_error_line(dl("show", str(dl_id), "--payload-out", str(target), url=database_url))
    assert line == (
        f"jobfence: error: --payload-out {target}: the file exists; name a new file"
        " (nothing is overwritten)"
    )
    assert target.read_bytes() == b"keep me"


# -- replay --------------------------------------------------------------------------------


def test_replay_publishes_the_original_job_and_says_what(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    first = seed(
        db_conn, "order-1", correlation_id="corr-1", payload={"account_id": 2, "points": 9}
    )
    second = seed(db_conn, "order-2")

    out = ok(dl("replay", str(first), "--actor", "alice (INC-1)", url=database_url))
    assert out == (
        f"dead letter {first} replayed: published job order-1 for consumer award_points to queue "
        "loyalty (30 bytes, correlation_id corr-1)\n"
    )
    [(job_id, consumer, queue, correlation_id, body)] = queued(db_conn)
    assert (job_id, consumer, queue, correlation_id) == (
        "order-1",
        "award_points",
        "loyalty",
        "corr-1",
    )
    assert json.loads(bytes(body)) == {"account_id": 2, "points": 9}
    assert (row(db_conn, first)["status"], row(db_conn, first)["resolved_by"]) == (
        "replayed",
        "alice (INC-1)",
    )

    # Without --actor: $JOBFENCE_ACTOR is recorded; --json says what was published.
    doc = json.loads(ok(dl("replay", str(second), "--json", actor="bob", url=database_url)))
    assert doc == {
        "dead_letter_id": second,
        "published": True,
        "already_processed": False,
        "queue": "loyalty",
        "consumer": "award_points",
        "job_id": "order-2",
        "tenant_id": "tenant-a",
        "correlation_id": None,
        "body_size": len(bytes(queued(db_conn)[1][4])),
    }
    assert row(db_conn, second)["resolved_by"] == "bob"


def test_replay_without_actor_or_env_records_the_os_user(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    dl_id = seed(db_conn, "order-1")
    ok(dl("replay", str(dl_id), actor=None, url=database_url))
    assert row(db_conn, dl_id)["resolved_by"] == getpass.getuser()


def test_replay_of_a_job_already_processed_publishes_nothing_and_says_so(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    dl_id = seed(db_conn, "order-5")
    db_conn.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, expires_at)"
        " VALUES ('order-5', 'award_points', now() + interval '1 day')"
    )

    out = ok(dl("replay", str(dl_id), url=database_url))

    assert "already processed: not republished" in out
    assert queued(db_conn) == []
    assert row(db_conn, dl_id)["status"] == "replayed"


def test_replay_of_a_dead_letter_no_longer_pending_names_its_status(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    dl_id = seed(db_conn, "order-1", status="discarded")
    before = everything(db_conn)

    done = dl("replay", str(dl_id), url=database_url)

    assert one_error_line(done) == (
        f"jobfence: error: dead letter {dl_id} is discarded, not pending_review"
    )
    assert done.returncode == 1
    assert everything(db_conn) == before


# -- discard -------------------------------------------------------------------------------


def test_discard_with_a_reason_records_it_and_who(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    dl_id = seed(db_conn, "order-1")

    out = ok(
        dl(
            "discard",
            str(dl_id),
            "--reason",
            "refunded by hand, INC-7",
            "--actor",
            "carol",
            url=database_url,
        )
    )

    assert out == (
        f"dead letter {dl_id} discarded (job order-1, consumer award_points) by carol: "
        "refunded by hand, INC-7\n"
    )
    after = row(db_conn, dl_id)
    assert (after["status"], after["discard_reason"], after["resolved_by"]) == (
        "discarded",
        "refunded by hand, INC-7",
        "carol",
    )
    assert queued(db_conn) == []
    again = dl("discard", str(dl_id), "--reason", "twice", url=database_url)
    assert "is discarded, not pending_review" in one_error_line(again)
    assert again.returncode == 1


# -- replay-bulk ---------------------------------------------------------------------------


def test_replay_bulk_dry_run_prints_the_count_and_changes_nothing(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    for n in range(3):
        seed(db_conn, f"order-{n}", minutes=n)
    seed(db_conn, "bill-1", queue="billing")
    seed(db_conn, "gone", status="discarded")
    before = everything(db_conn)

    out = ok(dl("replay-bulk", "--queue", "loyalty", "--dry-run", url=database_url))
    assert out == "dry run: 3 pending dead letters match; nothing changed\n"
    over = ok(dl("replay-bulk", "--all", "--dry-run", "--max-items", "2", url=database_url))
    assert over.splitlines() == [
        "dry run: 4 pending dead letters match; nothing changed",
        "a run would be refused: more than --max-items 2",
    ]
    doc = json.loads(ok(dl("replay-bulk", "--all", "--dry-run", "--json", url=database_url)))
    assert doc == {"dry_run": True, "matching": 4, "max_items": 10_000}
    assert everything(db_conn) == before


def test_replay_bulk_replays_the_matching_snapshot_with_progress_and_a_summary(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    loyalty = [seed(db_conn, f"order-{n}", correlation_id=f"c-{n}", minutes=n) for n in range(3)]
    billing = seed(db_conn, "bill-1", queue="billing", consumer="bill")
    db_conn.execute(
        "INSERT INTO core.processed_jobs (job_id, consumer, expires_at)"
        " VALUES ('order-1', 'award_points', now() + interval '1 day')"
    )

    done = dl("replay-bulk", "--queue", "loyalty", "--actor", "dave", url=database_url)

    assert done.returncode == 0, done
    assert done.stdout == (
        "bulk replay 1 finished: 3/3 processed (replayed 2, already processed 1, "
        "not pending 0, failed 0)\n"
    )
    progress = done.stderr.splitlines()
    assert progress[0].startswith("bulk replay 1 started: 3 dead letters in its snapshot")
    assert progress[-1] == (
        "bulk replay 1: 3/3 processed (replayed 2, already processed 1, not pending 0, failed 0)"
    )
    assert "Traceback" not in done.stderr
    assert sorted((j, c) for j, _, _, c, _ in queued(db_conn)) == [
        ("order-0", "c-0"),
        ("order-2", "c-2"),
    ]
    assert [row(db_conn, i)["resolved_by"] for i in loyalty] == ["dave"] * 3
    assert row(db_conn, billing)["status"] == "pending_review"


def test_replay_bulk_json_prints_one_final_document(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    for n in range(2):
        seed(db_conn, f"order-{n}", minutes=n)

    done = dl("replay-bulk", "--json", "--error-class", "pointsapp.Flaky", url=database_url)

    assert done.returncode == 0, done
    doc = json.loads(done.stdout)
    assert doc["finished"] is True
    assert doc["failed_items"] == []
    run = doc["run"]
    assert (run["total"], run["status"], run["requested_by"]) == (2, "finished", "cli-test")
    assert run["filter"] == {"status": "pending_review", "error_class": "pointsapp.Flaky"}
    assert run["counts"] == {
        "replayed": 2,
        "already_processed": 0,
        "not_pending": 0,
        "failed": 0,
        "pending": 0,
    }
    assert len(queued(db_conn)) == 2


class _Interrupted(Exception):
    pass


async def _interrupted_run(database_url: str) -> int:
    """A bulk run on an external broker whose first chunk (order-0 replayed into the outbox,
    order-1 failed: not replayable) is done and whose second chunk never started: the
    operator's process died."""
    pool = await db.open_pool(database_url, max_size=2)
    try:
        run = await ops.start_bulk_replay(
            pool, DeadLetterFilter(), requested_by="eve", select_all=True
        )
        assert isinstance(run, BulkReplay)

        def die(_: BulkReplay) -> None:
            raise _Interrupted

        with pytest.raises(_Interrupted):
            await ops.run_bulk_replay(
                pool, MemoryQueue(), run.id, actor="eve", chunk_size=2, on_progress=die
            )
        return run.id
    finally:
        await pool.close()


def test_replay_bulk_resume_finishes_a_run_and_fails_when_an_item_failed(
    database_url: str, db_conn: psycopg.Connection[Any]
) -> None:
    # order-1 kept its whole message, whose job_id breaks the 1,024-byte limit: it can never
    # be replayed, so its item fails.
    kept, encoding = message_payload(
        Message(queue="loyalty", consumer="award_points", job_id="x" * 1100, body=b"{}"), "test"
    )
    ids = [
        seed(db_conn, "order-0", minutes=0),
        seed(db_conn, "order-1", minutes=1, payload=json.loads(kept), payload_encoding=encoding),
        seed(db_conn, "order-2", minutes=2),
        seed(db_conn, "order-3", minutes=3),
    ]
    run_id = asyncio.run(_interrupted_run(database_url))

    done = dl("replay-bulk", "--resume", str(run_id), url=database_url)

    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[0].startswith(
        f"bulk replay {run_id} resuming: 4 dead letters in its snapshot, 2 to process"
    )
    finished, failed = done.stdout.splitlines()
    assert finished == (
        f"bulk replay {run_id} finished: 4/4 processed (replayed 3, already processed 0, "
        "not pending 0, failed 1)"
    )
    assert failed.startswith(
        f"  failed: dead letter {ids[1]}: dead letter {ids[1]} cannot be replayed"
    )
    # order-0 went to the external broker's outbox; the resumed chunk to the PostgreSQL queue.
    assert [j for j, *_ in queued(db_conn)] == ["order-2", "order-3"]
    outbox = db_conn.execute("SELECT job_id FROM jobfence.outbox").fetchall()
    assert outbox == [("order-0",)]
    assert [row(db_conn, i)["status"] for i in ids] == [
        "replayed",
        "pending_review",
        "replayed",
        "replayed",
    ]
    again = dl("replay-bulk", "--resume", str(run_id), "--json", url=database_url)
    assert again.returncode == 1
    doc = json.loads(again.stdout)
    assert doc["failed_items"][0]["dead_letter_id"] == ids[1]
    assert doc["run"]["counts"]["failed"] == 1


# -- errors a person can cause -------------------------------------------------------------

ERRORS = [
    pytest.param(
        ["show", "abc"],
        2,
        "dead-letters show: argument ID: not a dead letter id: 'abc'",
        id="show-bad-id",
    ),
    pytest.param(["show", "-3"], 2, "dead-letters show:", id="show-negative-id"),
    pytest.param(["show", "999999"], 1, "no dead letter with id 999999", id="show-unknown"),
    pytest.param(["replay", "999999"], 1, "no dead letter with id 999999", id="replay-unknown"),
    pytest.param(
        ["discard", "999999", "--reason", "x"],
        1,
        "no dead letter with id 999999",
        id="discard-unknown",
    ),
    pytest.param(
        ["list", "--cursor", "bogus"],
        2,
        "jobfence: error: --cursor is not one that jobfence dead-letters list printed",
        id="bad-cursor",
    ),
    pytest.param(
        ["list", "--since", "last tuesday"], 2, "not an ISO 8601 date or time", id="bad-since"
    ),
    pytest.param(
        ["list", "--until", "2026-13-01"], 2, "not an ISO 8601 date or time", id="bad-until"
    ),
    pytest.param(
        ["list", "--since", "2026-03-02", "--until", "2026-03-01"],
        2,
        "--since must be before --until",
        id="empty-range",
    ),
    pytest.param(
        ["list", "--status", "pending"], 2, "argument --status: invalid choice", id="bad-status"
    ),
    pytest.param(
        ["list", "--limit", "501"], 2, "--limit must be between 1 and 500", id="limit-high"
    ),
    pytest.param(["list", "--limit", "0"], 2, "--limit must be between 1 and 500", id="limit-zero"),
    pytest.param(["list", "--group-by", "tenant"], 2, "group by one or more of", id="bad-group"),
    pytest.param(
        ["list", "--group-by", "queue", "--cursor", "x"],
        2,
        "--cursor pages through rows",
        id="group-cursor",
    ),
    pytest.param(
        ["discard", "{id}"],
        2,
        "the following arguments are required: --reason",
        id="discard-no-reason",
    ),
    pytest.param(
        ["discard", "{id}", "--reason", " \t "],
        2,
        "a discard requires a non-blank reason",
        id="discard-blank-reason",
    ),
    pytest.param(
        ["discard", "{id}", "--reason", "x" * 2001],
        2,
        "at most 2000 characters",
        id="discard-long-reason",
    ),
    pytest.param(
        ["replay", "{id}", "--actor", "  "], 2, "--actor must name who", id="replay-blank-actor"
    ),
    pytest.param(
        ["replay-bulk", "--all", "--max-items", "1"],
        2,
        "2 pending dead letters match, more than --max-items 1: narrow the filters or raise"
        " --max-items",
        id="bulk-too-large",
    ),
    pytest.param(
        ["replay-bulk", "--all", "--max-items", "0"],
        2,
        "argument --max-items: not a whole number from 1 to 1000000: '0'",
        id="bulk-max-zero",
    ),
    pytest.param(["replay-bulk"], 2, cli_dead_letters.BULK_ALL_NEEDED, id="bulk-no-filter-no-all"),
    pytest.param(
        ["replay-bulk", "--dry-run"],
        2,
        cli_dead_letters.BULK_ALL_NEEDED,
        id="bulk-dry-run-no-filter-no-all",
    ),
    pytest.param(
        ["replay-bulk", "--all", "--queue", "loyalty"],
        2,
        cli_dead_letters.BULK_ALL_WITH_FILTER,
        id="bulk-all-and-filter",
    ),
    pytest.param(
        ["replay-bulk", "--all", "--since", "2026-01-01", "--dry-run"],
        2,
        cli_dead_letters.BULK_ALL_WITH_FILTER,
        id="bulk-dry-run-all-and-filter",
    ),
    pytest.param(
        ["replay-bulk", "--resume", "1", "--all"], 2, "it takes no --all", id="resume-all"
    ),
    pytest.param(
        ["replay-bulk", "--resume", "4242"], 1, "no bulk replay with id 4242", id="resume-unknown"
    ),
    pytest.param(
        ["replay-bulk", "--resume", "1", "--queue", "loyalty"],
        2,
        "it takes no filters",
        id="resume-filter",
    ),
    pytest.param(
        ["replay-bulk", "--resume", "x"], 2, "not a bulk replay id: 'x'", id="resume-bad-id"
    ),
]


@pytest.mark.parametrize(("args", "status", "says"), ERRORS)
def test_an_error_a_person_can_cause_is_one_line_and_changes_nothing(
    database_url: str,
    db_conn: psycopg.Connection[Any],
    args: list[str],
    status: int,
    says: str,
) -> None:
    pending = seed(db_conn, "order-1")
    seed(db_conn, "order-2", minutes=1)
    before = everything(db_conn)

    done = dl(*(a.replace("{id}", str(pending)) for a in args), url=database_url)

    line = one_error_line(done)
    assert says in line
    assert "API" not in line  # the HTTP API's wording (its parameters) never shows here
    assert done.returncode == status
    assert everything(db_conn) == before


def test_replay_bulk_max_items_past_what_a_run_may_be_given_is_a_bad_argument(
    database_url: str,
) -> None:
    """``--max-items`` has the API's bound (1,000,000): refused with the usage line and exit
    status 2, nothing taken; a value over PostgreSQL's integer came back as a database error."""
    done = dl("replay-bulk", "--all", "--max-items", "99999999999", url=database_url)
    assert done.returncode == 2, done
    assert "argument --max-items: not a whole number from 1 to 1000000" in done.stderr
    assert "database error" not in done.stderr
