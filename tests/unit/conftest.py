"""The fast loop's guard: a unit test that starts a process (``subprocess``, ``asyncio``'s
subprocesses, ``os.fork``/``posix_spawn``/``exec*``, ``multiprocessing``) must be marked
``slow``, so ``pytest -m "not slow" tests/unit`` stays in-process. Python's audit hooks see
every process start; one started while an unmarked unit test sets up or runs fails that test
with the command it started."""

from __future__ import annotations

import sys
from collections.abc import Generator
from typing import Any, Final

import pytest

# audit events of a new process (https://docs.python.org/3/library/audit_events.html)
_PROCESS_EVENTS: Final = frozenset({"subprocess.Popen", "os.posix_spawn", "os.spawn", "os.fork",
                                    "os.forkpty", "os.exec", "os.system"})
_watching: list[list[str]] = []  # the started commands of the running unmarked test (0 or 1)


def _from_find_library() -> bool:
    """True inside ``ctypes.util.find_library``: its ``ldconfig -p`` runs once, when a library
    (uuid, zmq...) is first loaded, whichever test imports it first; not the test's own process."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == "ctypes.util":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _watching and event in _PROCESS_EVENTS and not _from_find_library():
        _watching[-1].append(f"{event} {args[:2]!r}"[:200])


sys.addaudithook(_audit)  # cannot be removed: it does nothing while no unmarked test runs


def _watched(item: pytest.Item) -> Generator[None, None, None]:
    if item.get_closest_marker("slow") is not None:
        yield
        return
    started: list[str] = []
    _watching.append(started)
    try:
        yield
    finally:
        _watching.remove(started)
    if started:
        pytest.fail(f"{item.nodeid} starts a process ({started[0]}): mark it slow "
                    "(pytest.mark.slow), the fast loop is in-process", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    return (yield from _watched(item))
