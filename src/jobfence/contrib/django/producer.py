"""Enqueue from Django code, in the current ``transaction.atomic()`` block."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any

from django.db import connections
from pydantic import BaseModel

from jobfence.app import App
from jobfence.contrib.django.settings import jobfence_settings, require_app
from jobfence.producer import Producer, publish_sync


@cache
def _load_app(spec: str) -> App:
    from jobfence.cli import _load_app as load

    return load(spec)


def enqueue(
    consumer: str,
    payload: BaseModel | Mapping[str, Any],
    *,
    job_id: str,
    tenant_id: str | None = None,
    correlation_id: str | None = None,
    delay_seconds: float = 0.0,
    using: str | None = None,
    via: App | Producer | None = None,
) -> None:
    """Publish a job on Django's connection ``using`` (default: ``JOBFENCE["DATABASE_ALIAS"]``),
    in its current transaction, never committing it.

    Inside ``transaction.atomic()`` the job exists exactly when the block commits; an exception
    that leaves the block rolls it back with everything else. Outside ``atomic()`` (Django's
    autocommit) it is committed at once, as any Django write there is.

    ``via``: the :class:`~jobfence.App` whose consumers validate the payload now, or a
    :class:`~jobfence.Producer` that knows consumers by name only; default: the App of
    ``JOBFENCE["APP"]``. A job refused (unknown consumer, identifier too long, invalid
    payload) raises before any SQL runs, so the block stays usable.
    """
    config = jobfence_settings()
    target = via if via is not None else _load_app(require_app(config))
    message = target.message(
        consumer, payload, job_id=job_id, tenant_id=tenant_id, correlation_id=correlation_id
    )
    wrapper = connections[config.database_alias if using is None else using]
    wrapper.validate_no_broken_transaction()  # a doomed atomic block: Django's own error
    wrapper.ensure_connection()
    with wrapper.wrap_database_errors:  # errors as Django's, like any ORM call's
        publish_sync(wrapper.connection, message, delay_seconds=delay_seconds)
