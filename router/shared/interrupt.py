"""Ctrl-C while a command line starts: the process ends at once with status 130, no traceback.

A ``KeyboardInterrupt`` raised while modules load (seconds of imports on a busy machine) can
land inside importlib's own callbacks, where Python prints it as "Exception ignored ...
Traceback" and carries on loading, so no ``try`` around the imports can catch it reliably.
Until a command sets its own handling (an event loop's graceful stop, the load test's fleet
teardown), SIGINT ends the process instead: nothing has started that needs stopping. Stdlib
only, so that importing it opens no window of its own. Does I/O (signal handlers, exit).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any, Final

INTERRUPTED_STATUS: Final = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd command


def _exit_now(signum: int, frame: Any) -> None:
    os._exit(INTERRUPTED_STATUS)


@contextlib.contextmanager
def exit_on_interrupt() -> Iterator[None]:
    """Within the block, SIGINT ends the process at once (status 130); the previous handler
    is restored after it. Outside the main thread (where Python allows no handler) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
