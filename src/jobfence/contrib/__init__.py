"""Integrations with other libraries, each imported only when used (its extra installed)."""
