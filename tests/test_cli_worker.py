"""``jobfence --version``, and ``jobfence worker MODULE:ATTRIBUTE`` naming what is wrong with the
module or attribute it was given."""

from __future__ import annotations

from importlib.metadata import version

from test_startup_and_cli import NOWHERE, one_error_line, run_cli


def test_version_prints_the_installed_package_version() -> None:
    done = run_cli("--version", url=NOWHERE)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"jobfence {version('jobfence')}"


def test_worker_with_a_misspelt_attribute_says_the_module_has_no_such_attribute() -> None:
    line = one_error_line(run_cli("worker", "cliapps.short_ttl:ap", url=NOWHERE))
    assert line == (
        "jobfence: error: module 'cliapps.short_ttl' has no attribute 'ap' (its jobfence.App: app)"
    )


def test_worker_with_a_module_that_fails_to_import_gives_its_import_error() -> None:
    line = one_error_line(run_cli("worker", "cliapps.broken_import:app", url=NOWHERE))
    assert line == (
        "jobfence: error: module 'cliapps.broken_import' does not import: "
        "ModuleNotFoundError: No module named 'jobfence_no_such_dependency'"
    )


def test_worker_with_a_module_that_does_not_exist_says_so() -> None:
    line = one_error_line(run_cli("worker", "cliapps.no_such_module:app", url=NOWHERE))
    assert "cannot import module 'cliapps.no_such_module'" in line
