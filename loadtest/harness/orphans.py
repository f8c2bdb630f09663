"""No orphans: a child process started by the harness dies with the process that started it
(Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, set in the child between fork and exec), so a
killed demo, benchmark or test leaves no fleet and no Redis behind, SIGKILL included. Does I/O
(a system call in the child).

The signal is sent when the *thread* that started the child ends, so start such children from
a thread that lives as long as they should (the main thread, as every caller here does).
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
from collections.abc import Callable
from typing import Final

_PR_SET_PDEATHSIG: Final = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent ends; for ``preexec_fn`` (runs in
    the child between fork and exec). Does nothing where prctl is missing."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# what to pass as ``preexec_fn``: None off Linux (no prctl; a preexec_fn costs a fork-safety check)
DIE_WITH_PARENT: Final[Callable[[], None] | None] = (
    die_with_parent if sys.platform.startswith("linux") else None)
