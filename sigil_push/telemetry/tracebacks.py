"""Tracebacks for the service log, without the messages of the exceptions they show.

An unexpected exception's message can quote the values it failed on: asyncpg appends the
server's DETAIL (`Key (pubkey, token)=(…) already exists`, `Failing row contains (…)`), an
HTTP client names the URL it fetched (a WebPush endpoint is a device token, some relay URLs
carry an npub), a provider library may repeat the token it was handed. Logs never carry keys
or tokens, so where such an exception is logged with its traceback, the log keeps what an
operator debugs with, the exception's type and the frames it passed through (code, not
values), and withholds the message, for the exception and every one chained to it.
"""

from __future__ import annotations

import logging

WITHHELD = "(message withheld: it may quote keys, tokens or URLs)"


class MessageWithheld(Exception):
    """Stands in for a logged exception: its message names the exception's type, its
    traceback is the exception's own."""


def withheld(exc: BaseException) -> MessageWithheld:
    """`exc` for `exc_info=`: its type and frames (and its causes' and contexts'), no message."""
    return _stand_in(exc, set())


def _stand_in(exc: BaseException, seen: set[int]) -> MessageWithheld:
    seen.add(id(exc))
    stand_in = MessageWithheld(f"{type(exc).__module__}.{type(exc).__qualname__} {WITHHELD}")
    stand_in.__traceback__ = exc.__traceback__
    if exc.__cause__ is not None and id(exc.__cause__) not in seen:
        stand_in.__cause__ = _stand_in(exc.__cause__, seen)
    if exc.__context__ is not None and id(exc.__context__) not in seen:
        stand_in.__context__ = _stand_in(exc.__context__, seen)
    stand_in.__suppress_context__ = exc.__suppress_context__
    return stand_in


class WithholdMessages(logging.Filter):
    """For a library's logger that logs exceptions it caught with their traceback (uvicorn's
    `Exception in ASGI application`): the record's exception becomes `withheld(...)`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is not None and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            if not isinstance(exc, MessageWithheld):
                record.exc_info = (MessageWithheld, withheld(exc), exc.__traceback__)
                record.exc_text = None
        return True
