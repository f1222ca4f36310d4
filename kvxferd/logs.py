"""Logging: readable text or one JSON object per line (`--log-format json`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Hashable
from types import TracebackType

ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]


class Throttle:
    """Whether a message about `key` may be logged now: at most once every `every_s` per key, so
    one cause repeated thousands of times a second (a flood, a peer refusing every claim) makes
    one line. Keys can come off the wire: past MAX_KEYS the memory starts again."""

    MAX_KEYS = 4096

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self._clock = every_s, clock
        self._last: dict[Hashable, float] = {}

    def due(self, key: Hashable = None) -> bool:
        now = self._clock()
        if now - self._last.get(key, float("-inf")) < self.every_s:
            return False
        if len(self._last) >= self.MAX_KEYS:
            self._last.clear()
        self._last[key] = now
        return True


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape(text: str) -> str:
    """`text` with control characters (C0, DEL, C1, line and bidi controls: everything not printable)
    written as repr-style escapes (\\n, \\x1b), so strings from engines and peers cannot move the
    cursor, recolour an operator's terminal or start a line of their own."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch in _NAMED:
            out.append(_NAMED[ch])
        elif ch.isprintable():
            out.append(ch)
        else:
            n = ord(ch)
            out.append(f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")
    return "".join(out)


class TextFormatter(logging.Formatter):
    """One record, one line: the message is escaped (ids off the wire can hold newlines that would
    forge a record of their own); a traceback keeps its lines, each indented so none can pass for
    a record."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape(super().formatMessage(record))

    def formatException(self, ei: ExcInfo) -> str:
        return _indent(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indent(super().formatStack(stack_info))


def _indent(text: str) -> str:
    return "\n".join("  | " + escape(line) for line in text.split("\n"))


class JsonFormatter(logging.Formatter):
    # Safe as it is: json.dumps escapes every control character (and, ensure_ascii, all non-ASCII).
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                 "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
