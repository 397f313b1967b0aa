"""``manage.py jobfence_cleanup [--batch-size N] [--every SECONDS] ...``: ``jobfence cleanup``
on Django's database."""

from jobfence.contrib.django.commands import JobfenceCommand


class Command(JobfenceCommand):
    help = "Delete expired fence rows in bounded batches (the options of `jobfence cleanup`)."
    jobfence_command = ("cleanup",)
