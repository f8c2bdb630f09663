"""``prefix-worker`` command line: ``emulate`` (the engine emulator) and ``report`` (the KV-event
sidecar). CLI edge: dispatches to each command's ``main(argv) -> int`` with lazy imports, so
one command never pays for the other's dependencies."""

from __future__ import annotations

from router.shared.interrupt import exit_on_interrupt

with exit_on_interrupt():  # Ctrl-C while these load: exit 130, no traceback
    import sys
    from collections.abc import Sequence

    from router.shared.settings import unknown_command_line
    from router.shared.version import version_line
COMMANDS = {
    "emulate": "run emulated vLLM replicas on a CPU",
    "report": "publish a replica's KV-cache blocks and load to Redis",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``prefix-worker``. Ctrl-C before a command takes over the signal (during the
    imports of seconds on a busy machine) ends it with status 130 and no traceback."""
    with exit_on_interrupt():  # a command running an event loop sets its graceful stop
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["--version"], ["-V"]):
        print(version_line("prefix-worker"))
        return 0
    if args and args[0] not in COMMANDS and args[0] not in ("-h", "--help"):
        print(unknown_command_line("prefix-worker", args[0], COMMANDS), file=sys.stderr)
        return 2
    if not args or args[0] in ("-h", "--help"):
        lines = "\n".join(f"  {name:8s} {text}" for name, text in COMMANDS.items())
        stream = sys.stdout if args else sys.stderr
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
