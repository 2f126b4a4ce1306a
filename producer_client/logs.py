"""Log lines that users cannot forge: request paths, ids, prompts' field names and error messages
reach the logs, so every control character in a record's message (a newline, a carriage return, a
terminal's escape sequence, a Unicode line separator) is written escaped, and a record is one
line. A traceback keeps its lines, each indented, escaped the same way: no line of it can pass
for a record of its own."""

from __future__ import annotations

import logging
import re
import sys
from types import TracebackType

# What logging hands formatException: sys.exc_info()'s triple.
ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]

CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
TRACEBACK_INDENT = "    "


def escaped(text: str) -> str:
    return CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class OneLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        copy = logging.makeLogRecord(record.__dict__)  # other handlers see the record as it was
        copy.msg, copy.args = escaped(record.getMessage()), None
        return super().format(copy)

    def formatException(self, exc_info: ExcInfo) -> str:
        return "\n".join(TRACEBACK_INDENT + escaped(line) for line in super().formatException(exc_info).splitlines())

    def formatStack(self, stack_info: str) -> str:
        return "\n".join(TRACEBACK_INDENT + escaped(line) for line in stack_info.splitlines())


def configure(level: str, fmt: str) -> None:
    """The root logger, to stderr, through OneLineFormatter."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(fmt))
    logging.basicConfig(level=level.upper(), handlers=[handler])
