"""clover.tools: command-line entry points."""
