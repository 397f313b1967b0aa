"""``manage.py jobfence_migrate [--print-sql]``: ``jobfence migrate`` on Django's database
(``manage.py migrate`` does the same for a project with ``jobfence.contrib.django``)."""

from jobfence.contrib.django.commands import JobfenceCommand


class Command(JobfenceCommand):
    help = "Apply jobfence's schema migrations to Django's database (idempotent, locked)."
    jobfence_command = ("migrate",)
