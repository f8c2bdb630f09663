"""``prefix-worker`` command line: ``emulate`` (the engine emulator) and ``report`` (the KV-event
sidecar). CLI edge: dispatches to each command's ``main(argv) -> int`` with lazy imports, so
one command never pays for the other's dependencies."""

from __future__ import annotations

from router.shared.interrupt import exit_on_interrupt

with exit_on_interrupt():  # Ctrl-C while these load: exit 130, no traceback
    from collections.abc import Sequence

    from router.shared.process import run_commands
COMMANDS = {
    "emulate": "run emulated vLLM replicas on a CPU",
    "report": "publish a replica's KV-cache blocks and load to Redis",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``prefix-worker``: ``run_commands`` (status 130 on Ctrl-C while loading)."""
    return run_commands("prefix-worker", argv, COMMANDS, _run)


def _run(command: str, rest: list[str]) -> int:
    if command == "emulate":
        from worker.emulator.app import main as emulate_main

        return emulate_main(rest)
    from worker.report import main as report_main

    return report_main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
