"""The one exception type for user errors.

Messages say what was expected, what was found, and what to do (STYLE.md 12). CLIs print the message
on one line and exit non-zero; `assert` stays for internal invariants.
"""


class CloverError(Exception):
    """A user-facing error: bad input, missing file, incompatible artifact."""
