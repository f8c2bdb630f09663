"""Log set-up shared by the router and the worker: text lines, or one JSON object per line
carrying the id of the request being served. No I/O beyond the stderr handler it installs.

``REQUEST_ID`` is a context variable the router's request-id middleware sets for the task
serving a request, so every line logged while serving it (proxy, routing, errors) carries the
id; lines from background loops carry ``null``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Final

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)
LOG_FORMATS: Final = ("text", "json")  # the log_format setting of the router and the worker
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ISO 8601 with milliseconds), ``level``,
    ``logger``, ``message``, ``request_id`` (or null), and ``exc_info`` (the traceback text)
    when an exception was logged."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": REQUEST_ID.get(),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str = "text") -> None:
    """Root logger at ``level`` (a ``logging`` level name, any case), writing ``log_format``
    (``text`` or ``json``) to stderr. Raises ``ValueError`` for another format."""
    if log_format not in ("text", "json"):
        raise ValueError(f"log format must be text or json, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


UNREACHABLE_LOG_INTERVAL_S: Final = 10.0  # one "still unreachable" line per this many seconds


class IntervalLog:
    """One log line per ``interval_s`` for a condition that repeats (each failed reconnect of a
    retry loop, a bad KV-event message, a write Redis refused), carrying how many times it
    happened since the last line: a Redis that stays down gets a line every 10 s, not one per
    retry (6 a second at first) nor none at all; a flood of bad input costs one line per interval.
    ``clock`` is monotonic seconds. Not thread-safe: one loop's callbacks."""

    def __init__(self, logger: logging.Logger, interval_s: float = UNREACHABLE_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self.num_since = 0  # occurrences since the last line
        self._last = -math.inf  # when the last line was written

    def __call__(self, level: int, message: str, *args: object) -> bool:
        """Count one occurrence; log ``message % args`` (with `` (N times since the last line)``
        when more than one) if ``interval_s`` passed since the last line. Returns whether it
        logged."""
        self.num_since += 1
        now = self.clock()
        if now - self._last < self.interval_s:
            return False
        if self.num_since > 1:
            message += f" ({self.num_since} times since the last line)"
        self.logger.log(level, message, *args)
        self._last, self.num_since = now, 0
        return True

    log = __call__

    def warning(self, message: str, *args: object) -> bool:
        """``self(logging.WARNING, message, *args)``."""
        return self(logging.WARNING, message, *args)

    def reset(self) -> None:
        """The condition ended: the next occurrence logs at once."""
        self._last, self.num_since = -math.inf, 0
