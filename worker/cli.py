"""``prefix-worker`` command line: ``emulate`` (the engine emulator) and ``report`` (the KV-event
sidecar). CLI edge: dispatches to each command's ``main(argv) -> int`` with lazy imports, so
one command never pays for the other's dependencies."""

from __future__ import annotations

from router.shared.interrupt import exit_on_interrupt

with exit_on_interrupt():  # Ctrl-C while these load: exit 130, no traceback
    import sys
    from collections.abc import Sequence

    from router.shared.process import command_preamble
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
    status = command_preamble("prefix-worker", args, COMMANDS)
    if status is not None:
        return status
    command, rest = args[0], args[1:]
    if command == "emulate":
        from worker.emulator.app import main as emulate_main

        return emulate_main(rest)
    from worker.report import main as report_main

    return report_main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
