"""The management commands: each runs the ``jobfence`` command of the same name (its
arguments, output and exit status), on the database of ``DATABASES``."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from django.core.management.base import BaseCommand, CommandParser

from jobfence import cli
from jobfence.config import ENV_DATABASE_URL
from jobfence.contrib.django.settings import database_url, jobfence_settings
from jobfence.sync import SyncTransactionRunner


def run_jobfence(argv: list[str], *, sync_runner: SyncTransactionRunner | None = None) -> int:
    """``jobfence ARGV`` in this process, on ``DATABASES[JOBFENCE["DATABASE_ALIAS"]]``: that
    database's URL becomes this process's ``JOBFENCE_DATABASE_URL`` (jobfence's one way to be
    told its database, whose password its output and logs never show), and
    ``JOBFENCE["DATABASE_POOL_MODE"]``, when set, its ``JOBFENCE_DATABASE_POOL_MODE``. When
    ``LOGGING`` gives the root logger a handler, jobfence logs through it instead of adding
    its own."""
    config = jobfence_settings()
    os.environ[ENV_DATABASE_URL] = database_url(config.database_alias)
    config.export_pool_mode()
    # A root logger configured by LOGGING is followed: no handler of jobfence's own on top.
    return cli.main(argv, sync_runner=sync_runner, follow_logging=True)


class _ForwardingParser(CommandParser):
    """Django's own options (``--settings``, ``--verbosity``...) parsed as usual; everything
    else kept, in order, for the ``jobfence`` command."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        options, rest = self.parse_known_args(args, namespace)
        options.args = rest
        return options


class JobfenceCommand(BaseCommand):
    """A management command that runs ``jobfence <jobfence_command> ARGS``: the arguments,
    output and exit status are that command's; ``jobfence <command> --help`` lists them."""

    jobfence_command: ClassVar[tuple[str, ...]]

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.__class__ = _ForwardingParser
        parser.allow_abbrev = False  # no prefix of a jobfence flag taken for one of Django's
        shown = " ".join(self.jobfence_command)
        parser.usage = f"%(prog)s [ARGS of `jobfence {shown}`]"
        return parser

    def jobfence_argv(self, args: tuple[str, ...]) -> list[str]:
        return [*self.jobfence_command, *args]

    def handle(self, *args: Any, **options: Any) -> None:
        code = self.run(self.jobfence_argv(args))
        if code:
            raise SystemExit(code)

    def run(self, argv: list[str]) -> int:
        return run_jobfence(argv)
