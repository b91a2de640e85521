"""The one exception type for user errors.

Messages say what was expected, what was found, and what to do (docs/design.md, Conventions 12). CLIs print the message
on one line and exit non-zero; `assert` stays for internal invariants.
"""


class CloverError(Exception):
    """A user-facing error: bad input, missing file, incompatible artifact.

    param: the public API argument at fault ("prompt", "max_new_tokens", "stop", "temperature", "top_p"),
    when one is; the server reports it as OpenAI's error `param` without reading the message."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
