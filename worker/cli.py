"""``prefix-worker`` command line: ``emulate`` (the engine emulator) and ``report`` (the KV-event
sidecar). CLI edge: dispatches to each command's ``main(argv) -> int`` with lazy imports, so
one command never pays for the other's dependencies."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from router.version import version_line

COMMANDS = {
    "emulate": "run emulated vLLM replicas on a CPU",
    "report": "publish a replica's KV-cache blocks and load to Redis",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``prefix-worker``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["--version"], ["-V"]):
        print(version_line("prefix-worker"))
        return 0
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        lines = "\n".join(f"  {name:8s} {text}" for name, text in COMMANDS.items())
        stream = sys.stdout if args and args[0] in ("-h", "--help") else sys.stderr
        print(f"usage: prefix-worker [--version] {{{','.join(COMMANDS)}}} ...\n\ncommands:\n{lines}",
              file=stream)
        return 0 if stream is sys.stdout else 2
    command, rest = args[0], args[1:]
    if command == "emulate":
        from worker.emulator.app import main as emulate_main

        return emulate_main(rest)
    from worker.report import main as report_main

    return report_main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
