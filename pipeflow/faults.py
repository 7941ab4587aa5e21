"""The failures pipeflow says in one sentence: what went wrong, naming the file or key,
and what to do. An app, the launcher and a rank print such an error's message alone (no
traceback: the sentence is the whole report); any other exception is a bug and keeps
its traceback.
"""

from __future__ import annotations

import os


class Fault(Exception):
    """A failure the user can act on, whose message is one sentence naming the file or
    key and the reason."""


class WriteFailed(Fault, OSError):
    """A file that could not be written whole (a full disk, a read-only folder, a path
    through a file): ``could not write PATH: REASON``. ``errno`` is the cause's."""

    def __init__(self, path: str | os.PathLike, err: OSError | str):
        reason = err if isinstance(err, str) else (err.strerror or str(err))
        super().__init__(f"could not write {os.fspath(path)}: {reason}")
        self.path = os.fspath(path)
        self.errno = None if isinstance(err, str) else err.errno


def said(err: BaseException) -> str:
    """What to print of ``err``: a Fault's sentence, else the exception's class and message
    (the line a traceback ends with)."""
    if isinstance(err, Fault):
        return str(err)
    text = str(err)
    return f"{type(err).__module__}.{type(err).__qualname__}: {text}".replace("builtins.", "") if text \
        else type(err).__qualname__
