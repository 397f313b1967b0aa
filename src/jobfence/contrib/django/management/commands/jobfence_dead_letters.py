"""``manage.py jobfence_dead_letters list|show|replay|replay-bulk|discard ...``:
``jobfence dead-letters`` on Django's database."""

from jobfence.contrib.django.commands import JobfenceCommand


class Command(JobfenceCommand):
    help = (
        "List, show, replay (one or in bulk) and discard dead letters: the commands and options"
        " of `jobfence dead-letters`."
    )
    jobfence_command = ("dead-letters",)
