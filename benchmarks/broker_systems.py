"""The systems of ``throughput.py`` that run on a broker: jobfence on each queue adapter, and
Dramatiq and Celery doing the same work with a hand-written fence.

Every system does the same work per job as the PostgreSQL ones: the fence insert
``INSERT INTO core.processed_jobs ... ON CONFLICT DO NOTHING`` and ``UPDATE bench_accounts``,
in one transaction. jobfence does it through ``Worker`` on its adapter; Dramatiq's actor and
Celery's task do it by hand, on a sync psycopg connection of their worker process, the UPDATE
only when the fence row was inserted.

- jobfence: ``Worker(app, pool, queue, concurrency=1).run(until="empty")`` on
  ``RabbitMQQueue`` / ``NatsQueue`` / ``RedisStreamsQueue`` with their defaults (quorum queue
  and publisher confirms; file storage and explicit acks; consumer group).
- Dramatiq: ``dramatiq.Worker(broker, worker_threads=1)`` per process (what ``dramatiq
  --processes N --threads 1`` runs), the default middleware, the broker's defaults
  (RabbitMQ: durable classic queue, prefetch 2 per thread; Redis: its Lua-script queue).
- Celery: one ``celery worker --pool prefork --concurrency 1`` per process, ``acks_late``, no
  result backend, the default prefetch multiplier (4), without gossip, mingle, heartbeat and
  remote control (so a run creates only its task queue); RabbitMQ: a durable classic queue.

Each run gets broker names of its own (``jfbench<random>``) and deletes them afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from multiprocessing.sharedctypes import SynchronizedArray
from multiprocessing.synchronize import Event
from typing import Any

import psutil
import psycopg
from common import CONSUMER, FENCE_SQL, QUEUE, WORK_SQL, build_jobfence_app, job_work

from jobfence import QueuePort

JOBFENCE_RABBITMQ = "jobfence-rabbitmq"
JOBFENCE_NATS = "jobfence-nats"
JOBFENCE_REDIS = "jobfence-redis"
DRAMATIQ_RABBITMQ = "dramatiq-rabbitmq"
DRAMATIQ_REDIS = "dramatiq-redis"
CELERY_RABBITMQ = "celery-rabbitmq"
CELERY_REDIS = "celery-redis"

# The same, with the consumer's jobs_per_transaction=10 (group commit), as (b2) on PostgreSQL.
GROUPED = "-group"
JOBFENCE_RABBITMQ_GROUP = JOBFENCE_RABBITMQ + GROUPED
JOBFENCE_NATS_GROUP = JOBFENCE_NATS + GROUPED
JOBFENCE_REDIS_GROUP = JOBFENCE_REDIS + GROUPED

BROKER_LABELS = {
    JOBFENCE_RABBITMQ: "(d) jobfence, RabbitMQ",
    JOBFENCE_NATS: "(d) jobfence, NATS",
    JOBFENCE_REDIS: "(d) jobfence, Redis",
    JOBFENCE_RABBITMQ_GROUP: "(d2) jobfence, RabbitMQ, grouped",
    JOBFENCE_NATS_GROUP: "(d2) jobfence, NATS, grouped",
    JOBFENCE_REDIS_GROUP: "(d2) jobfence, Redis, grouped",
    DRAMATIQ_RABBITMQ: "(e) Dramatiq, RabbitMQ",
    DRAMATIQ_REDIS: "(e) Dramatiq, Redis",
    CELERY_RABBITMQ: "(f) Celery, RabbitMQ",
    CELERY_REDIS: "(f) Celery, Redis",
}
BROKER_SYSTEMS = tuple(BROKER_LABELS)
JOBFENCE_ON_BROKERS = (
    JOBFENCE_RABBITMQ,
    JOBFENCE_NATS,
    JOBFENCE_REDIS,
    JOBFENCE_RABBITMQ_GROUP,
    JOBFENCE_NATS_GROUP,
    JOBFENCE_REDIS_GROUP,
)
BROKER_OF = {
    JOBFENCE_RABBITMQ: "rabbitmq",
    JOBFENCE_NATS: "nats",
    JOBFENCE_REDIS: "redis",
    JOBFENCE_RABBITMQ_GROUP: "rabbitmq",
    JOBFENCE_NATS_GROUP: "nats",
    JOBFENCE_REDIS_GROUP: "redis",
    DRAMATIQ_RABBITMQ: "rabbitmq",
    DRAMATIQ_REDIS: "redis",
    CELERY_RABBITMQ: "rabbitmq",
    CELERY_REDIS: "redis",
}
# The broker's server processes, whose CPU is counted as the broker's.
BROKER_PROCESSES = {
    "rabbitmq": ("beam.smp",),
    "nats": ("nats-server",),
    "redis": ("redis-server",),
}
DEFAULT_URLS = {
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672/",
    "nats": "nats://127.0.0.1:4222",
    "redis": "redis://127.0.0.1:6379/0",
}
FENCE_CONSUMER = "bench_handwritten"  # the consumer name of the hand-written fence rows
PUBLISH_CHUNK = 16  # publishes in flight at once (the Redis adapter's pool holds few connections)


@dataclass(frozen=True)
class Urls:
    rabbitmq: str
    nats: str
    redis: str

    def of(self, system: str) -> str:
        url: str = getattr(self, BROKER_OF[system])
        return url


def new_name() -> str:
    """Names of one run on a broker: lower-case letters and digits."""
    return f"jfbench{uuid.uuid4().hex[:10]}"


def broker_cpu(broker: str) -> dict[int, float]:
    """CPU seconds (utime + stime, from /proc) of the broker's server processes."""
    found = {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        if proc.info["name"] in BROKER_PROCESSES[broker] and proc.info["cpu_times"]:
            t = proc.info["cpu_times"]
            found[proc.pid] = t.user + t.system
    return found


# --------------------------------------------------------------------------------------------
# jobfence on a broker


def grouped(system: str) -> bool:
    """A jobfence system whose consumer commits jobs in groups (jobs_per_transaction=10)."""
    return system.endswith(GROUPED)


def jobfence_queue(system: str, url: str, name: str) -> QueuePort:
    system = system.removesuffix(GROUPED)
    if system == JOBFENCE_RABBITMQ:
        from jobfence.adapters.rabbitmq import RabbitMQQueue

        return RabbitMQQueue(url, prefix=name)
    if system == JOBFENCE_NATS:
        from jobfence.adapters.nats import NatsQueue

        return NatsQueue(url, stream=name.upper(), subject_prefix=name)
    from jobfence.adapters.redis_streams import RedisStreamsQueue

    return RedisStreamsQueue(url, prefix=name)


async def _publish_jobfence(system: str, url: str, name: str, prefix: str, jobs: int) -> None:
    app = build_jobfence_app()
    queue = jobfence_queue(system, url, name)
    try:
        for start in range(0, jobs, PUBLISH_CHUNK):
            messages = []
            for i in range(start, min(start + PUBLISH_CHUNK, jobs)):
                points, account_id = job_work(i)
                payload = {"account_id": account_id, "points": points}
                messages.append(app.message(CONSUMER, payload, job_id=f"{prefix}{i}"))
            await asyncio.gather(*(queue.publish(m) for m in messages))
    finally:
        await queue.close()


# --------------------------------------------------------------------------------------------
# Dramatiq and Celery: the broker objects, built the same way in the main and worker processes


def dramatiq_broker(system: str, url: str, name: str) -> Any:
    if system == DRAMATIQ_RABBITMQ:
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=url)
    from dramatiq.brokers.redis import RedisBroker

    return RedisBroker(url=url, namespace=name)


def dramatiq_actor(broker: Any, name: str, fn: Any) -> Any:
    import dramatiq

    return dramatiq.actor(fn, actor_name=CONSUMER, queue_name=name, broker=broker)


def celery_app(system: str, url: str, name: str) -> Any:
    import celery

    app = celery.Celery(f"bench-{name}", broker=url, set_as_current=False)
    options: dict[str, Any] = {}
    if system == CELERY_REDIS:
        options["global_keyprefix"] = f"{name}:"  # every key of the run under one prefix
    app.conf.update(
        task_default_queue=name,
        task_acks_late=True,
        task_ignore_result=True,
        worker_concurrency=1,
        worker_enable_remote_control=False,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options=options,
    )
    return app


def _no_work(**kwargs: Any) -> None:  # the publishing side's stand-in for the task body
    raise AssertionError("runs in the worker only")


def _publish_dramatiq(system: str, url: str, name: str, prefix: str, jobs: int) -> None:
    broker = dramatiq_broker(system, url, name)
    try:
        actor = dramatiq_actor(broker, name, _no_work)
        for i in range(jobs):
            points, account_id = job_work(i)
            actor.send_with_options(
                kwargs={"job_id": f"{prefix}{i}", "account_id": account_id, "points": points}
            )
    finally:
        broker.close()


def _publish_celery(system: str, url: str, name: str, prefix: str, jobs: int) -> None:
    app = celery_app(system, url, name)
    try:
        with app.producer_or_acquire() as producer:
            for i in range(jobs):
                points, account_id = job_work(i)
                app.send_task(
                    CONSUMER,
                    kwargs={"job_id": f"{prefix}{i}", "account_id": account_id, "points": points},
                    producer=producer,
                )
    finally:
        app.close()


async def publish(system: str, urls: Urls, name: str, prefix: str, jobs: int) -> None:
    """Put the run's ``jobs`` on the broker before the clock starts."""
    url = urls.of(system)
    if system in JOBFENCE_ON_BROKERS:
        await _publish_jobfence(system, url, name, prefix, jobs)
    elif system.startswith("dramatiq"):
        await asyncio.to_thread(_publish_dramatiq, system, url, name, prefix, jobs)
    else:
        await asyncio.to_thread(_publish_celery, system, url, name, prefix, jobs)


# --------------------------------------------------------------------------------------------
# After a run: what is left on the broker, and deleting everything the run created


def _rabbit_queues(system: str, name: str) -> list[str]:
    if system in JOBFENCE_ON_BROKERS:
        return [f"{name}.{QUEUE}"]
    if system == DRAMATIQ_RABBITMQ:
        return [name, f"{name}.DQ", f"{name}.XQ"]
    return [name]


async def _rabbit_counts(url: str, queues: list[str]) -> int:
    import aio_pika
    from aio_pika.exceptions import ChannelClosed

    connection = await aio_pika.connect(url)
    left = 0
    try:
        for queue in queues:
            channel = await connection.channel()
            try:
                declared = await channel.declare_queue(queue, passive=True)
                left += declared.declaration_result.message_count or 0
            except ChannelClosed:
                continue  # never declared
            with contextlib.suppress(ChannelClosed):
                await channel.close()
    finally:
        await connection.close()
    return left


async def left_on_broker(system: str, urls: Urls, name: str) -> int:
    """Messages of the run still on the broker once every worker has closed (0 expected)."""
    url = urls.of(system)
    if system in JOBFENCE_ON_BROKERS:
        queue = jobfence_queue(system, url, name)
        try:
            return (await queue.size([QUEUE])).total
        finally:
            await queue.close()
    if BROKER_OF[system] == "rabbitmq":
        return await _rabbit_counts(url, _rabbit_queues(system, name))
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        if system == DRAMATIQ_REDIS:  # a message's body stays in <queue>.msgs until acked
            return int(await client.hlen(f"{name}:{name}.msgs"))
        return int(await client.llen(f"{name}:{name}")) + int(
            await client.zcard(f"{name}:unacked_index")
        )
    finally:
        await client.aclose()


async def delete_run(system: str, urls: Urls, name: str) -> None:
    """Delete the queues, stream or keys the run created on its broker."""
    url = urls.of(system)
    broker = BROKER_OF[system]
    if broker == "redis":
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url)
        try:
            keys = [key async for key in client.scan_iter(match=f"{name}:*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()
    elif broker == "nats":
        import nats
        from nats.js.errors import NotFoundError

        nc = await nats.connect(url)
        try:
            with contextlib.suppress(NotFoundError):
                await nc.jetstream().delete_stream(name.upper())
        finally:
            await nc.close()
    else:
        import aio_pika
        from aio_pika.exceptions import ChannelClosed

        connection = await aio_pika.connect(url)
        try:
            for queue in _rabbit_queues(system, name):
                channel = await connection.channel()
                with contextlib.suppress(ChannelClosed):
                    await channel.queue_delete(queue)
                    await channel.close()
            if system == CELERY_RABBITMQ:  # Celery declares a direct exchange per queue
                channel = await connection.channel()
                with contextlib.suppress(ChannelClosed):
                    await channel.exchange_delete(name)
                    await channel.close()
        finally:
            await connection.close()


# --------------------------------------------------------------------------------------------
# Worker processes of Dramatiq and Celery. Each slot of the shared array holds, per worker
# process: jobs done, when the last one ran (time.monotonic), and whether its first job arrived.


SLOT = 3


class HandwrittenFence:
    """The task body a Dramatiq or Celery user writes: one psycopg transaction with the fence
    insert and, when the row was new, the work. Its first call waits for the start signal."""

    def __init__(self, url: str, slots: SynchronizedArray[float], index: int, go: Event) -> None:
        self.url, self.slots, self.index, self.go = url, slots, index, go
        self.conn: psycopg.Connection[Any] | None = None

    def __call__(self, job_id: str, account_id: int, points: int) -> None:
        if self.conn is None:  # the first job: connect, then wait for the clock to start
            self.conn = psycopg.connect(self.url, autocommit=True)
            self.slots[SLOT * self.index + 2] = 1.0
            self.go.wait()
        with self.conn.transaction():
            cur = self.conn.execute(FENCE_SQL, (job_id, FENCE_CONSUMER))
            if cur.rowcount != 1:
                return  # a duplicate delivery: the fence row is already there
            self.conn.execute(WORK_SQL, (points, account_id))
            with self.slots.get_lock():
                self.slots[SLOT * self.index] += 1
                self.slots[SLOT * self.index + 1] = time.monotonic()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _wait_for(predicate: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {seconds:.0f} s")
        time.sleep(0.005)


def _cpu_with_children(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def run_framework_worker(
    cmd: dict[str, Any], pipe: Any, go: Event, slots: SynchronizedArray[float]
) -> dict[str, Any]:
    """One Dramatiq or Celery worker process: start it, report ready once its first job is
    waiting for the start signal, stop it once all processes together did every job. Returns
    this process's count, the time of its last job and its CPU seconds from the start signal
    to the last job (Celery's prefork pool process included)."""
    index, jobs, procs = cmd["index"], cmd["jobs"], cmd["procs"]
    me = psutil.Process()

    def done() -> bool:
        return sum(slots[SLOT * k] for k in range(procs)) >= jobs

    def arrived() -> bool:
        return slots[SLOT * index + 2] == 1.0

    def until_done() -> float:
        """Ready, released, every job done: this process's CPU seconds meanwhile."""
        _wait_for(arrived, 60, "no job arrived")
        pipe.send("ready")
        go.wait()
        before = _cpu_with_children(me)
        _wait_for(done, 600, "jobs not done")
        return _cpu_with_children(me) - before

    fence = HandwrittenFence(cmd["url"], slots, index, go)

    def task_body(job_id: str, account_id: int, points: int) -> None:
        fence(job_id, account_id, points)

    try:
        if cmd["system"].startswith("dramatiq"):
            cpu = _run_dramatiq(cmd, task_body, until_done)
        else:
            cpu = _run_celery(cmd, task_body, until_done)
    finally:
        fence.close()
    return {
        "count": int(slots[SLOT * index]),
        "first": 0.0,
        "last": slots[SLOT * index + 1],
        "cpu": cpu,
    }


def _run_dramatiq(cmd: dict[str, Any], task_body: Any, until_done: Any) -> float:
    import dramatiq

    broker = dramatiq_broker(cmd["system"], cmd["broker_url"], cmd["name"])
    dramatiq_actor(broker, cmd["name"], task_body)
    worker = dramatiq.Worker(broker, worker_threads=1)
    worker.start()
    try:
        cpu: float = until_done()
    finally:
        worker.stop()
        broker.close()
    return cpu


def _run_celery(cmd: dict[str, Any], task_body: Any, until_done: Any) -> float:
    from celery.worker import state

    # This machine's benchmarks run as root; Celery says so at every start.
    warnings.filterwarnings("ignore", message="You're running the worker with superuser")

    app = celery_app(cmd["system"], cmd["broker_url"], cmd["name"])
    # shared=False: a shared task would join every later app of this process under its name.
    app.task(name=CONSUMER, shared=False)(task_body)
    worker = app.Worker(
        pool_cls="prefork",
        concurrency=1,
        loglevel="WARNING",
        without_gossip=True,
        without_mingle=True,
        without_heartbeat=True,
        redirect_stdouts=False,
        quiet=True,
    )
    result: dict[str, Any] = {}

    def watch() -> None:
        try:
            result["cpu"] = until_done()
        except BaseException as exc:
            result["error"] = exc
        finally:
            state.should_stop = 0  # a warm shutdown, as SIGTERM asks for

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        worker.start()  # returns after the warm shutdown
    finally:
        state.should_stop = None
        watcher.join()
        app.close()
    if "error" in result:
        raise result["error"]
    cpu: float = result["cpu"]
    return cpu
