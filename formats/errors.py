"""The one error type every bad input becomes.

The CLI turns a `StreamoeError` into a single stderr line and a non-zero exit; anything else is a bug
and keeps its traceback.
"""


class StreamoeError(Exception):
    """A user-facing failure: the message names the file and what is wrong with it."""


def fail(path: object, problem: str) -> StreamoeError:
    """Build the canonical `PATH: problem` error."""
    return StreamoeError(f"{path}: {problem}")


class ContextFull(StreamoeError):
    """A prompt longer than what the planned context (--ctx) has left: a chat can go on once it is emptied."""
