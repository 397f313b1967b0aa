"""``manage.py jobfence_worker [options of jobfence worker]``: the consumers of
``JOBFENCE["APP"]``, plain ``def`` handlers run inside ``transaction.atomic()`` on Django's own
connection with the fence in the same transaction (:class:`~jobfence.contrib.django.
DjangoRunner`); ``JOBFENCE["WORKER"]`` gives the options' defaults."""

from jobfence.contrib.django.commands import JobfenceCommand, run_jobfence
from jobfence.contrib.django.runner import DjangoRunner
from jobfence.contrib.django.settings import jobfence_settings, require_app


class Command(JobfenceCommand):
    help = (
        "Run the consumers of settings.JOBFENCE['APP']; sync handlers inside"
        " transaction.atomic() on Django's connection (the options of `jobfence worker`)."
    )
    jobfence_command = ("worker",)

    def jobfence_argv(self, args: tuple[str, ...]) -> list[str]:
        config = jobfence_settings()
        # the command line's queues replace the settings' (its other flags win as given last)
        queues_given = any(a == "--queue" or a.startswith("--queue=") for a in args)
        defaults = config.worker_argv(with_queues=not queues_given)
        return ["worker", require_app(config), *defaults, *args]

    def run(self, argv: list[str]) -> int:
        return run_jobfence(argv, sync_runner=DjangoRunner(jobfence_settings().database_alias))
