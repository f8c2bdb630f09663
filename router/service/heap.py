"""Giving freed heap back to the OS after large requests (glibc ``malloc_trim``). Process edge.

Parsing, tokenizing and hashing a multi-MB prompt allocates hundreds of MB in short-lived
objects across the event loop and the tokenizer threads; glibc keeps the freed pages in its
per-thread arenas, so the router's RSS stays at its peak (issue 15: +125 MB after 24 prompts
of 2 MB with every prompt cache off). ``malloc_trim(0)`` returns the free pages of every
arena. It is called from the housekeeping loop, off the event loop, when RSS grew by
``TRIM_GROWTH_BYTES`` since the last trim, or by ``IDLE_GROWTH_BYTES`` and the last trim is
``IDLE_TRIM_S`` old (what a burst left behind); on a libc without it this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable
from typing import Final

TRIM_GROWTH_BYTES: Final = 64 << 20
IDLE_GROWTH_BYTES: Final = 4 << 20
IDLE_TRIM_S: Final = 10.0
_PAGE: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
        return trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


def rss_bytes() -> int | None:
    """This process's resident set size in bytes (Linux ``/proc/self/statm``), else None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    """``due()`` says when RSS grew enough to trim; ``trim()`` (blocking, run it in a thread)
    returns the free heap pages to the OS. Both are no-ops where unsupported."""

    def __init__(self, growth_bytes: int = TRIM_GROWTH_BYTES) -> None:
        self.growth_bytes = growth_bytes
        self._trim = _malloc_trim()
        self._baseline = rss_bytes() or 0
        self._trimmed_at = time.monotonic()
        self.num_trims = 0

    def due(self) -> bool:
        rss = rss_bytes()
        if self._trim is None or rss is None:
            return False
        growth = rss - self._baseline
        return growth > self.growth_bytes or (
            growth > IDLE_GROWTH_BYTES and time.monotonic() - self._trimmed_at > IDLE_TRIM_S)

    def trim(self) -> None:
        if self._trim is not None:
            self._trim(0)
            self.num_trims += 1
        self._baseline = rss_bytes() or 0
        self._trimmed_at = time.monotonic()
