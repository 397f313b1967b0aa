"""A module that exists but fails while importing (it needs a package that is not installed)."""

from __future__ import annotations

import jobfence_no_such_dependency  # noqa: F401

from jobfence import App

app = App()
