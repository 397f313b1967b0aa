"""``jobfence dead-letters``: list, show, replay, replay-bulk and discard dead letters.

Like the HTTP API, this edge only parses, calls :mod:`jobfence.ops` and formats; it holds no
logic of its own. Exit status: 0 done; 1 the dead letter (or bulk run) does not exist, is no
longer ``pending_review``, or a bulk run has failed or unfinished items; 2 a request that cannot be
served as asked (bad argument, bad cursor, too many items), or any other jobfence error. Every
error is one line on stderr, ``jobfence: error: ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any, NoReturn

from psycopg_pool import AsyncConnectionPool

from jobfence import db, ops, schema
from jobfence.codec import PAYLOAD_BASE64, MalformedPayload, original_body
from jobfence.config import secrets_from_env
from jobfence.errors import DeadLetterConflict, DeadLetterNotFound
from jobfence.ops import BulkReplay, BulkTooLarge, DeadLetterFilter, InvalidCursor, InvalidRequest
from jobfence.queues import add_queue_url_option
from jobfence.redact import printable, redact_text

ENV_ACTOR = "JOBFENCE_ACTOR"
EXIT_REFUSED = 1  # not found, not pending, failed or unfinished bulk items
EXIT_INVALID = 2  # a request that cannot be served as asked
CELL_WIDTH = 48  # longer table cells are cut (the --json output keeps them whole)
PAYLOAD_SHOWN = 4096  # characters of a payload (of each part) that show prints without --full
FAILED_SHOWN = 20  # failed bulk items listed in the readable summary

Command = Callable[[argparse.Namespace], Awaitable[int]]


def usage_error(message: str) -> str:
    """argparse's message about a usage mistake, with the secrets of any URL or
    ``password=``-like pair it quotes (an argument typed in the wrong place) and the configured
    secrets shown as ``***``, as in every other error line."""
    return redact_text(message, secrets_from_env())


class _OneLineParser(argparse.ArgumentParser):
    """Usage mistakes as one line, like every other error a person can cause."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("jobfence ")
        self.exit(2, f"jobfence: error: {command}: {usage_error(message)}\n")


# --- parsing ------------------------------------------------------------------------------


_MAX_BIGINT = 2**63 - 1
SHOWN_ARGUMENT = 80  # characters of a refused argument that its error quotes


def _as_typed(text: str) -> str:
    """An argument as a person typed it, quoted for an error line: a byte that is not UTF-8
    as ``\\xff`` (Python passes it on as a lone surrogate), control characters escaped, cut
    at ``SHOWN_ARGUMENT`` characters."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no byte of argv gives (main() called with it)
        raw = text.encode("utf-8", "backslashreplace")
    shown = printable(raw.decode("utf-8", "backslashreplace"))
    if len(shown) > SHOWN_ARGUMENT:
        shown = shown[: SHOWN_ARGUMENT - 3] + "..."
    return f"'{shown}'"


def text_argument(text: str) -> str:
    """An argparse type for a free-text argument (a name, a filter, a reason, a host, a URL,
    a file name): refused when it is not valid UTF-8 or holds a NUL character, which neither
    PostgreSQL nor a log line nor a terminal takes (the HTTP API refuses both too). Every
    command's text arguments take it (``jobfence.cli`` too)."""
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"{_as_typed(text)} holds a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{_as_typed(text)} is not valid UTF-8") from None
    return text


def _digits(text: str) -> int | None:
    """``text`` as a whole number when it is ASCII digits only, as the HTTP API reads one;
    else None (``int()`` also reads Arabic-Indic or fullwidth digits, ``+1``, `` 1``, ``1_0``)."""
    if not (text.isascii() and text.isdigit()):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than int() converts
        return None


def _positive_id(what: str) -> Callable[[str], int]:
    """An argparse type for a database id (an integer >= 1), naming ``what`` in its error."""

    def parse(text: str) -> int:
        value = _digits(text) or 0
        if not 1 <= value <= _MAX_BIGINT:  # ids are PostgreSQL bigints
            raise argparse.ArgumentTypeError(f"not a {what} id: {text!r}")
        return value

    return parse


def _count(text: str) -> int:
    """An argparse type for ``--max-items``: a count from 1 to what a bulk run may be given."""
    value = _digits(text) or 0
    if not 1 <= value <= ops.MAX_BULK_ITEMS:
        raise argparse.ArgumentTypeError(
            f"not a whole number from 1 to {ops.MAX_BULK_ITEMS}: {text!r}"
        )
    return value


def _page_size(text: str) -> int:
    """An argparse type for ``--limit``: ASCII digits (ops refuses a value out of its range)."""
    value = _digits(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"not a whole number from 1 to {ops.MAX_PAGE}: {text!r}")
    return value


_dead_letter_id = _positive_id("dead letter")
_run_id = _positive_id("bulk replay")


def _timestamp(text: str) -> datetime:
    """ISO 8601 (a date, or a date and time); without an offset it is UTC (ops.parse_time)."""
    text_argument(text)
    try:
        return ops.parse_time(text)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def _group_keys(text: str) -> list[str]:
    text_argument(text)
    return [key.strip() for key in text.split(",")]


def _add_filters(p: argparse.ArgumentParser, *, status: bool) -> None:
    g = p.add_argument_group("filters (every one given must match)")
    if status:
        g.add_argument("--status", choices=ops.STATUSES, help="this status only")
    g.add_argument("--queue", type=text_argument, help="this queue only")
    g.add_argument("--consumer", type=text_argument, help="this consumer only")
    g.add_argument("--tenant", type=text_argument, metavar="TENANT_ID", help="this tenant_id only")
    g.add_argument("--error-class", type=text_argument, help="this error_class only")
    g.add_argument("--job-id", type=text_argument, help="this job_id only")
    g.add_argument("--correlation-id", type=text_argument, help="this correlation_id only")
    g.add_argument(
        "--since",
        type=_timestamp,
        metavar="TIME",
        help="created at or after TIME (ISO 8601 date or date-time; UTC without an offset)",
    )
    g.add_argument(
        "--until",
        type=_timestamp,
        metavar="TIME",
        help="created before TIME (ISO 8601 date or date-time; UTC without an offset)",
    )


def _filter(args: argparse.Namespace) -> DeadLetterFilter:
    return DeadLetterFilter(
        status=getattr(args, "status", None),
        queue=args.queue,
        consumer=args.consumer,
        tenant_id=args.tenant,
        error_class=args.error_class,
        job_id=args.job_id,
        correlation_id=args.correlation_id,
        created_from=args.since,
        created_to=args.until,
    )


def _add_actor(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--actor",
        type=text_argument,
        metavar="NAME",
        help=f"who does it, recorded as resolved_by (default: ${ENV_ACTOR}, else the OS user)",
    )


def _actor(args: argparse.Namespace) -> str:
    if args.actor is not None:
        if not str(args.actor).strip():
            raise InvalidRequest("--actor must name who does it, not a blank string")
        return str(args.actor)
    from_env = os.environ.get(ENV_ACTOR, "").strip()
    if from_env:
        return _text_from(from_env, f"${ENV_ACTOR}")
    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        raise InvalidRequest(
            f"cannot tell who you are: pass --actor NAME or set {ENV_ACTOR}"
        ) from None
    return _text_from(user, "the OS user name")


def _text_from(text: str, source: str) -> str:
    """``text`` from the environment, refused as :func:`text_argument` refuses an argument."""
    try:
        return text_argument(text)
    except argparse.ArgumentTypeError as exc:
        raise InvalidRequest(f"{source}: {exc}; pass --actor NAME") from None


def add_parser(sub: Any) -> None:
    """Register ``dead-letters`` on the ``jobfence`` command's subparsers."""
    group = sub.add_parser(
        "dead-letters",
        help="list, show, replay (one or in bulk) and discard dead letters",
        description="Review dead letters: list, show, replay (one or in bulk) and discard. "
        "Replays publish to the queue (JOBFENCE_QUEUE_URL or --queue-url; a broker's through the "
        "outbox). See docs/runbooks/dead-letter-replay.md.",
    )
    commands = group.add_subparsers(
        dest="dead_letters_command",
        metavar="COMMAND",
        required=True,
        parser_class=_OneLineParser,
    )

    p = commands.add_parser(
        "list", help="dead letters, newest first, a page at a time (or counts per group)"
    )
    _add_filters(p, status=True)
    p.add_argument(
        "--limit",
        type=_page_size,
        default=ops.DEFAULT_PAGE,
        help="rows (or groups) per page (50, max 500)",
    )
    p.add_argument("--cursor", type=text_argument, help="the next cursor a previous page printed")
    p.add_argument(
        "--group-by",
        type=_group_keys,
        metavar="KEYS",
        help="instead of rows, count pending dead letters per group of KEYS: "
        "queue, consumer, error_class, or several comma-separated",
    )
    p.add_argument("--json", action="store_true", help="one JSON document {items, next_cursor}")
    p.set_defaults(func=_guarded(_cmd_list))

    p = commands.add_parser(
        "show",
        help="one dead letter, its payload cut at 4 KiB unless --full",
        description="One dead letter. The payload is shown up to its first "
        f"{PAYLOAD_SHOWN:,} characters (each part of a base64 payload too), then how many bytes "
        "were left out; --full prints it whole, --payload-out FILE writes it to a new file. "
        "--json is never cut.",
    )
    p.add_argument("id", type=_dead_letter_id, metavar="ID")
    p.add_argument("--full", action="store_true", help="print the whole payload, however large")
    p.add_argument(
        "--payload-out",
        type=text_argument,
        metavar="FILE",
        help="write the payload to FILE, a new file: the bytes a replay publishes (a base64 "
        "payload's original bytes, else the stored JSON text)",
    )
    p.add_argument("--json", action="store_true", help="one JSON document, payload whole")
    p.set_defaults(func=_guarded(_cmd_show))

    p = commands.add_parser("replay", help="republish one pending dead letter (same job_id)")
    p.add_argument("id", type=_dead_letter_id, metavar="ID")
    _add_actor(p)
    add_queue_url_option(p)
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.set_defaults(func=_guarded(_cmd_replay))

    p = commands.add_parser(
        "replay-bulk",
        help="replay every pending dead letter matching the filters, on a fixed snapshot",
        description="Replay the pending_review dead letters matching the filters at the moment "
        "of the call (a fixed snapshot), in chunks; an interrupted run resumes with --resume.",
    )
    _add_filters(p, status=False)
    p.add_argument(
        "--all",
        action="store_true",
        dest="select_all",
        help="every pending dead letter, poison included (takes no filter; without a filter, "
        "replay-bulk refuses unless given)",
    )
    p.add_argument("--dry-run", action="store_true", help="print how many match; change nothing")
    p.add_argument(
        "--max-items",
        type=_count,
        default=None,
        help=f"refuse when more match ({ops.DEFAULT_BULK_MAX})",
    )
    p.add_argument(
        "--resume", type=_run_id, metavar="RUN_ID", help="finish an interrupted run (no filters)"
    )
    _add_actor(p)
    add_queue_url_option(p)
    p.add_argument("--json", action="store_true", help="one JSON document with the final result")
    p.set_defaults(func=_guarded(_cmd_replay_bulk))

    p = commands.add_parser("discard", help="give up one pending dead letter, with a reason")
    p.add_argument("id", type=_dead_letter_id, metavar="ID")
    p.add_argument(
        "--reason",
        type=text_argument,
        required=True,
        help="why (required, non-blank, at most 2000)",
    )
    _add_actor(p)
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.set_defaults(func=_guarded(_cmd_discard))


def _guarded(command: Command) -> Command:
    """A missing dead letter or bulk run, or a dead letter no longer pending, is one line and
    exit status 1; a request refused by :mod:`jobfence.ops` is worded with this command's flags,
    exit status 2."""

    async def run(args: argparse.Namespace) -> int:
        try:
            return await command(args)
        except (DeadLetterNotFound, DeadLetterConflict, ops.BulkReplayNotFound) as exc:
            return report_error(str(exc), EXIT_REFUSED, as_json=args.json)
        except (InvalidRequest, BulkTooLarge) as exc:
            return report_error(_in_flags(exc), EXIT_INVALID, as_json=args.json)

    return run


# ops names the parameters of its functions (the HTTP API's too); here a person typed flags.
_FLAGS = {
    "limit": "--limit",
    "created_from": "--since",
    "created_to": "--until",
    "max_items": "--max-items",
    "requested_by": "--actor",
}
_PARAMETER = re.compile(r"\b(" + "|".join(_FLAGS) + r")\b")


# ops' refusals of a bulk selection, in this CLI's words.
BULK_ALL_NEEDED = (
    "no filter given: a bulk replay of every pending dead letter (poison included) must be "
    "asked for explicitly with --all"
)
BULK_ALL_WITH_FILTER = (
    "a filter and --all contradict each other: --all selects every pending dead letter;"
    " give either filters or --all"
)
_BULK_ALL = {ops.BULK_ALL_NEEDED: BULK_ALL_NEEDED, ops.BULK_ALL_WITH_FILTER: BULK_ALL_WITH_FILTER}


def _in_flags(exc: InvalidRequest | BulkTooLarge) -> str:
    """The message of a request refused by :mod:`jobfence.ops`, in terms of this CLI's flags."""
    if isinstance(exc, InvalidRequest) and str(exc) in _BULK_ALL:
        return _BULK_ALL[str(exc)]
    if isinstance(exc, InvalidCursor):
        return (
            "--cursor is not one that jobfence dead-letters list printed: pass the value after "
            "'next cursor:' whole"
        )
    if isinstance(exc, BulkTooLarge):
        return (
            f"{exc.matching} pending dead letters match, more than --max-items {exc.max_items}:"
            " narrow the filters or raise --max-items"
        )
    if exc.field in _FLAGS:  # the message names ops' parameters: name the flags instead
        return _PARAMETER.sub(lambda m: _FLAGS[m[1]], str(exc))
    return str(exc)


# --- formatting ---------------------------------------------------------------------------


def _shown_error(text: str) -> str:
    """An error's text as a command shows it: one line, control characters escaped, and no
    configured secret (a client library's error may quote a URL, or a piece of one)."""
    return redact_text(printable(" ".join(text.split())), secrets_from_env())


def report_error(message: str, exit_code: int, *, as_json: bool) -> int:
    """An error a command ends with: one line on stderr and, for a ``--json`` command, the JSON
    object ``{"error": message, "exit_code": exit_code}`` on stdout (the same text, escaped and
    without secrets); returns ``exit_code``."""
    shown = _shown_error(message)
    print(f"jobfence: error: {shown}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": shown, "exit_code": exit_code}), flush=True)
    return exit_code


def _json_default(value: object) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def terminal_json(document: object, **dump: Any) -> str:
    """``document`` as JSON for a terminal: text readable as written (``ensure_ascii=False``),
    except that every character that is not printable (C1 controls, line and paragraph
    separators, bidi overrides...; json already escapes C0 controls) is a ``\\u`` escape,
    never written raw: the JSON reads back the same, and no value can move the cursor or start
    a line of its own."""
    text = json.dumps(document, ensure_ascii=False, **dump)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == "\n" else json.dumps(ch)[1:-1] for ch in text)


def _print_json(document: object) -> None:
    print(terminal_json(document, default=_json_default, indent=2))


def _when(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return _when(value)
    text = printable(str(value))
    return text if len(text) <= CELL_WIDTH else text[: CELL_WIDTH - 3] + "..."


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = [headers, *cells]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def _counts(run: BulkReplay) -> str:
    c = run.counts
    return (
        f"replayed {c['replayed']}, already processed {c['already_processed']}, "
        f"not pending {c['not_pending']}, failed {c['failed']}"
    )


def _processed(run: BulkReplay) -> int:
    return run.total - run.counts["pending"]


# --- commands -----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _pool() -> AsyncIterator[AsyncConnectionPool[Any]]:
    pool = await db.open_pool(
        db.resolve_database_url(),
        min_size=1,
        max_size=2,
        name="jobfence-dead-letters",
        large_reads=True,
    )
    try:
        async with pool.connection() as conn:
            await schema.ensure_migrated(conn)
        yield pool
    finally:
        await pool.close()


LIST_COLUMNS = (
    "id",
    "created_at",
    "status",
    "queue",
    "consumer",
    "error_class",
    "attempts",
    "job_id",
    "correlation_id",
)


async def _cmd_list(args: argparse.Namespace) -> int:
    flt = _filter(args)
    if args.group_by is not None:
        if args.cursor:
            raise InvalidRequest("--cursor pages through rows, not --group-by counts")
        return await _list_groups(args, flt)
    async with _pool() as pool, pool.connection() as conn:
        page = await ops.list_dead_letters(conn, flt, limit=args.limit, cursor=args.cursor)
    if args.json:
        _print_json({"items": [asdict(i) for i in page.items], "next_cursor": page.next_cursor})
        return 0
    if not page.items:
        print("no dead letters match")
    else:
        rows = [[getattr(item, c) for c in LIST_COLUMNS] for item in page.items]
        print(_table(LIST_COLUMNS, rows))
    if page.next_cursor:
        print(f"next cursor: {page.next_cursor}")
    elif page.items:
        print("(last page)")
    return 0


async def _list_groups(args: argparse.Namespace, flt: DeadLetterFilter) -> int:
    async with _pool() as pool, pool.connection() as conn:
        groups = await ops.group_pending(conn, flt, by=args.group_by, limit=args.limit)
    if args.json:
        _print_json({"groups": [asdict(g) for g in groups]})
        return 0
    if not groups:
        print("no pending dead letters match")
        return 0
    keys = [k for k in ops.GROUP_KEYS if k in args.group_by]
    headers = [*keys, "pending", "oldest", "newest"]
    rows = [[*(getattr(g, k) for k in keys), g.pending, g.oldest, g.newest] for g in groups]
    print(_table(headers, rows))
    if len(groups) == args.limit:
        print(f"(the {args.limit} largest groups; raise --limit for more)")
    return 0


def _cut(text: str, full: bool) -> tuple[str, int]:
    """``text``, or its first ``PAYLOAD_SHOWN`` characters unless ``full``; and how many UTF-8
    bytes of it were left out."""
    if full or len(text) <= PAYLOAD_SHOWN:
        return text, 0
    return text[:PAYLOAD_SHOWN], len(text[PAYLOAD_SHOWN:].encode("utf-8", "surrogatepass"))


def _payload_lines(payload: Any, encoding: str, *, full: bool) -> tuple[list[str], int]:
    """The payload as shown, and how many bytes of it were left out (``full``: none)."""
    try:
        body = original_body(json.dumps(payload), encoding) if encoding == PAYLOAD_BASE64 else b""
    except MalformedPayload as exc:  # a row written by hand: shown as it is stored
        encoding, note = "", f" (not what its payload_encoding {encoding!r} says: {exc})"
    else:
        note = ""
    if encoding != PAYLOAD_BASE64:
        shown, left = _cut(terminal_json(payload, indent=2), full)
        return [f"payload:{note}", shown], left
    data, left = _cut(str(payload.get("data", "")), full)
    lines = [
        f"payload: {len(body)} bytes kept as base64 ({payload.get('note', 'not JSON')})",
        f"  base64: {data}",
    ]
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(ch.isprintable() or ch in "\n\r\t" for ch in text):
        decoded, cut = _cut(text, full)
        lines += ["  decoded:", decoded]
    else:
        escaped, cut = _cut(printable(body.decode("utf-8", errors="backslashreplace")), full)
        lines.append(f"  decoded (not printable as text, escaped): {escaped}")
    return lines, left + cut


async def _cmd_show(args: argparse.Namespace) -> int:
    async with _pool() as pool, pool.connection() as conn:
        detail = await ops.show_dead_letter(conn, args.id)
        body = None if args.payload_out is None else await ops.payload_body(conn, args.id)
    if body is not None:
        _write_payload(args.payload_out, body)
    letter = detail.dead_letter
    if args.json:
        _print_json(
            {**asdict(letter), "trace_id": letter.trace_id, "fence_exists": detail.fence_exists}
        )
        return 0
    fence = (
        "yes: this job's work has committed; a replay would not republish it"
        if detail.fence_exists
        else "no"
    )
    fields: list[tuple[str, object]] = [
        ("status", letter.status),
        ("job_id", letter.job_id),
        ("queue", letter.queue),
        ("consumer", letter.consumer),
        ("tenant_id", letter.tenant_id),
        ("correlation_id", letter.correlation_id),
        ("attempts", letter.attempts),
        ("error_class", letter.error_class),
        ("created_at", letter.created_at.isoformat()),
        ("resolved_at", letter.resolved_at.isoformat() if letter.resolved_at else None),
        ("resolved_by", letter.resolved_by),
        ("discard_reason", letter.discard_reason),
        ("payload_encoding", letter.payload_encoding),
        ("fence_exists", fence),
        ("trace_id", letter.trace_id),
    ]
    print(f"dead letter {letter.id}")
    for name, value in fields:
        shown = "-" if value is None else printable(str(value))
        print(f"  {name + ':':<18}{shown}")
    lines, left_out = _payload_lines(letter.payload, letter.payload_encoding, full=args.full)
    print("\n".join(lines))
    if left_out:
        print(
            f"... {left_out:,} more bytes of the payload not shown; --full prints everything, "
            "--payload-out FILE writes the payload"
        )
    if body is not None:
        print(f"payload written to {args.payload_out} ({len(body):,} bytes)")
    print("last_error:")
    print("\n".join(printable(line) for line in (letter.last_error or "").split("\n")))
    return 0


def _write_payload(path: str, body: bytes) -> None:
    """Write ``body`` to a new file ``path`` (an existing file is never overwritten)."""
    try:
        with open(path, "xb") as out:
            out.write(body)
    except FileExistsError:
        raise InvalidRequest(
            f"--payload-out {path}: the file exists; name a new file (nothing is overwritten)"
        ) from None
    except OSError as exc:
        raise InvalidRequest(f"--payload-out {path}: cannot write it: {exc.strerror}") from None


def _request_error(exc: ValueError) -> InvalidRequest:
    return InvalidRequest(str(exc))


async def _cmd_replay(args: argparse.Namespace) -> int:
    from jobfence.queues import queue_from_env

    actor = _actor(args)
    async with _pool() as pool, queue_from_env(pool) as queue:
        try:
            result = await ops.replay(pool, queue, args.id, actor=actor)
        except ValueError as exc:  # a blank actor
            raise _request_error(exc) from None
    m = result.message
    if args.json:
        _print_json(
            {
                "dead_letter_id": result.dead_letter_id,
                "published": result.published,
                "already_processed": result.already_processed,
                "queue": m.queue,
                "consumer": m.consumer,
                "job_id": m.job_id,
                "tenant_id": m.tenant_id,
                "correlation_id": m.correlation_id,
                "body_size": len(m.body),
            }
        )
        return 0
    what = f"job {printable(m.job_id)} for consumer {printable(m.consumer)}"
    if result.published:
        print(
            f"dead letter {result.dead_letter_id} replayed: published {what} to queue "
            f"{printable(m.queue)} ({len(m.body)} bytes, correlation_id "
            f"{printable(m.correlation_id or '-')})"
        )
    else:
        print(
            f"dead letter {result.dead_letter_id} replayed: already processed: not republished "
            f"({what} has its fence row)"
        )
    return 0


async def _cmd_discard(args: argparse.Namespace) -> int:
    actor = _actor(args)
    async with _pool() as pool:
        try:
            letter = await ops.discard(pool, args.id, reason=args.reason, actor=actor)
        except ValueError as exc:  # a blank or overlong reason, a blank actor
            raise _request_error(exc) from None
    if args.json:
        _print_json(asdict(letter))
        return 0
    print(
        f"dead letter {letter.id} discarded (job {printable(letter.job_id)}, consumer "
        f"{printable(letter.consumer)}) by {printable(letter.resolved_by or '-')}: "
        f"{printable(letter.discard_reason or '')}"
    )
    return 0


def _print_progress(run: BulkReplay) -> None:
    print(
        f"bulk replay {run.id}: {_processed(run)}/{run.total} processed ({_counts(run)})",
        file=sys.stderr,
        flush=True,
    )


async def _failed_items(pool: AsyncConnectionPool[Any], run_id: int) -> list[ops.BulkItem]:
    items: list[ops.BulkItem] = []
    async with pool.connection() as conn:
        while True:
            after = items[-1].dead_letter_id if items else 0
            page = await ops.list_bulk_items(conn, run_id, result="failed", after=after, limit=500)
            items += page
            if len(page) < 500:
                return items


async def _cmd_replay_bulk(args: argparse.Namespace) -> int:
    from jobfence.queues import queue_from_env

    flt = _filter(args)
    if args.resume is not None:
        given = [
            name
            for name, value in (
                ("filters", flt.to_json()),
                ("--all", args.select_all),
                ("--dry-run", args.dry_run),
                ("--max-items", args.max_items is not None),
            )
            if value
        ]
        if given:
            raise InvalidRequest(
                f"--resume continues a run on its own snapshot: it takes no {', '.join(given)}"
            )
    else:  # refused before connecting (start_bulk_replay checks the same)
        ops.check_bulk_selection(flt, select_all=args.select_all)
    max_items = ops.DEFAULT_BULK_MAX if args.max_items is None else args.max_items
    actor = _actor(args)
    async with _pool() as pool, contextlib.AsyncExitStack() as stack:
        if not args.dry_run:  # a bad or unreachable queue is refused before a run starts
            queue = await stack.enter_async_context(queue_from_env(pool))
        if args.dry_run:
            matching = await ops.start_bulk_replay(
                pool,
                flt,
                max_items=max_items,
                requested_by=actor,
                dry_run=True,
                select_all=args.select_all,
            )
            assert isinstance(matching, int)
            if args.json:
                _print_json({"dry_run": True, "matching": matching, "max_items": max_items})
                return 0
            print(f"dry run: {matching} pending dead letters match; nothing changed")
            if matching > max_items:
                print(f"a run would be refused: more than --max-items {max_items}")
            return 0
        if args.resume is not None:
            async with pool.connection() as conn:
                run = await ops.get_bulk_replay(conn, args.resume)
            verb = "resuming"
        else:
            started = await ops.start_bulk_replay(
                pool, flt, max_items=max_items, requested_by=actor, select_all=args.select_all
            )
            assert isinstance(started, BulkReplay)
            run = started
            verb = "started"
        print(
            f"bulk replay {run.id} {verb}: {run.total} dead letters in its snapshot, "
            f"{run.counts['pending']} to process (if interrupted: jobfence dead-letters "
            f"replay-bulk --resume {run.id})",
            file=sys.stderr,
            flush=True,
        )
        final = await ops.run_bulk_replay(
            pool, queue, run.id, actor=actor, on_progress=_print_progress
        )
        failed = await _failed_items(pool, run.id)
    unfinished = final.counts["pending"] > 0
    if args.json:
        _print_json(
            {
                "run": asdict(final),
                "failed_items": [asdict(i) for i in failed],
                "finished": final.status == "finished",
            }
        )
    else:
        state = "finished" if final.status == "finished" else "not finished"
        print(
            f"bulk replay {final.id} {state}: {_processed(final)}/{final.total} processed "
            f"({_counts(final)})"
        )
        for item in failed[:FAILED_SHOWN]:
            print(f"  failed: dead letter {item.dead_letter_id}: {printable(item.detail or '')}")
        if len(failed) > FAILED_SHOWN:
            print(f"  ... and {len(failed) - FAILED_SHOWN} more failed (--json lists them all)")
        if unfinished:
            print(
                f"{final.counts['pending']} items are still pending (locked by another "
                f"process?): jobfence dead-letters replay-bulk --resume {final.id}"
            )
    return EXIT_REFUSED if failed or unfinished else 0
