"""What the project's process entry points share: the event loop they run on, the atomic JSON file
they announce themselves with, and the subcommand preamble of a command line. No I/O beyond the
file written, the lines printed and the SIGINT handler a command line starts under.

One copy each for ``prefix-router`` (``router.cli``, ``router.service.server``), ``prefix-worker``
(``worker.cli``, ``worker.report``) and the emulator (``worker.emulator.app``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from router.shared.interrupt import exit_on_interrupt
from router.shared.settings import unknown_command_line
from router.shared.version import version_line


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's ``new_event_loop`` when uvloop is installed (not on Windows), else None, which
    ``asyncio.Runner(loop_factory=...)`` takes as asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file beside it and a rename, so a
    reader polling ``path`` (a ready file, the fleet cache) never sees it half written. The
    temporary name carries the process id: two processes given the same path do not write into
    each other's temporary file. Raises ``OSError`` (and ``TypeError`` for data JSON cannot
    hold)."""
    target = Path(path)
    tmp = target.with_name(f"{target.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, target)


def run_commands(prog: str, argv: Sequence[str] | None, commands: Mapping[str, str],
                 run: Callable[[str, list[str]], int]) -> int:
    """The entry point of a command line with subcommands: ``argv`` (None: ``sys.argv[1:]``)
    through ``command_preamble``, then ``run(command, rest of argv)``. Returns the exit status.
    Ctrl-C before the command takes over the signal (during the imports of seconds on a busy
    machine) ends it with status 130 and no traceback."""
    with exit_on_interrupt():  # a command running an event loop sets its graceful stop
        args = list(sys.argv[1:] if argv is None else argv)
        status = command_preamble(prog, args, commands)
        return status if status is not None else run(args[0], args[1:])


def command_preamble(prog: str, argv: Sequence[str], commands: Mapping[str, str]) -> int | None:
    """What a command line with subcommands does before it dispatches ``argv[0]``: ``--version``
    or ``-V`` prints the version line (exit status 0); ``-h``/``--help`` prints the usage on
    stdout (0) and no argument prints it on stderr (2); an unknown command or option prints one
    line naming the closest command (2). Returns that exit status, or None when ``argv[0]`` is
    one of ``commands`` ({name: one-line description}) and the caller dispatches it."""
    if list(argv[:1]) in (["--version"], ["-V"]):
        print(version_line(prog))
        return 0
    if argv and argv[0] not in commands and argv[0] not in ("-h", "--help"):
        print(unknown_command_line(prog, argv[0], commands), file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        lines = "\n".join(f"  {name:8s} {text}" for name, text in commands.items())
        stream = sys.stdout if argv else sys.stderr
        print(f"usage: {prog} [--version] {{{','.join(commands)}}} ...\n\ncommands:\n{lines}",
              file=stream)
        return 0 if stream is sys.stdout else 2
    return None
