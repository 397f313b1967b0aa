"""The Django app ``jobfence.contrib.django`` (label ``jobfence``)."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class JobfenceConfig(AppConfig):
    name = "jobfence.contrib.django"
    label = "jobfence"
    verbose_name = "jobfence"

    def ready(self) -> None:
        post_migrate.connect(_migrate_jobfence, sender=self, dispatch_uid="jobfence-migrate")


def _migrate_jobfence(sender: AppConfig, using: str, verbosity: int = 1, **kwargs: Any) -> None:
    """After every ``manage.py migrate``: apply the jobfence migrations that this version of
    jobfence ships and the database lacks (after an upgrade of jobfence), idempotently."""
    from jobfence.contrib.django.schema import apply_schema

    for name in apply_schema(using):
        if verbosity >= 1 and (stdout := kwargs.get("stdout")) is not None:
            stdout.write(f"  jobfence: applied {name}\n")
