"""The installed package's version, for ``--version`` on every CLI and for telemetry. Pure
apart from reading the installed distribution's metadata."""

from __future__ import annotations

from importlib import metadata
from typing import Final

DISTRIBUTION: Final = "prefix-router"  # one distribution holds router, worker and loadtest


def version() -> str:
    """The installed ``prefix-router`` version (``"unknown"`` when run from an uninstalled tree)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def version_line(prog: str) -> str:
    """What ``PROG --version`` prints: ``"PROG VERSION"`` (no newline)."""
    return f"{prog} {version()}"
