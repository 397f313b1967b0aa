"""A queue on Redis Streams with consumer groups (``pip install 'jobfence[redis]'``).

Each jobfence queue is one stream, ``<prefix>:{<queue>}:stream``, read by one consumer group
(``jobfence``); every adapter instance is a consumer of its own in that group.

- **Lease**: a delivered entry sits in the group's pending entries list (PEL) under this
  consumer. A receiver claims (``XAUTOCLAIM``) entries that stayed pending longer than its own
  ``lease_seconds``, so a hung or dead holder loses the entry after that idle time. All workers
  of a queue should use the same lease. ``extend`` restarts the idle time (``XCLAIM`` to the same
  consumer with ``JUSTID``, which does not raise the delivery count).
- **Taken back**: every ``_TAKE_BACK_EVERY_SECONDS``, a receive claims again the entries pending
  to its own consumer, idle for ``_TAKE_BACK_IDLE_MS``, that none of its deliveries holds: those
  of a read whose reply the network lost (the read failed, and Redis made its entries pending
  all the same), or of an earlier process with the same ``consumer_name``. They do not wait
  out the lease.
- **Attempt**: the PEL's delivery count (``times_delivered``, kept by Redis and raised by each
  claim), plus the deliveries of earlier entries of the same job (the ``prior`` field, written
  when a retry or release republishes the job as a new entry, or by a publish with
  ``prior_attempts``). Every field is read once, with its bounds, by ``read_delivery``: an
  entry whose field does not parse is a delivery marked ``unreadable`` (the harness
  dead-letters it, whole), and a release copies it with its fields as they were.
- **Stale receipts**: ack, extend, retry and release each run as one Lua script that first
  checks the PEL: the entry must still be pending for this consumer with the delivery count the
  receipt saw.
- **Delays**: Redis Streams has no delayed delivery, and the adapter keeps none of its own:
  ``capabilities.delayed_publish`` and ``delayed_retry`` are False, and a publish or a retry
  with a delay is refused. A delayed enqueue, and a retry with a delay (the harness writes it),
  wait in the PostgreSQL outbox until due; the outbox relay then publishes them here.
- **Trimming**: an acked entry is deleted (``XDEL``) by the same script that acks it, so the
  stream holds only live entries and never needs a ``MAXLEN`` trim that could drop an unacked
  one. Run Redis with AOF (``appendonly yes``) so an acked job never comes back after a restart
  and a published one is not lost.
- **The server's settings** are read once per instance, before its first use of a stream
  (``INFO memory`` and ``INFO persistence``, which work where ``CONFIG`` is disabled): a
  ``maxmemory-policy`` that evicts any key (``allkeys-*``) with a ``maxmemory`` set is refused
  (Redis would delete a whole stream under memory pressure, every job in it lost with no dead
  letter); AOF off is one WARNING per process. A Redis out of memory (``noeviction``: ``OOM``
  on a write) is ``QueueUnavailable`` saying so: every publish would be refused alike.

The keys of one queue share the hash tag ``{<queue>}``, so on Redis Cluster they live in one
slot and each Lua script touches one node.

Not transactional: ``publish`` and ``ack`` refuse a database transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, ParamSpec, TypeVar

from psycopg import AsyncConnection

from jobfence.adapters._shared import (
    FieldNames,
    check_prior_attempts,
    read_delivery,
    receipt_of,
    refuse_delay,
    refuse_tx,
)
from jobfence.adapters._unavailable import as_unavailable
from jobfence.errors import ConfigError, PublishRefused, QueueUnavailable
from jobfence.limits import checked_delay, shown_value
from jobfence.model import Delivery, Message, Outgoing
from jobfence.ports import QueueCapabilities, QueueSize

try:
    import redis.asyncio as aioredis
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import NoScriptError, OutOfMemoryError, ResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "jobfence.adapters.redis_streams needs redis: pip install 'jobfence[redis]'"
    ) from exc

log = logging.getLogger("jobfence.adapters.redis_streams")

P = ParamSpec("P")
T = TypeVar("T")

# redis-py's ConnectionError and TimeoutError (a dropped, refused or timed-out connection): the
# broker is unreachable (D7).
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError)


def _out_of_memory(exc: BaseException) -> QueueUnavailable | None:
    """``exc`` as ``QueueUnavailable`` when it is Redis's refusal of a write at its
    ``maxmemory`` (``OOM command not allowed when used memory > 'maxmemory'``, under
    ``noeviction``): every message would be refused alike until memory is freed, so the relay
    backs off as for an outage, and the text says what it is (Redis is not unreachable)."""
    if not isinstance(exc, ResponseError):
        return None
    if not isinstance(exc, OutOfMemoryError) and not str(exc).startswith("OOM"):
        return None
    full = QueueUnavailable(
        f"Redis is out of memory: it refuses new entries at its maxmemory ({exc}); the"
        " messages wait in the outbox until memory is freed (workers acking the queued jobs)"
        " or maxmemory is raised (CONFIG SET maxmemory, or your provider's setting)"
    )
    full.__cause__ = exc
    return full


def _as_unavailable(exc: Exception) -> Exception:
    """``exc`` as the port reports it: a lost connection or a timeout is ``QueueUnavailable``
    (``Redis unreachable: ...``), and so is Redis out of memory (saying so)."""
    return _out_of_memory(exc) or as_unavailable("Redis", _UNREACHABLE, exc)


def _unavailable(method: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """Decorate a port method: its errors as :func:`_as_unavailable` says."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await method(*args, **kwargs)
        except Exception as exc:
            raised = _as_unavailable(exc)
            if raised is exc:
                raise
            raise raised from exc

    return wrapper


# maxmemory-policy values that evict any key, a stream included; the volatile-* ones evict only
# keys with a TTL, which jobfence's keys never have.
_EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random")
_WARNED: set[str] = set()  # the once-per-process WARNINGs given ("aof")


GROUP = "jobfence"
# The longest a waiting receive blocks in one XREADGROUP before it looks at expired leases
# and close() again.
_BLOCK_SLICE_SECONDS = 0.25

# KEYS: stream. ARGV: group, consumer, min_idle_ms, count.
# Returns {{{id, fields, times_delivered}, ...}, {id, ...}}: the entries claimed, and the ids
# that were pending with no entry left in the stream.
_CLAIM = """
local out = {}
local gone = {}
local cursor = '0-0'
for _ = 1, 10 do
  local wanted = tonumber(ARGV[4]) - #out
  if wanted <= 0 then break end
  local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], cursor,
                       'COUNT', wanted)
  for _, e in ipairs(r[2]) do
    if type(e) == 'table' then
      local p = redis.call('XPENDING', KEYS[1], ARGV[1], e[1], e[1], 1)
      if #p == 1 then
        table.insert(out, {e[1], e[2], p[1][4]})
      end
    end
  end
  -- Redis 7: the ids pending whose entry was deleted from the stream (a trim, or XDEL by
  -- another client); XAUTOCLAIM has dropped them from the pending list.
  if r[3] then
    for _, id in ipairs(r[3]) do table.insert(gone, id) end
  end
  cursor = r[1]
  if cursor == '0-0' then break end
end
return {out, gone}
"""

# How often a receive looks for entries pending to this consumer that none of its deliveries
# holds, and how long such an entry must have been idle to be taken back (see _take_back).
_TAKE_BACK_EVERY_SECONDS = 5.0
_TAKE_BACK_IDLE_MS = 5000
_TAKE_BACK_MAX = 500  # entries looked at per stream and per look

# KEYS: stream. ARGV: group, consumer, min_idle_ms, entry ids...
# Claims each entry still idle for min_idle_ms (so not one another consumer just took), raising
# its delivery count; returns {{{id, fields, times_delivered}, ...}, {id, ...}}: those claimed,
# and those still pending to this consumer whose entry was deleted from the stream (acked here:
# nothing is left to deliver).
_TAKE_BACK = """
local out = {}
local gone = {}
for i = 4, #ARGV do
  if #redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i]) == 0 then
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
    if #p == 1 and p[1][2] == ARGV[2] then
      redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
      table.insert(gone, ARGV[i])
    end
  else
    local c = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[i])
    if #c == 1 and type(c[1]) == 'table' then
      local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
      if #p == 1 then
        table.insert(out, {c[1][1], c[1][2], p[1][4]})
      end
    end
  end
end
return {out, gone}
"""

# KEYS: stream. ARGV: group, entry id, consumer, times_delivered, mode (ack | again), prior.
# ``again`` republishes the entry's fields into the stream with ``prior`` replaced, or added
# when the entry has none (another producer's): the copy keeps the job's deliveries so far. An
# empty ``prior`` (an unreadable entry's, which had none) adds nothing: the copy is the entry
# as it was. Returns 1, or 0 (changing nothing) for a stale receipt, or -1 (changing nothing)
# when the entry is no longer in the stream (trimmed, or deleted by another client): the caller
# then publishes its own copy with _SETTLE_COPY.
_SETTLE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 or p[1][2] ~= ARGV[3] or tonumber(p[1][4]) ~= tonumber(ARGV[4]) then
  return 0
end
if ARGV[5] == 'again' then
  local e = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
  if #e == 0 then
    return -1
  end
  do
    local fields = e[1][2]
    local found = false
    for i = 1, #fields, 2 do
      if fields[i] == 'prior' then
        fields[i + 1] = ARGV[6]
        found = true
      end
    end
    if not found and ARGV[6] ~= '' then
      fields[#fields + 1] = 'prior'
      fields[#fields + 1] = ARGV[6]
    end
    redis.call('XADD', KEYS[1], '*', unpack(fields))
  end
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""

# KEYS: stream. ARGV: group, consumer, then (entry id, times_delivered) pairs. Acks and deletes
# each entry still pending for this consumer with that delivery count; returns their ids.
_ACK_MANY = """
local acked = {}
for i = 3, #ARGV, 2 do
  local id = ARGV[i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if #p == 1 and p[1][2] == ARGV[2] and tonumber(p[1][4]) == tonumber(ARGV[i + 1]) then
    redis.call('XACK', KEYS[1], ARGV[1], id)
    redis.call('XDEL', KEYS[1], id)
    acked[#acked + 1] = id
  end
end
return acked
"""
_ACK_MANY_CHUNK = 200  # entries per script call: Redis runs a script to its end, alone

# KEYS: stream. ARGV[1]: the entries, packed (_packed_entries): tokens, each "<length>:<bytes>";
# an entry is a token holding its field and value count, then its fields and values. One
# argument for the lot, so that the client packs one string instead of ten per entry. XADDs each
# entry; returns, per entry, its id or its own error (pcall: one refused entry does not stop the
# others).
_XADD_MANY = """
local s = ARGV[1]
local pos = 1
local function token()
  local colon = string.find(s, ':', pos, true)
  local n = tonumber(string.sub(s, pos, colon - 1))
  pos = colon + n + 1
  return string.sub(s, colon + 1, colon + n)
end
local out = {}
while pos <= #s do
  local k = tonumber(token())
  local args = {}
  for j = 1, k do
    args[j] = token()
  end
  out[#out + 1] = redis.pcall('XADD', KEYS[1], '*', unpack(args))
end
return out
"""
_XADD_MANY_CHUNK = 200  # entries per script call


# KEYS: stream. ARGV: group, consumer. Removes the consumer from the group when it holds
# nothing (its pending entries, if any, stay claimable by the others after their idle time).
_FORGET_CONSUMER = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) == 0 then
  redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
end
return 1
"""


# KEYS: stream. ARGV: group, entry id, consumer, times_delivered.
# Restarts the entry's idle time if it is still pending for this consumer with the delivery count
# the receipt saw: XCLAIM with JUSTID does not raise the delivery count. Returns 1, or 0
# (changing nothing) for a stale receipt, or -1 (changing nothing) when the entry is no longer
# in the stream (an XCLAIM would drop it from the pending list).
_EXTEND = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 or p[1][2] ~= ARGV[3] or tonumber(p[1][4]) ~= tonumber(ARGV[4]) then
  return 0
end
if #redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2]) == 0 then
  return -1
end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'JUSTID')
return 1
"""


# KEYS: stream. ARGV: group, entry id, consumer, times_delivered, then the copy's fields and
# values. For an entry still pending to this consumer with that delivery count but deleted from
# the stream: adds the copy, acks the id. Returns 1, or 0 (changing nothing) for a stale receipt.
_SETTLE_COPY = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 or p[1][2] ~= ARGV[3] or tonumber(p[1][4]) ~= tonumber(ARGV[4]) then
  return 0
end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 5))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""

# KEYS: stream. ARGV: group, consumer, the most entries to claim. What another client's commands
# did to the group behind its back, found from the group's counters (Redis 7):
# - entries added after the group's last-delivered id that are no longer in the stream, while
#   nothing after that id is: deleted before any delivery (a MAXLEN or MINID trim; jobfence
#   deletes only entries it delivered). Counted, then the group's entries-read is set right
#   (the same last-delivered id), so that they are counted once;
# - entries at or before the last-delivered id that are pending to nobody (XGROUP SETID past
#   them, or the group made again at $): no read would deliver them again. Each is claimed for
#   this consumer with a delivery count of 1 (XCLAIM ... FORCE).
# Returns {lost, {{id, fields, 1}, ...}}.
_AUDIT = """
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok then return {0, {}} end
local g = nil
for _, fields in ipairs(groups) do
  local h = {}
  for i = 1, #fields, 2 do h[fields[i]] = fields[i + 1] end
  if h['name'] == ARGV[1] then g = h end
end
if g == nil then return {0, {}} end
local last, lag, read = g['last-delivered-id'], g['lag'], g['entries-read']
local pending = tonumber(g['pending'])
local lost = 0
if lag and read and lag > 0
    and #redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', 1) == 0 then
  lost = lag
  redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], last, 'ENTRIESREAD', read + lag)
  lag = 0
end
local out = {}
if lag then
  local stranded = redis.call('XLEN', KEYS[1]) - pending - lag
  local want = math.min(stranded, tonumber(ARGV[3]))
  if want > 0 then
    local entries = redis.call('XRANGE', KEYS[1], '-', last, 'COUNT', pending + want)
    for _, e in ipairs(entries) do
      if #out >= want then break end
      if #redis.call('XPENDING', KEYS[1], ARGV[1], e[1], e[1], 1) == 0 then
        redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, e[1], 'RETRYCOUNT', 1, 'FORCE',
                   'JUSTID')
        table.insert(out, {e[1], e[2], 1})
      end
    end
  end
end
return {lost, out}
"""


@dataclass(slots=True)
class RedisReceipt:
    stream: str
    entry_id: str
    consumer: str
    times_delivered: int
    prior: int
    settled: bool = False
    # The prior field of an entry that could not be read (Delivery.unreadable), as it was.
    raw_prior: bytes | None = None


def _receipt(delivery: Delivery) -> RedisReceipt:
    return receipt_of(delivery, RedisReceipt, "RedisStreamsQueue")


def _refuse_tx(operation: str) -> ConfigError:
    return refuse_tx("RedisStreamsQueue", operation)


def _refuse_delay(operation: Literal["publish", "retry"]) -> ConfigError:
    return refuse_delay("RedisStreamsQueue", operation, "Redis Streams cannot hold a message back")


def _fields(message: Message, prior: int) -> dict[str, bytes | str]:
    fields: dict[str, bytes | str] = {
        "consumer": message.consumer,
        "job_id": message.job_id,
        "body": message.body,
        "prior": str(prior),
    }
    if message.tenant_id is not None:
        fields["tenant_id"] = message.tenant_id
    if message.correlation_id is not None:
        fields["correlation_id"] = message.correlation_id
    if message.traceparent is not None:
        fields["traceparent"] = message.traceparent
        if message.tracestate is not None:
            fields["tracestate"] = message.tracestate
    return fields


def _packed_entries(items: list[tuple[int, dict[str, bytes | str]]]) -> bytes:
    """``_XADD_MANY``'s argument: per entry, its field and value count, then each field and
    value, every one a token ``<length>:<bytes>`` (UTF-8 for text)."""
    parts: list[bytes] = []
    for _, fields in items:
        count = b"%d" % (2 * len(fields))
        parts += (b"%d:" % len(count), count)
        for key, value in fields.items():
            name = _FIELD_TOKENS.get(key) or _token(key.encode())
            data = value if isinstance(value, bytes) else value.encode()
            parts += (name, b"%d:" % len(data), data)
    return b"".join(parts)


def _token(data: bytes) -> bytes:
    return b"%d:%b" % (len(data), data)


_FIELD_TOKENS = {
    name: _token(name.encode())
    for name in (
        "consumer",
        "job_id",
        "body",
        "prior",
        "tenant_id",
        "correlation_id",
        "traceparent",
        "tracestate",
    )
}


_NAMES = FieldNames(
    consumer="field consumer",
    job_id="field job_id",
    tenant_id="field tenant_id",
    correlation_id="field correlation_id",
    prior="field prior",
    delivered="the delivery count",
)


def _glob_escape(text: str) -> str:
    """``text`` matched literally in a Redis ``SCAN MATCH`` pattern."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


class RedisStreamsQueue:
    """The Redis Streams queue adapter.

    ``url`` is a ``redis://`` or ``rediss://`` URL. ``prefix`` starts every key (give each
    application, or each test, its own). ``consumer_name`` names this instance in the consumer
    group; the default is unique per instance (host, process, random part).
    """

    capabilities = QueueCapabilities(
        transactional=False, delayed_publish=False, delayed_retry=False
    )

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "jobfence",
        consumer_name: str | None = None,
    ) -> None:
        if not prefix or any(c in prefix for c in "{}"):
            raise ConfigError(f"prefix must be non-empty and without braces, got {prefix!r}")
        self._redis: aioredis.Redis = aioredis.Redis.from_url(url, decode_responses=False)
        self._prefix = prefix
        self._consumer = consumer_name or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self._claim = self._redis.register_script(_CLAIM)
        self._settle = self._redis.register_script(_SETTLE)
        self._forget_consumer = self._redis.register_script(_FORGET_CONSUMER)
        self._ack_many_script = self._redis.register_script(_ACK_MANY)
        self._extend = self._redis.register_script(_EXTEND)
        self._xadd_many = self._redis.register_script(_XADD_MANY)
        self._take_back_script = self._redis.register_script(_TAKE_BACK)
        self._settle_copy = self._redis.register_script(_SETTLE_COPY)
        self._audit = self._redis.register_script(_AUDIT)
        self._grouped: set[str] = set()
        # The entries this instance delivered and has not settled, per stream; reads in flight.
        self._held: dict[str, set[str]] = {}
        self._reading = 0
        self._next_take_back = 0.0
        self._lease_ms: int | None = None
        self._closed = False
        self._server_checked = False  # _check_server passed

    # -- keys ---------------------------------------------------------------------------

    def _stream(self, queue: str) -> str:
        if any(c in queue for c in "{}"):
            raise ConfigError(f"a queue name must not contain braces, got {queue!r}")
        return f"{self._prefix}:{{{queue}}}:stream"

    def _queue_of(self, stream: str) -> str:
        return stream[len(self._prefix) + 2 : -len("}:stream")]

    async def _ensure_group(self, stream: str) -> None:
        if stream in self._grouped:
            return
        if not self._server_checked:
            await self._check_server()
        try:
            await self._redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._grouped.add(stream)

    def _where(self) -> str:
        """The server's address, for people (never a password)."""
        kwargs = self._redis.connection_pool.connection_kwargs
        if kwargs.get("path"):
            return str(kwargs["path"])
        return f"{kwargs.get('host', '127.0.0.1')}:{kwargs.get('port', 6379)}"

    async def _check_server(self) -> None:
        """The server's settings that can lose jobs, read once per instance (before its first
        use of a stream) with ``INFO``, which works where ``CONFIG`` is disabled (managed
        Redis):

        - ``maxmemory-policy`` ``allkeys-*`` with a ``maxmemory``: refused (``ConfigError``).
          At its ``maxmemory`` such a Redis deletes keys to make room, a stream as any other,
          and every job in it is lost with no dead letter. With ``maxmemory`` 0 it never
          evicts; the ``volatile-*`` policies evict only keys with a TTL, and jobfence's have
          none.
        - AOF off (``aof_enabled:0``): one WARNING per process. A restart loses what was
          published since the last RDB snapshot (everything, without one), and brings back
          jobs acked since; some run RDB alone knowingly, so it is not refused.

        A server that answers ``INFO`` with an error (a command renamed away) is not checked."""
        try:
            memory = await self._redis.info("memory")
            persistence = await self._redis.info("persistence")
        except ResponseError as exc:
            log.debug("Redis INFO refused (%s): its settings are not checked", exc)
            self._server_checked = True
            return
        policy = str(memory.get("maxmemory_policy", ""))
        maxmemory = int(memory.get("maxmemory", 0) or 0)
        if policy in _EVICTING and maxmemory > 0:
            raise ConfigError(
                f"Redis at {self._where()} can evict jobfence's streams: its maxmemory-policy is"
                f" {policy} with maxmemory {maxmemory:,} bytes, so at that limit it deletes keys"
                " to make room, a whole stream with every job in it, lost with no dead letter."
                " Set maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction and"
                " in redis.conf, or your provider's parameter; a full Redis then refuses new"
                " jobs, which wait in the outbox), or give jobfence a Redis of its own"
            )
        if "aof" not in _WARNED and str(persistence.get("aof_enabled", "1")) == "0":
            _WARNED.add("aof")
            log.warning(
                "Redis at %s runs without AOF (appendonly no): a restart of Redis loses every"
                " job published since its last RDB snapshot (all of them, without snapshots),"
                " with no dead letter, and brings back jobs acked since; set appendonly yes"
                " (appendfsync everysec) unless you accept that",
                self._where(),
            )
        self._server_checked = True

    # -- the port -----------------------------------------------------------------------

    @_unavailable
    async def publish(
        self,
        message: Message,
        *,
        delay_seconds: float = 0.0,
        tx: AsyncConnection[Any] | None = None,
        prior_attempts: int = 0,
    ) -> None:
        if tx is not None:
            raise _refuse_tx("publish")
        if checked_delay(delay_seconds) > 0:
            raise _refuse_delay("publish")
        fields = _fields(message, check_prior_attempts(prior_attempts))
        stream = self._stream(message.queue)
        await self._ensure_group(stream)
        await self._redis.xadd(stream, fields)  # type: ignore[arg-type]

    async def publish_many(self, outgoing: Sequence[Outgoing]) -> list[Exception | None]:
        """Every ``XADD`` in one round trip: one script call per stream and per 200 messages,
        the calls in one pipeline; each entry's id is the confirm of its message (or its own
        error). A lost connection is ``QueueUnavailable`` for every message."""
        if not outgoing:
            return []
        try:
            replies = await self._xadd_all(outgoing)
        except ConfigError as exc:
            if self._server_checked:
                return [exc] * len(outgoing)
            # The server's settings refused (_check_server): every message alike, for as long
            # as the setting stays; an outage that names it (nothing is dead-lettered for it).
            # Set right, the next probe publishes.
            refused = QueueUnavailable(str(exc))
            refused.__cause__ = exc
            return [refused] * len(outgoing)
        except Exception as exc:
            return [exc] * len(outgoing)
        return [
            _as_unavailable(reply) if isinstance(reply, Exception) else None for reply in replies
        ]

    @_unavailable
    async def _xadd_all(self, outgoing: Sequence[Outgoing]) -> list[Any]:
        replies: list[Any] = []
        entries: list[tuple[int, str, dict[str, bytes | str]]] = []
        for n, item in enumerate(outgoing):
            try:
                stream = self._stream(item.message.queue)
            except ConfigError as exc:
                replies.append(PublishRefused(f"Redis refuses this message: {exc}"))
                continue
            fields = _fields(item.message, check_prior_attempts(item.prior_attempts))
            replies.append(None)
            entries.append((n, stream, fields))
        by_stream: dict[str, list[tuple[int, dict[str, bytes | str]]]] = {}
        for n, stream, fields in entries:
            by_stream.setdefault(stream, []).append((n, fields))
        for stream in sorted(by_stream):
            try:
                await self._ensure_group(stream)
            except ResponseError as exc:  # this stream's own (a key of another type)
                for n, _ in by_stream.pop(stream):
                    replies[n] = exc
        calls = [
            (stream, items[start : start + _XADD_MANY_CHUNK])
            for stream, items in by_stream.items()
            for start in range(0, len(items), _XADD_MANY_CHUNK)
        ]
        answers = await self._run_xadd_many(calls)
        if any(isinstance(a, NoScriptError) for a in answers):
            # A Redis that restarted or flushed its scripts ran none of these calls.
            await self._redis.script_load(_XADD_MANY)
            again = [c for c, a in zip(calls, answers, strict=True) if isinstance(a, NoScriptError)]
            retried = iter(await self._run_xadd_many(again))
            answers = [next(retried) if isinstance(a, NoScriptError) else a for a in answers]
        for (_, items), answer in zip(calls, answers, strict=True):
            if isinstance(answer, Exception):
                for n, _ in items:
                    replies[n] = answer
            else:
                for (n, _), entry in zip(items, answer, strict=True):
                    replies[n] = entry
        return replies

    async def _run_xadd_many(
        self, calls: list[tuple[str, list[tuple[int, dict[str, bytes | str]]]]]
    ) -> list[Any]:
        """The ``_XADD_MANY`` calls in one pipeline; one answer per call (a list of entry ids
        and errors, or the call's error)."""
        pipe = self._redis.pipeline(transaction=False)
        for stream, items in calls:
            pipe.evalsha(self._xadd_many.sha, 1, stream, _packed_entries(items))
        answers: list[Any] = await pipe.execute(raise_on_error=False)
        return answers

    @_unavailable
    async def receive(
        self,
        queues: Sequence[str],
        *,
        max_messages: int,
        lease_seconds: float,
        wait_seconds: float = 0.0,
    ) -> list[Delivery]:
        if max_messages <= 0 or not queues:
            return []
        self._lease_ms = lease_ms = max(int(lease_seconds * 1000), 1)
        streams = [self._stream(q) for q in queues]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        self._reading += 1
        try:
            for stream in streams:
                await self._ensure_group(stream)
            if self._reading == 1 and loop.time() >= self._next_take_back:
                self._next_take_back = loop.time() + _TAKE_BACK_EVERY_SECONDS
                taken = await self._take_back(streams, max_messages)
                if taken:
                    return taken
            while True:
                if self._closed:
                    return []
                got = await self._take(streams, max_messages, lease_ms)
                remaining = deadline - loop.time()
                if got or remaining <= 0 or self._closed or not streams:
                    return got
                block_ms = max(int(min(remaining, _BLOCK_SLICE_SECONDS) * 1000), 1)
                got = await self._read_new(streams, max_messages, block_ms=block_ms)
                if got:
                    return got
        except (RedisConnectionError, OSError):
            if self._closed:
                return []
            raise
        except ResponseError as exc:
            if not _group_gone(exc):
                raise
            self._forget_groups(streams)
            return []
        finally:
            self._reading -= 1

    async def _take_back(self, streams: Sequence[str], max_messages: int) -> list[Delivery]:
        """Entries pending to this consumer for at least ``_TAKE_BACK_IDLE_MS`` that none of
        this instance's deliveries holds, claimed again (their delivery count raised, as a
        lease's end would). A read whose reply the network lost leaves such entries (the read
        failed, and Redis made its entries pending all the same), and so does an
        earlier process that ran under the same ``consumer_name``. Without this they would wait
        out the lease. Runs only when no other read of this instance is in flight, whose
        entries would not be in ``_held`` yet."""
        got: list[Delivery] = []
        stranded = 0
        for stream in streams:
            wanted = max_messages - len(got)
            if wanted <= 0:
                break
            lost, found = await self._audit(keys=[stream], args=[GROUP, self._consumer, wanted])
            if int(lost) > 0:
                log.error(
                    "%d entr%s of queue %s were never delivered: deleted from stream %s by "
                    "another client (a MAXLEN or MINID trim: XTRIM, or XADD by another "
                    "producer); their jobs are lost, with no dead letter; do not trim "
                    "jobfence's streams",
                    int(lost),
                    "y" if int(lost) == 1 else "ies",
                    self._queue_of(stream),
                    stream,
                )
            for entry_id, raw, delivered in found:
                got.append(self._delivery(stream, entry_id, _pairs(raw), int(delivered)))
            stranded += len(found)
            wanted = max_messages - len(got)
            if wanted <= 0:
                break
            pending = await self._redis.xpending_range(
                stream,
                GROUP,
                min="-",
                max="+",
                count=_TAKE_BACK_MAX,
                consumername=self._consumer,
                idle=_TAKE_BACK_IDLE_MS,
            )
            held = self._held.get(stream, set())
            ids = [i for e in pending if (i := _text_id(e["message_id"])) not in held][:wanted]
            if not ids:
                continue
            claimed, gone = await self._take_back_script(
                keys=[stream], args=[GROUP, self._consumer, _TAKE_BACK_IDLE_MS, *ids]
            )
            self._deleted_while_pending(stream, gone)
            for entry_id, raw, delivered in claimed:
                got.append(self._delivery(stream, entry_id, _pairs(raw), int(delivered)))
        if stranded:
            log.warning(
                "%d entr%s of queue(s) %s were stranded behind consumer group %s's last-"
                "delivered id, pending to nobody (XGROUP SETID past them, or the group made "
                "again at $ by another client): delivered now",
                stranded,
                "y" if stranded == 1 else "ies",
                ", ".join(self._queue_of(stream) for stream in streams),
                GROUP,
            )
        if len(got) > stranded:
            log.info(
                "took back %d entr%s pending to this consumer that no delivery of it held (a"
                " read whose reply was lost, or an earlier process with the same consumer name)",
                len(got) - stranded,
                "y" if len(got) - stranded == 1 else "ies",
            )
        return got

    def _deleted_while_pending(self, stream: str, ids: Sequence[bytes | str]) -> None:
        """``ids`` were pending in ``stream`` with no entry left (a trim, or XDEL by another
        client), and nobody held them: Redis has dropped them from the pending list."""
        if ids:
            shown = [_text_id(i) for i in ids]
            log.error(
                "%d entr%s of queue %s were deleted from stream %s while pending, after "
                "their holder let them go (a MAXLEN or MINID trim, or XDEL by another client): "
                "their jobs are lost, with no dead letter; entry id(s) %s; do not trim "
                "jobfence's streams",
                len(shown),
                "y" if len(shown) == 1 else "ies",
                self._queue_of(stream),
                stream,
                ", ".join(shown[:20]) + (", ..." if len(shown) > 20 else ""),
            )

    async def _copy_deleted(
        self, receipt: RedisReceipt, message: Message, prior: int | bytes
    ) -> bool:
        """The entry of ``receipt`` was deleted from its stream while this instance held it (a
        trim, or XDEL by another client): publish the job again from this delivery's copy,
        with ``prior``, and ack the id, in one script. False for a stale receipt."""
        fields: dict[str, bytes | str] = dict(_fields(message, 0))
        if isinstance(prior, bytes):  # an unreadable entry's prior field, as it was
            del fields["prior"]
            if prior:
                fields["prior"] = prior
        else:
            fields["prior"] = str(prior)
        args: list[bytes | str | int] = [
            GROUP,
            receipt.entry_id,
            receipt.consumer,
            receipt.times_delivered,
        ]
        for key, value in fields.items():
            args += [key, value]
        done = bool(await self._settle_copy(keys=[receipt.stream], args=args))
        if done:
            log.warning(
                "entry %s of queue %s was deleted from its stream while this worker held it "
                "(a MAXLEN or MINID trim, or XDEL by another client): its job %s was "
                "published again from the worker's copy",
                receipt.entry_id,
                self._queue_of(receipt.stream),
                shown_value(message.job_id),
            )
        return done

    def _settled(self, receipt: RedisReceipt) -> None:
        """The entry of ``receipt`` is no longer this instance's to hold."""
        held = self._held.get(receipt.stream)
        if held is not None:
            held.discard(receipt.entry_id)

    def _forget_groups(self, streams: Sequence[str]) -> None:
        """A stream of ``streams``, or its group, was deleted on the server: each is made again
        (``XGROUP CREATE ... MKSTREAM``) before its next use. The entries that were in it are
        gone with it; those published since are read from its start."""
        gone = sorted(stream for stream in streams if stream in self._grouped)
        self._grouped.difference_update(streams)
        for stream in streams:
            self._held.pop(stream, None)
        if gone:
            log.warning(
                "a Redis stream of queue(s) %s, or its consumer group %s, was deleted on the "
                "server: made again at the next fetch; the entries it held are gone with it",
                ", ".join(self._queue_of(stream) for stream in gone),
                GROUP,
            )

    async def _take(
        self, streams: Sequence[str], max_messages: int, lease_ms: int
    ) -> list[Delivery]:
        got: list[Delivery] = []
        for stream in streams:
            wanted = max_messages - len(got)
            if wanted <= 0:
                break
            claimed, gone = await self._claim(
                keys=[stream], args=[GROUP, self._consumer, lease_ms, wanted]
            )
            self._deleted_while_pending(stream, gone)
            for entry_id, raw, delivered in claimed:
                got.append(self._delivery(stream, entry_id, _pairs(raw), int(delivered)))
        if len(got) < max_messages:
            got += await self._read_new(streams, max_messages - len(got), block_ms=None)
        return got

    async def _read_new(
        self, streams: Sequence[str], count: int, *, block_ms: int | None
    ) -> list[Delivery]:
        result: list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None
        result = await self._redis.xreadgroup(  # type: ignore[assignment]
            GROUP,
            self._consumer,
            dict.fromkeys(streams, ">"),
            count=count,
            block=block_ms,
        )
        got: list[Delivery] = []
        for stream_name, entries in result or []:
            stream = stream_name.decode()
            for entry_id, fields in entries:
                if len(got) < count:
                    got.append(self._delivery(stream, entry_id, fields, 1))
        return got

    def _delivery(
        self, stream: str, entry_id: bytes | str, fields: dict[bytes, bytes], delivered: int
    ) -> Delivery:
        """Every field read by :func:`read_delivery`: one that does not parse makes this entry
        an ``UnfenceableMessage`` dead letter, never a failed read."""
        receipt = RedisReceipt(
            stream=stream,
            entry_id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
            consumer=self._consumer,
            times_delivered=delivered,
            prior=0,
        )
        self._held.setdefault(stream, set()).add(receipt.entry_id)
        delivery, receipt.prior = read_delivery(
            _NAMES,
            queue=self._queue_of(stream),
            body=fields.get(b"body", b""),
            consumer=fields.get(b"consumer", b""),
            job_id=fields.get(b"job_id", b""),
            tenant_id=fields.get(b"tenant_id"),
            correlation_id=fields.get(b"correlation_id"),
            prior=fields.get(b"prior"),
            delivered=delivered,
            receipt=receipt,
            traceparent=fields.get(b"traceparent"),
            tracestate=fields.get(b"tracestate"),
        )
        if delivery.unreadable is not None:
            # A release copies the entry as it is: its prior field unchanged.
            receipt.raw_prior = fields.get(b"prior", b"")
        return delivery

    async def _settle_entry(
        self,
        receipt: RedisReceipt,
        *,
        again: bool,
        prior: int | bytes = 0,
        message: Message | None = None,
    ) -> bool:
        if receipt.settled:
            return False
        try:
            done = await self._settle(
                keys=[receipt.stream],
                args=[
                    GROUP,
                    receipt.entry_id,
                    receipt.consumer,
                    receipt.times_delivered,
                    "again" if again else "ack",
                    prior,
                ],
            )
        except ResponseError as exc:
            if not _group_gone(exc):
                raise
            self._forget_groups([receipt.stream])
            self._settled(receipt)
            return False  # the entry went with its stream: nothing left to settle
        if done == -1 and message is not None:  # deleted from the stream while held
            done = await self._copy_deleted(receipt, message, prior)
        # Settled, or stale (the entry is another consumer's now): not held either way.
        self._settled(receipt)
        if done:
            receipt.settled = True
        return bool(done)

    @_unavailable
    async def ack(self, delivery: Delivery, *, tx: AsyncConnection[Any] | None = None) -> bool:
        if tx is not None:
            raise _refuse_tx("ack")
        return await self._settle_entry(_receipt(delivery), again=False)

    @_unavailable
    async def extend(self, delivery: Delivery, *, lease_seconds: float) -> bool:
        """Restart the entry's idle time; other receivers claim it after their own
        ``lease_seconds`` of idleness, so the extension lasts the receivers' lease."""
        receipt = _receipt(delivery)
        if receipt.settled:
            return False
        try:
            done = await self._extend(
                keys=[receipt.stream],
                args=[GROUP, receipt.entry_id, receipt.consumer, receipt.times_delivered],
            )
        except ResponseError as exc:
            if not _group_gone(exc):
                raise
            self._forget_groups([receipt.stream])
            return False
        if done == -1:
            # Deleted from the stream while held: the job is published again from this copy
            # (counting this delivery), so it cannot be lost with the pending id; this delivery
            # no longer holds it (as when its lease was lost: the fence settles which runs).
            if await self._copy_deleted(
                receipt, delivery.message, receipt.prior + receipt.times_delivered
            ):
                receipt.settled = True
                self._settled(receipt)
            return False
        return bool(done)

    @_unavailable
    async def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        """One script call per stream (and per 200 entries) instead of one per delivery, each
        entry checked as :meth:`ack` checks it."""
        by_stream: dict[tuple[str, str], list[RedisReceipt]] = {}
        for delivery in deliveries:
            receipt = _receipt(delivery)
            if not receipt.settled:
                by_stream.setdefault((receipt.stream, receipt.consumer), []).append(receipt)
        for (stream, consumer), receipts in by_stream.items():
            for start in range(0, len(receipts), _ACK_MANY_CHUNK):
                chunk = receipts[start : start + _ACK_MANY_CHUNK]
                args: list[str | int] = [GROUP, consumer]
                for receipt in chunk:
                    args += [receipt.entry_id, receipt.times_delivered]
                try:
                    answer = await self._ack_many_script(keys=[stream], args=args)
                except ResponseError as exc:
                    if not _group_gone(exc):
                        raise
                    self._forget_groups([stream])
                    break  # its entries went with it: nothing left to ack
                acked = {_text_id(i) for i in answer}
                for receipt in chunk:
                    self._settled(receipt)
                    if receipt.entry_id in acked:
                        receipt.settled = True

    @_unavailable
    async def retry(self, delivery: Delivery, *, delay_seconds: float, error: str) -> bool:
        receipt = _receipt(delivery)
        if delay_seconds > 0:
            raise _refuse_delay("retry")
        return await self._settle_entry(
            receipt,
            again=True,
            prior=receipt.prior + receipt.times_delivered,
            message=delivery.message,
        )

    @_unavailable
    async def release(self, delivery: Delivery) -> None:
        receipt = _receipt(delivery)
        if receipt.raw_prior is not None:  # unreadable: copied as it was published
            await self._settle_entry(
                receipt, again=True, prior=receipt.raw_prior, message=delivery.message
            )
            return
        await self._settle_entry(
            receipt,
            again=True,
            prior=receipt.prior + receipt.times_delivered - 1,
            message=delivery.message,
        )

    @_unavailable
    async def size(self, queues: Sequence[str]) -> QueueSize:
        """Entries in the streams: ``due`` those never delivered or whose lease ran out,
        ``total`` adds the leased ones. A delayed retry or enqueue waits in the PostgreSQL
        outbox, not here, until it falls due."""
        due = total = 0
        for queue in queues:
            stream = self._stream(queue)
            if not await self._redis.exists(stream):
                continue
            length = int(await self._redis.xlen(stream))
            try:
                summary = await self._redis.xpending(stream, GROUP)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                pending, expired = 0, 0
            else:
                pending = int(summary["pending"])
                expired = 0
                if pending and self._lease_ms is not None:
                    idle = await self._redis.xpending_range(
                        stream, GROUP, min="-", max="+", count=pending, idle=self._lease_ms
                    )
                    expired = len(idle)
            total += length
            due += length - pending + expired
        return QueueSize(due=due, total=total)

    @_unavailable
    async def backlog(self, queues: Sequence[str]) -> int:
        """Every entry of every stream under this adapter's prefix (an acked entry is deleted;
        a leased one is still there). ``queues`` is not needed: the streams are found by name."""
        pattern = f"{_glob_escape(self._prefix)}:{{*}}:stream"
        total = 0
        async for key in self._redis.scan_iter(match=pattern, count=500, _type="stream"):
            total += int(await self._redis.xlen(key))
        return total

    async def close(self) -> None:
        """Leave the consumer group if this instance holds nothing, and close the connections;
        a waiting receiver returns an empty list."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            for stream in sorted(self._grouped):
                await self._forget_consumer(keys=[stream], args=[GROUP, self._consumer])
        with contextlib.suppress(Exception):
            await self._redis.aclose()


def _group_gone(exc: Exception) -> bool:
    """True for Redis's answer to a command on a stream whose key, or whose consumer group,
    was deleted on the server: NOGROUP, or UNBLOCKED for a read waiting on it when it went."""
    if not isinstance(exc, ResponseError):
        return False
    text = str(exc)
    return text.startswith("NOGROUP") or text.startswith("UNBLOCKED")


def _text_id(raw: bytes | str | int) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _pairs(raw: Sequence[Any]) -> dict[bytes, bytes]:
    """A flat [field, value, ...] list from Lua as a dict."""
    return {bytes(raw[i]): bytes(raw[i + 1]) for i in range(0, len(raw), 2)}


async def open_queue(url: str) -> RedisStreamsQueue:
    """The factory ``JOBFENCE_QUEUE_URL=redis://...`` uses (``jobfence.queues``): the adapter,
    with the server answering a PING and its settings checked, so a bad or unreachable URL,
    or a Redis that can evict the streams, fails here. The URL's
    ``prefix`` parameter sets the adapter's (:func:`jobfence.queues.parse_queue_url` reads it)."""
    from jobfence.queues import parse_queue_url

    target = parse_queue_url(url)
    assert target.client_url is not None
    queue = RedisStreamsQueue(target.client_url, prefix=target.settings.prefix)
    try:
        await queue._redis.ping()
        await queue._check_server()
    except BaseException:
        await queue.close()
        raise
    return queue
