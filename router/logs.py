"""Log set-up shared by the router and the worker: text lines, or one JSON object per line
carrying the id of the request being served. No I/O beyond the stderr handler it installs.

``REQUEST_ID`` is a context variable the router's request-id middleware sets for the task
serving a request, so every line logged while serving it (proxy, routing, errors) carries the
id; lines from background loops carry ``null``.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Final

REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)
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


class RateLimitedLog:
    """At most one log line per ``interval_s`` for a recurring condition (a bad message, a
    refused write), carrying how many occurrences it stands for. No I/O beyond the logger.

    ``log(level, msg, *args)`` logs at once if the last line was ``interval_s`` ago or more,
    suffixed ``" (N times in the last T s)"`` when occurrences were held back meanwhile; else it
    only counts. Uses ``time.monotonic``. A flood of bad input costs one line per interval.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.num_held = 0  # occurrences since the last line
        self._last_s: float | None = None  # monotonic time of the last line

    def log(self, level: int, msg: str, *args: object) -> bool:
        """Log or count one occurrence; True when a line was written."""
        now = time.monotonic()
        self.num_held += 1
        if self._last_s is not None and now - self._last_s < self.interval_s:
            return False
        if self.num_held > 1 and self._last_s is not None:
            msg = f"{msg} ({self.num_held} times in the last {now - self._last_s:.0f} s)"
        self.logger.log(level, msg, *args)
        self._last_s = now
        self.num_held = 0
        return True

    def warning(self, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, msg, *args)
