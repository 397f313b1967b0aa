"""jobfence.contrib.django on real Django (tests/djangoproject, a minimal project with a
``Point`` model) and the real PostgreSQL: every Django command runs as ``manage.py`` in a real
process, with no JOBFENCE_DATABASE_URL (the database comes from ``DATABASES``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

pytest.importorskip("django")

PROJECT = Path(__file__).resolve().parent / "djangoproject"
DOC = Path(__file__).resolve().parent.parent / "docs" / "django.md"


def project_env(url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JOBFENCE_DATABASE_URL"}
    env.update(DJANGOPROJECT_DATABASE_URL=url, PYTHONUNBUFFERED="1", **extra)
    return env


def manage(url: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """``manage.py ARGS`` in a real process, on the database ``url``; its output captured."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=PROJECT,
        env=project_env(url, **extra),
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def shell(url: str, code: str, **extra: str) -> subprocess.CompletedProcess[str]:
    done = manage(url, "shell", "-v", "0", "-c", code, **extra)
    assert done.returncode == 0, done.stderr
    return done


def start_worker(url: str, log: Path, *args: str, **extra: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "manage.py", "jobfence_worker", *args],
            cwd=PROJECT,
            env=project_env(url, **extra),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait_for(predicate: Any, *, timeout: float = 30.0, message: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(0.05)


def one(url: str, query: str, params: Any = None) -> Any:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]


def points(url: str, job_id: str | None = None) -> int:
    if job_id is None:
        return int(one(url, "SELECT count(*) FROM points_point"))
    return int(one(url, "SELECT count(*) FROM points_point WHERE job_id = %s", (job_id,)))


def fences(url: str) -> int:
    return int(one(url, "SELECT count(*) FROM core.processed_jobs"))


def enqueue_code(*jobs: tuple[str, dict[str, Any]]) -> str:
    """Python for ``manage.py shell``: enqueue each (job_id, payload) in one atomic block."""
    lines = [
        "from django.db import transaction",
        "from jobfence.contrib.django import enqueue",
        "with transaction.atomic():",
    ]
    lines += [f"    enqueue('award_points', {p!r}, job_id={j!r})" for j, p in jobs]
    return "\n".join(lines)


@pytest.fixture
def django_db(empty_database_url: str) -> Iterator[str]:
    """A fresh database migrated by ``manage.py migrate`` alone: jobfence's schema included."""
    done = manage(empty_database_url, "migrate", "-v", "1")
    assert done.returncode == 0, done.stderr
    assert "Applying jobfence.0001_jobfence_schema... OK" in done.stdout
    yield empty_database_url


def test_manage_migrate_applies_jobfence_schema_and_later_jobfence_migrations(
    django_db: str, empty_database_url: str
) -> None:
    from jobfence.schema import latest_version, migrations

    versions = int(one(django_db, "SELECT count(*) FROM jobfence.schema_migrations"))
    assert versions == len(migrations())
    done = manage(django_db, "jobfence_migrate")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"already up to date (version {latest_version():04d})\n"


def test_migrate_after_a_jobfence_upgrade_applies_the_new_jobfence_migrations(
    server_url: str,
) -> None:
    """Django's migration of jobfence recorded without running (``--fake``: as after an
    upgrade of jobfence, Django has nothing of jobfence's left to run): every ``manage.py
    migrate`` still applies the jobfence migrations the database lacks (post_migrate)."""
    from conftest import create_database, drop_database
    from jobfence.schema import migrations
    from support import with_dbname

    name = create_database(server_url, template=None)
    url = with_dbname(server_url, name)
    try:
        done = manage(url, "migrate", "jobfence", "0001", "--fake")
        assert done.returncode == 0, done.stderr
        assert "Applying jobfence.0001_jobfence_schema... FAKED" in done.stdout
        newest = migrations()[-1]
        assert f"jobfence: applied {newest.version:04d}_{newest.name}" in done.stdout
        assert int(one(url, "SELECT count(*) FROM jobfence.schema_migrations")) == len(migrations())
        again = manage(url, "migrate")
        assert again.returncode == 0, again.stderr
        assert "jobfence: applied" not in again.stdout
    finally:
        drop_database(server_url, name)


def test_a_job_enqueued_in_atomic_exists_exactly_when_the_block_commits(django_db: str) -> None:
    code = "\n".join(
        [
            enqueue_code(("committed", {"account": "ann", "amount": 5})),
            "try:",
            "    with transaction.atomic():",
            "        enqueue('award_points', {'account': 'bob', 'amount': 3},"
            " job_id='rolled-back')",
            "        raise RuntimeError('the view failed')",
            "except RuntimeError:",
            "    pass",
        ]
    )
    shell(django_db, code)
    jobs = one(django_db, "SELECT array_agg(job_id) FROM jobfence_queue.messages")
    assert jobs == ["committed"]

    done = manage(django_db, "jobfence_worker", "--until", "empty")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "worker started: queues points, concurrency 2" in done.stderr  # JOBFENCE["WORKER"]
    assert "worker stopped: succeeded 1, released 0" in done.stdout
    assert points(django_db, "committed") == 1
    assert points(django_db, "rolled-back") == 0
    assert fences(django_db) == 1

    # the same job_id again (a redelivery, a second enqueue): no second effect
    shell(django_db, enqueue_code(("committed", {"account": "ann", "amount": 5})))
    done = manage(django_db, "jobfence_worker", "--until", "empty")
    assert "worker stopped: duplicate 1, released 0" in done.stdout, done.stdout
    assert points(django_db) == 1


def test_a_refused_enqueue_raises_before_any_sql_and_the_block_still_commits(
    django_db: str,
) -> None:
    code = "\n".join(
        [
            "from django.db import transaction",
            "from jobfence.contrib.django import enqueue",
            "from points.models import Point",
            "with transaction.atomic():",
            "    try:",
            "        enqueue('no_such_consumer', {'account': 'ann'}, job_id='j1')",
            "    except Exception as exc:",
            "        print(type(exc).__name__, exc)",
            "    Point.objects.create(job_id='direct', account='ann', amount=1)",
        ]
    )
    done = shell(django_db, code)
    assert done.stdout.startswith("ConfigError ")
    assert "no_such_consumer" in done.stdout
    assert points(django_db, "direct") == 1  # the block was still usable, and committed
    assert one(django_db, "SELECT count(*) FROM jobfence_queue.messages") == 0


def test_a_failing_orm_handler_retries_then_dead_letters_with_no_effect(django_db: str) -> None:
    shell(
        django_db,
        enqueue_code(
            ("flaky", {"account": "ann", "amount": 5, "fail": "always"}),
            ("closed", {"account": "bob", "amount": 5, "fail": "hard"}),
            ("fine", {"account": "cy", "amount": 5}),
        ),
    )
    done = manage(django_db, "jobfence_worker", "--until", "empty")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "worker stopped: dead_lettered 2, retried 2, succeeded 1, released 0" in done.stdout
    with psycopg.connect(django_db) as conn:
        found = conn.execute("SELECT job_id, attempts, error_class FROM core.dead_letters")
        rows = {r[0]: r[1:] for r in found.fetchall()}
    assert rows == {"flaky": (3, "RuntimeError"), "closed": (1, "jobfence.HardFailure")}
    assert points(django_db) == 1  # the failed attempts' ORM writes rolled back
    assert points(django_db, "fine") == 1


def test_same_job_id_concurrently_in_two_worker_processes_gives_one_effect(
    django_db: str, tmp_path: Path
) -> None:
    """Acceptance 1 with two real ``manage.py jobfence_worker`` processes, one job at a time
    each. Each round queues six copies of one job_id at once; the handler that runs holds its
    fence uncommitted until a copy in another transaction is blocked on it (pg_stat_activity),
    which proves the deliveries overlap. Each round ends with one effect and one fence."""
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    options = ("--concurrency", "1", "--batch-size", "1")
    marker = {"POINTS_MARKER_DIR": str(tmp_path)}
    workers = [start_worker(django_db, log, *options, **marker) for log in logs]
    rounds, copies = 3, 6
    ids = [f"race-{r}" for r in range(rounds)]
    try:
        for log in logs:
            wait_for(lambda log=log: b"worker started" in log.read_bytes(), message="start")
        payload = {"account": "ann", "amount": 1, "until_blocked": True}
        for job_id in ids:
            shell(django_db, enqueue_code(*[(job_id, payload)] * copies))
            wait_for(
                lambda: one(django_db, "SELECT count(*) FROM jobfence_queue.messages") == 0,
                message=f"round {job_id}",
            )
            assert points(django_db, job_id) == 1
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(timeout=60)
    summaries = [log.read_text().splitlines()[-1] for log in logs]
    counts: dict[str, int] = {}
    for line in summaries:
        assert line.startswith("worker stopped: "), summaries
        assert "succeeded" in line or "duplicate" in line, summaries  # both took part
        for part in line.removeprefix("worker stopped: ").split(", "):
            key, value = part.rsplit(" ", 1)
            counts[key] = counts.get(key, 0) + int(value)
    assert counts["succeeded"] == rounds, summaries
    assert counts["duplicate"] == rounds * (copies - 1), summaries
    ran = sorted(line for path in tmp_path.glob("ran.*") for line in path.read_text().splitlines())
    assert ran == [f"{j} overlap" for j in ids], ran  # one run per job_id, its twin waiting
    assert fences(django_db) == rounds


def test_sigkill_between_the_orm_work_and_the_commit_leaves_neither(
    django_db: str, tmp_path: Path
) -> None:
    """Acceptance 2: the handler's ORM row is written, uncommitted, when the worker process is
    SIGKILLed; neither the row nor the fence survives, and the job then runs once."""
    shell(django_db, enqueue_code(("crash", {"account": "ann", "amount": 5, "hold": True})))
    marker = tmp_path / "in_handler"
    worker = start_worker(
        django_db,
        tmp_path / "worker.log",
        "--concurrency",
        "1",
        "--lease-seconds",
        "1",
        POINTS_MARKER_DIR=str(tmp_path),
    )
    try:
        wait_for(marker.exists, message="the handler's ORM write")
        backend = int(marker.read_text().split()[0])
        state = one(django_db, "SELECT state FROM pg_stat_activity WHERE pid = %s", (backend,))
        assert state == "idle in transaction"  # the Point and the fence, not committed
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=30)
    wait_for(
        lambda: (
            one(django_db, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (backend,)) == 0
        ),
        message="the killed worker's backend to end",
    )
    assert points(django_db) == 0
    assert fences(django_db) == 0

    wait_for(  # the killed worker's lease (1 s) on the delivery runs out
        lambda: one(django_db, "SELECT bool_and(run_at <= now()) FROM jobfence_queue.messages"),
        message="the lease to run out",
    )
    done = manage(django_db, "jobfence_worker", "--until", "empty", POINTS_MARKER_DIR=str(tmp_path))
    assert "succeeded 1" in done.stdout, done.stdout + done.stderr
    assert points(django_db, "crash") == 1
    assert fences(django_db) == 1


def test_dead_letter_management_commands_list_show_replay_discard(django_db: str) -> None:
    shell(
        django_db,
        enqueue_code(
            ("one", {"account": "ann", "amount": 5, "fail": "hard"}),
            ("two", {"account": "bob", "amount": 5, "fail": "hard"}),
        ),
    )
    manage(django_db, "jobfence_worker", "--until", "empty")
    listed = manage(django_db, "jobfence_dead_letters", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    items = {i["job_id"]: i for i in json.loads(listed.stdout)["items"]}
    assert set(items) == {"one", "two"}
    first, second = items["one"]["id"], items["two"]["id"]

    shown = manage(django_db, "jobfence_dead_letters", "show", str(first))
    assert shown.returncode == 0 and "job_id:           one" in shown.stdout, shown.stdout

    nowhere = manage(django_db, "jobfence_dead_letters", "discard", str(second))
    assert nowhere.returncode == 2
    assert "--reason" in nowhere.stderr  # discarding needs a reason

    replayed = manage(django_db, "jobfence_dead_letters", "replay", str(first), "--actor", "ops")
    assert replayed.returncode == 0, replayed.stderr
    assert f"dead letter {first} replayed: published job one" in replayed.stdout
    again = manage(django_db, "jobfence_dead_letters", "replay", str(first), "--actor", "ops")
    assert again.returncode == 1
    assert again.stderr == f"jobfence: error: dead letter {first} is replayed, not pending_review\n"

    discarded = manage(
        django_db, "jobfence_dead_letters", "discard", str(second), "--reason", "closed"
    )
    assert discarded.returncode == 0, discarded.stderr
    status = one(django_db, "SELECT status FROM core.dead_letters WHERE id = %s", (second,))
    assert status == "discarded"

    shell(django_db, enqueue_code(("three", {"account": "cy", "amount": 5, "fail": "hard"})))
    manage(django_db, "jobfence_worker", "--until", "empty")
    bulk = manage(
        django_db, "jobfence_dead_letters", "replay-bulk", "--job-id", "three", "--actor", "ops"
    )
    assert bulk.returncode == 0, bulk.stderr
    assert "finished: 1/1 processed (replayed 1," in bulk.stdout, bulk.stdout
    assert one(django_db, "SELECT job_id FROM jobfence_queue.messages") == "three"

    cleaned = manage(django_db, "jobfence_cleanup")
    assert cleaned.returncode == 0, cleaned.stderr
    assert cleaned.stdout == "removed 0 expired fence rows in 1 batch(es)\n"


def test_bad_jobfence_settings_are_refused_with_the_key_named(django_db: str) -> None:
    cases = {
        '{"DATABASE_ALIAS": "jobs"}': "DATABASE_ALIAS 'jobs' is not in settings.DATABASES",
        '{"WORKERS": {}}': "unknown key(s) WORKERS",
        '{"APP": "points.jobs"}': "APP must be 'MODULE:ATTRIBUTE'",
        '{"WORKER": {"CONCURENCY": 2}}': "unknown WORKER key 'CONCURENCY'",
    }
    for extra, message in cases.items():
        done = manage(django_db, "jobfence_worker", DJANGOPROJECT_JOBFENCE=extra)
        assert done.returncode != 0
        assert f"ImproperlyConfigured: settings.JOBFENCE: {message}" in done.stderr, done.stderr


def test_the_database_password_is_never_printed(django_db: str) -> None:
    secret = "Sw0rdfish-4242"
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(django_db)
    params["port"] = "1"  # nothing listens there
    unreachable = make_conninfo("", **params)
    done = manage(unreachable, "jobfence_migrate", DJANGOPROJECT_PASSWORD=secret)
    assert done.returncode != 0
    assert "cannot connect to the database" in done.stderr, done.stderr
    assert secret not in done.stdout + done.stderr

    # a worker that connects: its start-up lines carry no password either
    done = manage(django_db, "jobfence_worker", "--until", "empty", DJANGOPROJECT_PASSWORD=secret)
    assert done.returncode == 0, done.stderr
    assert secret not in done.stdout + done.stderr


def test_the_docs_example_grants_once_per_committed_sign_up(django_db: str, tmp_path: Path) -> None:
    """docs/django.md's complete example, run as written in the test project."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"<!-- example: django-jobs -->\n```python\n(.*?)```", text, re.DOTALL)
    assert match, "docs/django.md has no example django-jobs"
    (tmp_path / "docs_example.py").write_text(match.group(1), encoding="utf-8")
    settings = {"APP": "docs_example:app", "WORKER": {"QUEUES": ["grants"]}}
    env = {"PYTHONPATH": str(tmp_path), "DJANGOPROJECT_JOBFENCE": json.dumps(settings)}
    code = "\n".join(
        [
            "from django.db import transaction",
            "import docs_example",
            "docs_example.sign_up('ann')",
            "docs_example.sign_up('ann')  # retried after a timeout: the same job_id",
            "try:",
            "    with transaction.atomic():",
            "        docs_example.sign_up('bob')",
            "        raise RuntimeError('the view failed after the sign-up')",
            "except RuntimeError:",
            "    pass",
        ]
    )
    shell(django_db, code, **env)
    done = manage(django_db, "jobfence_worker", "--until", "empty", **env)
    assert "worker stopped: duplicate 1, succeeded 1, released 0" in done.stdout, (
        done.stdout + done.stderr
    )
    assert points(django_db, "welcome:ann") == 1
    assert points(django_db, "welcome:bob") == 0


def test_a_handler_that_ends_or_dooms_its_transaction_fails_and_the_worker_goes_on(
    django_db: str,
) -> None:
    """commit/rollback/close are refused before anything is sent (dead letter at once); a
    COMMIT sent as SQL is found after the handler; a caught database error or set_rollback
    leaves nothing to commit (retried, then dead-lettered); the next job runs normally."""
    jobs = [
        (how, {"account": "ann", "amount": 1, "misuse": how})
        for how in ("commit", "close", "commit_sql", "caught", "set_rollback")
    ]
    shell(django_db, enqueue_code(*jobs, ("fine", {"account": "ann", "amount": 1})))
    done = manage(django_db, "jobfence_worker", "--until", "empty", "--concurrency", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "worker stopped: dead_lettered 5, retried 4, succeeded 1, released 0" in done.stdout
    with psycopg.connect(django_db) as conn:
        found = conn.execute("SELECT job_id, attempts, error_class FROM core.dead_letters")
        rows = {r[0]: r[1:] for r in found.fetchall()}
    assert rows == {
        "commit": (1, "jobfence.TransactionMisuse"),
        "close": (1, "jobfence.TransactionMisuse"),
        "commit_sql": (1, "jobfence.TransactionMisuse"),
        "caught": (3, "jobfence.TransactionAborted"),
        "set_rollback": (3, "jobfence.TransactionAborted"),
    }
    # refused before it was sent: nothing committed
    assert points(django_db, "commit") == points(django_db, "close") == 0
    assert points(django_db, "caught") == points(django_db, "set_rollback") == 0
    # the COMMIT statement committed the work with its fence, as its dead letter says
    assert points(django_db, "commit_sql") == 1
    assert points(django_db, "fine") == 1


def test_a_handler_that_rolls_back_and_begins_again_with_sql_applies_nothing_twice(
    django_db: str,
) -> None:
    """A handler that sends ROLLBACK and BEGIN and writes again: the transaction it returns in
    does not hold the fence, so nothing of it commits; the job is dead-lettered, and its
    redelivery is not applied either."""
    job = {"account": "ann", "amount": 1, "misuse": "rollback_begin_sql"}
    shell(django_db, enqueue_code(("again", job), ("again", job), ("fine", job | {"misuse": ""})))
    done = manage(django_db, "jobfence_worker", "--until", "empty", "--concurrency", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "worker stopped: dead_lettered 2, succeeded 1, released 0" in done.stdout, done.stdout
    with psycopg.connect(django_db) as conn:
        found = conn.execute(
            "SELECT job_id, attempts, error_class, last_error FROM core.dead_letters"
        )
        [(job_id, attempts, error_class, last_error)] = found.fetchall()
    assert (job_id, attempts, error_class) == ("again", 1, "jobfence.TransactionMisuse")
    assert "ended the fence transaction itself" in last_error and "began another" in last_error
    assert points(django_db, "again") == 0
    assert points(django_db, "fine") == 1


SWALLOWED = (
    ("swallow_tx_commit", "commit"),
    ("swallow_tx_rollback", "rollback"),
    ("swallow_tx_close", "close"),
    ("swallow_tx_autocommit", "set_autocommit"),
    ("swallow_commit", "commit"),
    ("swallow_rollback", "rollback"),
    ("swallow_set_autocommit", "set_autocommit"),
    ("swallow_close", "close"),
)


def test_a_handler_that_swallows_a_refused_call_is_dead_lettered_with_nothing_applied(
    django_db: str,
) -> None:
    """commit(), rollback(), close() or set_autocommit() on the psycopg connection, and Django's
    transaction.commit(), transaction.rollback(), transaction.set_autocommit() and
    connection.close(): refused, the error caught by the handler, and the job fails all the
    same, nothing of it committed, dead-lettered at once; the next job runs normally."""
    jobs = [(how, {"account": "ann", "amount": 1, "misuse": how}) for how, _ in SWALLOWED]
    shell(django_db, enqueue_code(*jobs, ("fine", {"account": "ann", "amount": 1})))
    done = manage(django_db, "jobfence_worker", "--until", "empty", "--concurrency", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"worker stopped: dead_lettered {len(SWALLOWED)}, succeeded 1, released 0" in (
        done.stdout
    ), done.stdout + done.stderr
    with psycopg.connect(django_db) as conn:
        found = conn.execute(
            "SELECT job_id, attempts, error_class, last_error FROM core.dead_letters"
        )
        rows = {r[0]: r[1:] for r in found.fetchall()}
    for how, what in SWALLOWED:
        attempts, error_class, last_error = rows[how]
        assert (attempts, error_class) == (1, "jobfence.TransactionMisuse"), (how, last_error)
        assert f"do not call {what}()" in last_error, (how, last_error)
        assert points(django_db, how) == 0, how
    assert fences(django_db) == 1
    assert points(django_db, "fine") == 1


def test_a_handler_writing_through_another_alias_is_refused_and_nothing_is_applied(
    django_db: str,
) -> None:
    """With ``JOBFENCE["DATABASE_ALIAS"] = "jobs"`` and the ORM on ``"default"``, the handler's
    save would commit on its own connection, outside the job's transaction: a job failing
    three times left three points. The write is refused before it is sent, the job is
    dead-lettered at once as TransactionMisuse, and nothing of it is applied (a read through
    another alias is allowed: the next test)."""
    code = "\n".join(
        [
            "from django.db import transaction",
            "from jobfence.contrib.django import enqueue",
            "with transaction.atomic(using='jobs'):",
            "    enqueue('award_points', {'account': 'ann', 'amount': 5, 'fail': 'always'},"
            " job_id='elsewhere')",
        ]
    )
    shell(django_db, code, DJANGOPROJECT_JOBS_ALIAS="1")
    done = manage(
        django_db,
        "jobfence_worker",
        "--until",
        "empty",
        "--concurrency",
        "1",
        DJANGOPROJECT_JOBS_ALIAS="1",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "worker stopped: dead_lettered 1, released 0" in done.stdout, done.stdout + done.stderr
    with psycopg.connect(django_db) as conn:
        [(attempts, error_class, last_error)] = conn.execute(
            "SELECT attempts, error_class, last_error FROM core.dead_letters"
        ).fetchall()
    assert (attempts, error_class) == (1, "jobfence.TransactionMisuse"), last_error
    assert last_error.startswith(
        "jobfence.TransactionMisuse: a handler wrote through the database alias 'default',"
        " outside the job's transaction on 'jobs'"
    ), last_error
    assert points(django_db) == 0
    assert fences(django_db) == 0


@pytest.mark.parametrize(
    ("sql", "writes"),
    [
        ('SELECT "points_point"."id" FROM "points_point"', False),
        ("  /* hint */ select 1", False),
        ("(SELECT 1) UNION (SELECT 2)", False),
        ("SHOW TimeZone", False),
        ("WITH t AS (SELECT 1) SELECT * FROM t", False),
        ("EXPLAIN SELECT 1", False),
        ('INSERT INTO "points_point" ("job_id") VALUES (%s)', True),
        ('UPDATE "points_point" SET "amount" = 1', True),
        ("delete from points_point", True),
        ("WITH gone AS (DELETE FROM points_point RETURNING id) SELECT count(*) FROM gone", True),
        ("EXPLAIN ANALYZE UPDATE points_point SET amount = 1", True),
        ("SET search_path TO x", True),
        ("-- only a comment", True),
    ],
)
def test_what_a_handler_may_run_through_another_alias_is_a_plain_read(
    sql: str, writes: bool
) -> None:
    from jobfence.contrib.django.runner import writes as may_write

    assert may_write(sql) is writes


def test_a_root_console_handler_in_logging_prints_each_worker_line_once(django_db: str) -> None:
    """docs/django.md's LOGGING (a root console handler, no formatter) as the project's: the
    worker logs through it, adds no handler of its own, and so prints each line once."""
    shell(django_db, enqueue_code(("logged", {"account": "ann", "amount": 1, "fail": "always"})))
    done = manage(django_db, "jobfence_worker", "--until", "empty", DJANGOPROJECT_ROOT_LOGGING="1")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    started = [line for line in lines if "worker started: queues points" in line]
    assert started == ["worker started: queues points, concurrency 2"], done.stderr
    retried = [line for line in lines if "job logged for award_points failed (attempt 1" in line]
    assert len(retried) == 1 and retried[0].startswith("job logged"), done.stderr
    dead = [line for line in lines if "dead-lettered after 3 attempt(s)" in line]
    assert len(dead) == 1 and dead[0].startswith("job logged"), done.stderr


def test_group_commit_runs_a_group_in_one_atomic_block_and_a_failure_alone(
    django_db: str,
) -> None:
    ids = ["b-0", "b-1", "b-2", "b-0", "b-bad", "b-3"]
    code = "\n".join(
        [
            "from django.db import transaction",
            "from jobfence.contrib.django import enqueue",
            "with transaction.atomic():",
            *[
                f"    enqueue('bulk_award', {{'account': 'ann', 'amount': 1,"
                f" 'fail': {'hard' if j == 'b-bad' else ''!r}}}, job_id={j!r})"
                for j in ids
            ],
        ]
    )
    shell(django_db, code)
    done = manage(
        django_db, "jobfence_worker", "--until", "empty", "--queue", "bulk", "--batch-size", "6"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "worker started: queues bulk, concurrency 2" in done.stderr  # --queue replaced QUEUES
    assert "dead_lettered 1, duplicate 1, " in done.stdout, done.stdout
    assert "succeeded 4" in done.stdout, done.stdout
    assert "a group of 5 jobs rolled back (jobfence.HardFailure" in done.stderr
    for job_id in ("b-0", "b-1", "b-2", "b-3"):
        assert points(django_db, job_id) == 1
    assert points(django_db, "b-bad") == 0
    assert fences(django_db) == 4


async def test_a_database_blip_pauses_the_django_worker_and_every_job_runs_once(
    django_db: str, tmp_path: Path
) -> None:
    """The network to PostgreSQL is cut while ORM handlers hold their transactions open: the
    worker pauses instead of spending the jobs' retries, Django's connections are replaced,
    and when the network is back every job has exactly one effect and none is dead-lettered."""
    import asyncio

    from support import wait_until
    from tcp_proxy import tcp_proxy

    ids = [f"blip-{i}" for i in range(4)]
    payload = {"account": "ann", "amount": 1, "pause_seconds": 1.0}
    await asyncio.to_thread(shell, django_db, enqueue_code(*[(j, payload) for j in ids]))
    log = tmp_path / "worker.log"
    async with tcp_proxy(django_db) as proxy:
        worker = start_worker(proxy.url(django_db), log, "--concurrency", "2")
        try:

            async def in_handlers() -> bool:
                query = (
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND state = 'idle in transaction'"
                )
                return bool(await asyncio.to_thread(one, django_db, query) >= 2)

            await wait_until(in_handlers, timeout=30, message="two ORM handlers at work")
            proxy.down()

            async def noticed() -> bool:
                return b"database went away" in log.read_bytes()

            await wait_until(noticed, timeout=30, message=f"the outage noticed:\n{log.read_text()}")
            proxy.up()

            async def done() -> bool:
                left = "SELECT count(*) FROM jobfence_queue.messages"
                return bool(await asyncio.to_thread(one, django_db, left) == 0)

            await wait_until(done, timeout=60, message=f"every job done:\n{log.read_text()}")
        finally:
            worker.send_signal(signal.SIGTERM)
            await asyncio.to_thread(worker.wait, 60)
    for job_id in ids:
        assert points(django_db, job_id) == 1, log.read_text()
    assert one(django_db, "SELECT count(*) FROM core.dead_letters") == 0, log.read_text()
    assert fences(django_db) == 4
