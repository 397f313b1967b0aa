"""jobfence's schema (the ``jobfence`` and ``core`` schemas), applied by jobfence's own
migration runner. Its later migrations are applied by every ``manage.py migrate`` after an
upgrade of jobfence (``jobfence.contrib.django.apps``), so this is the only Django migration;
a migration of yours that uses jobfence's tables or ``jobfence.enqueue`` depends on it.

Not reversible: the schema holds the dead letters, which are never deleted."""

from __future__ import annotations

from typing import Any

from django.db import migrations


def apply(apps: Any, schema_editor: Any) -> None:
    from jobfence.contrib.django.schema import apply_schema

    apply_schema(schema_editor.connection.alias)


class Migration(migrations.Migration):
    initial = True
    dependencies = []
    operations = [migrations.RunPython(apply, elidable=False)]
