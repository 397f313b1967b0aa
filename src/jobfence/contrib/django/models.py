"""No Django models: jobfence's tables belong to its own migrations (``jobfence`` schema and
``core.*``). This module lets Django send ``post_migrate`` to the app."""
