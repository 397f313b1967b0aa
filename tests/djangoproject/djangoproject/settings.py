"""A minimal Django project using jobfence (tests/test_django.py, docs/django.md).

Its database is ``DJANGOPROJECT_DATABASE_URL`` (the test's own database); jobfence reads it
from ``DATABASES``, so no JOBFENCE_DATABASE_URL is set. ``DJANGOPROJECT_PASSWORD`` sets a
password (the tests check it is never printed); ``DJANGOPROJECT_JOBFENCE``, JSON, adds keys
to ``JOBFENCE``."""

import json
import os

from psycopg.conninfo import conninfo_to_dict

_db = conninfo_to_dict(os.environ["DJANGOPROJECT_DATABASE_URL"])

SECRET_KEY = "tests-only"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["jobfence.contrib.django", "points"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db["dbname"],
        "USER": _db.get("user", ""),
        "PASSWORD": os.environ.get("DJANGOPROJECT_PASSWORD", _db.get("password", "")),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
JOBFENCE = {
    "APP": "points.jobs:app",
    "WORKER": {"QUEUES": ["points"], "CONCURRENCY": 2},
    # a test's own keys, merged in (for the errors of bad settings and the docs example)
    **json.loads(os.environ.get("DJANGOPROJECT_JOBFENCE", "{}")),
}

if os.environ.get("DJANGOPROJECT_JOBS_ALIAS"):
    # jobfence on a second alias of the same database, the ORM on "default" (no router): a
    # handler's ORM write goes through another alias than the job's transaction.
    DATABASES["jobs"] = dict(DATABASES["default"])
    JOBFENCE["DATABASE_ALIAS"] = "jobs"

if os.environ.get("DJANGOPROJECT_ROOT_LOGGING"):
    # docs/django.md's LOGGING, as written: a root console handler (tests/test_django.py).
    import re
    from pathlib import Path

    _doc = (Path(__file__).resolve().parents[3] / "docs" / "django.md").read_text()
    _found = re.search(r"```python\n(LOGGING = \{.*?)```", _doc, re.DOTALL)
    assert _found, "docs/django.md shows a LOGGING with a root handler"
    exec(_found.group(1))  # the documented snippet, run as written
