"""Application modules that the CLI tests load with ``jobfence worker MODULE:ATTRIBUTE``."""
