"""The documentation states facts the code decides: the newest migration, every command, flag
and environment variable, and links between pages. These tests keep the two in step, run the
snippets whose output the pages show (sqlalchemy.md's schema command, configuration.md's --json
error; the code examples of the other pages run in test_docs_producers.py,
test_docs_sqlalchemy.py, test_readme.py and test_django.py), hold the rules stated on several
pages to one wording, and keep work-log words (sessions, issue numbers, an unpublished spec's
jargon) out of what users read."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from psycopg.conninfo import conninfo_to_dict

from jobfence.cli import build_parser
from test_cli_dead_letters import dl
from test_cli_json_errors import json_error

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = ROOT / "docs" / "configuration.md"
CONCEPTS = ROOT / "docs" / "concepts.md"
MIGRATIONS = ROOT / "src" / "jobfence" / "migrations"


def user_docs() -> list[Path]:
    """Every page a user reads: the README, the changelog, docs/ and the benchmarks' README."""
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md"]
    pages += sorted((ROOT / "docs").rglob("*.md"))
    return [page for page in pages if page.exists()]


def prose(text: str) -> str:
    """The text without fenced code blocks (commands, output and SQL are not prose)."""
    return re.sub(r"^[ \t]*(```|~~~).*?^[ \t]*\1", "", text, flags=re.DOTALL | re.MULTILINE)


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# --- facts --------------------------------------------------------------------------------------


def test_configuration_names_the_newest_migration() -> None:
    newest = max(path.stem for path in MIGRATIONS.glob("[0-9][0-9][0-9][0-9]_*.sql"))
    named = re.findall(r"newest\s+migration\s+is\s+`(\d{4}_\w+)`", read(CONFIGURATION))
    assert named == [newest], (
        f"docs/configuration.md must say 'the newest migration is `{newest}`' once; "
        f"it names {named}"
    )


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (sub)command of the CLI, as its path of names (`("dead-letters", "show")`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield (*path, name), child
                yield from commands(child, (*path, name))


def long_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [
        flag
        for action in parser._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    ]


def section(text: str, heading_start: str) -> str:
    """The text under the first heading that starts with heading_start, up to the next heading
    of the same or a higher level."""
    match = re.search(rf"^(#+) {re.escape(heading_start)}.*$", text, re.MULTILINE)
    assert match, f"docs/configuration.md has no heading starting {heading_start!r}"
    level = len(match.group(1))
    rest = text[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
    return rest[: end.start()] if end else rest


def mentions(text: str, word: str) -> bool:
    """`word` written as code: `word`, `word ARG`, `word=...` or `word,...` inside backticks."""
    return re.search(rf"`{re.escape(word)}(?=[`\s=,\]\[])", text) is not None


def test_every_cli_command_and_flag_is_documented_in_configuration_md() -> None:
    text = read(CONFIGURATION)
    parser = build_parser()
    missing = [f"jobfence {flag}" for flag in long_flags(parser) if not mentions(text, flag)]
    found = list(commands(parser))
    assert len(found) >= 7, f"the CLI parser has fewer commands than expected: {found}"
    for path, command in found:
        top = section(text, f"`jobfence {path[0]}")
        if len(path) > 1 and not mentions(top, path[-1]):
            missing.append("jobfence " + " ".join(path))
        missing += [
            f"jobfence {' '.join(path)} {flag}"
            for flag in long_flags(command)
            if not mentions(top, flag)
        ]
    assert not missing, f"not documented in docs/configuration.md: {missing}"


def environment_variables() -> set[str]:
    """Every JOBFENCE_* variable the package names in full (as a string literal)."""
    names: set[str] = set()
    for source in (ROOT / "src" / "jobfence").rglob("*.py"):
        names |= set(re.findall(r"[\"'](JOBFENCE_[A-Z0-9_]*[A-Z0-9])[\"']", read(source)))
    return names


def test_every_environment_variable_is_documented_in_configuration_md() -> None:
    names = environment_variables()
    assert "JOBFENCE_DATABASE_URL" in names
    text = read(CONFIGURATION)
    missing = sorted(name for name in names if f"`{name}`" not in text)
    assert not missing, f"not documented in docs/configuration.md: {missing}"


# --- links --------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = prose(read(path))
    found: set[str] = set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+?)\s*#*$", text, re.MULTILINE):
        base = slug(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def links(path: Path) -> Iterator[str]:
    text = prose(read(path))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    yield from re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    yield from re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.MULTILINE)


def test_every_relative_link_points_to_a_file_and_heading_that_exist() -> None:
    broken: list[str] = []
    for page in user_docs():
        for target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not linked.exists() or ROOT not in linked.parents:
                broken.append(f"{where}: no such file in the repository")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{where}: no heading or anchor #{anchor}")
    assert not broken, "broken links:\n" + "\n".join(broken)


# --- words --------------------------------------------------------------------------------------

WORK_LOG = [
    (r"\bsessions?\s*#?\d+", "a session number"),
    (r"\b(?:this|last|previous|next|earlier|later)\s+sessions?\b", "sessions"),
    (r"\bsessions?'s?\s+(?:run|figures|work|machine|code)", "sessions"),
    (r"\bissues?\s*#?\d+", "an issue number"),
    (r"\bthe\s+issue's\b", "the issue's (targets, words...)"),
    (r"\bjob-infrastructure\.md\b|\bDECISIONS\.md\b", "a spec file not in the repository"),
    (r"\b(?:spec\s+)?[Bb]ehaviou?r\s+\d+\b|\bTS-\d{3}\b|\bDEC-[A-Z]\d+\b", "spec numbering"),
]


@pytest.mark.parametrize("page", user_docs(), ids=lambda page: str(page.relative_to(ROOT)))
def test_a_page_users_read_has_no_work_log_words(page: Path) -> None:
    text = read(page)
    found = [
        f"line {text.count(chr(10), 0, match.start()) + 1}: {match.group(0)!r} ({what})"
        for pattern, what in WORK_LOG
        for match in re.finditer(pattern, text, re.IGNORECASE)
    ]
    assert not found, f"{page.relative_to(ROOT)} reads as a work log:\n" + "\n".join(found)


def test_every_decision_number_a_page_uses_is_defined_in_concepts_md() -> None:
    defined = anchors(CONCEPTS)
    undefined = sorted(
        f"{page.relative_to(ROOT)}: {number}"
        for page in user_docs()
        for number in set(re.findall(r"\bD(?:10|[1-9])\b", read(page)))
        if number.lower() not in defined
    )
    assert not undefined, (
        "decision numbers used without a definition in docs/concepts.md "
        f'(an anchor <a id="d4"></a> in its Behaviour reference): {undefined}'
    )


# --- one rule, one wording; snippets that run -----------------------------------------------------

RULE = re.compile(r"<!-- rule: (?P<name>[^>]+?) -->\n(?P<text>.*?)<!-- /rule -->", re.DOTALL)
TRANSACTION_RULE_PAGES = ["sync.md", "sqlalchemy.md", "django.md", "concepts.md"]


def test_the_transaction_rule_is_stated_in_the_same_words_on_every_handler_page() -> None:
    """How a handler must not end its transaction, and what happens if it tries: one rule for
    every flavour, the same text wherever it is stated."""
    stated: dict[str, str] = {}
    for name in TRANSACTION_RULE_PAGES:
        found = [
            m.group("text")
            for m in RULE.finditer(read(ROOT / "docs" / name))
            if m.group("name") == "ending the transaction"
        ]
        assert len(found) == 1, f"docs/{name} states the transaction rule {len(found)} times"
        stated[name] = found[0]
    assert len(set(stated.values())) == 1, "the transaction rule differs between pages"
    for page in user_docs():  # and nowhere is a commit in a handler said to be retried
        assert "transient failure, so\n  the job is retried" not in read(page)


def test_the_command_line_usage_lists_every_command() -> None:
    parser = build_parser()
    names = [path[0] for path, _ in commands(parser) if len(path) == 1]
    usage = section(read(CONFIGURATION), "Command line")
    shown = re.search(r"\{([a-z,-]+)\} \.\.\.", usage)
    assert shown, "docs/configuration.md's usage line lists no commands"
    assert shown.group(1).split(",") == names


def test_the_sqlalchemy_extra_brings_what_the_asyncio_paths_need() -> None:
    """The documented AsyncSession producer and async_session_for need greenlet, which
    SQLAlchemy 2.1 installs only with its asyncio extra."""
    import tomllib

    extras = tomllib.loads(read(ROOT / "pyproject.toml"))["project"]["optional-dependencies"]
    assert any(
        re.match(r"sqlalchemy\[[^\]]*\basyncio\b", req) or req.startswith("greenlet")
        for req in extras["sqlalchemy"]
    ), extras["sqlalchemy"]


def test_the_sqlalchemy_page_applies_the_schema_as_written(empty_database_url: str) -> None:
    """docs/sqlalchemy.md's `jobfence migrate` line, run in a shell on a fresh database (its
    example URL replaced by the test's), migrates it; run again, it is up to date."""
    block = re.search(
        r"## jobfence's schema\n.*?```sh\n(.*?)```",
        read(ROOT / "docs" / "sqlalchemy.md"),
        re.DOTALL,
    )
    assert block, "docs/sqlalchemy.md shows how to apply the schema"
    parts = conninfo_to_dict(empty_database_url)
    url = (
        f"postgresql://{quote(parts.get('user', ''))}@/{quote(parts['dbname'])}"
        f"?host={quote(parts.get('host', ''))}&port={parts.get('port', 5432)}"
    )
    env_password = {"PGPASSWORD": str(parts["password"])} if parts.get("password") else {}
    command = block.group(1).strip().replace("postgresql://app@db:5432/app", shlex.quote(url))
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, **env_password, "PATH": path}
    env.pop("JOBFENCE_DATABASE_URL", None)

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            command, shell=True, env=env, capture_output=True, text=True, timeout=60, check=False
        )

    first = run()
    assert first.returncode == 0, first.stderr
    assert "applied 0001_" in first.stdout, first.stdout
    again = run()
    assert again.returncode == 0 and "already up to date" in again.stdout, again.stdout


def test_the_documented_json_error_is_what_the_command_prints(database_url: str) -> None:
    block = re.search(
        r"```\n\$ (jobfence dead-letters show .*)\n(\{.*\})\n```", read(CONFIGURATION)
    )
    assert block, "docs/configuration.md shows a --json error"
    command, shown = block.group(1).split()[1:], json.loads(block.group(2))
    done = dl(*command[1:], url=database_url)
    assert json_error(done) == shown
