"""jobfence in a Django project (docs/django.md): ``pip install 'jobfence[django]'`` and
``"jobfence.contrib.django"`` in ``INSTALLED_APPS``.

- the database is Django's: ``DATABASES[JOBFENCE["DATABASE_ALIAS"]]`` (``settings``);
- ``manage.py migrate`` applies jobfence's schema (``migrations``, ``apps``);
- :func:`enqueue` writes a job in the current ``transaction.atomic()`` block;
- ``manage.py jobfence_worker`` runs plain ``def`` handlers inside ``transaction.atomic()`` on
  Django's own connection, the fence in the same transaction (:class:`DjangoRunner`);
- ``manage.py jobfence_migrate | jobfence_dead_letters | jobfence_cleanup``: the Ops commands.
"""

from __future__ import annotations

from jobfence.contrib.django.producer import enqueue
from jobfence.contrib.django.runner import DjangoRunner
from jobfence.contrib.django.settings import JobfenceSettings, database_url, jobfence_settings

__all__ = ["DjangoRunner", "JobfenceSettings", "database_url", "enqueue", "jobfence_settings"]
