"""What the router's, the worker's and the emulator's settings share: the one ``ConfigError``
and the YAML reader. Pure apart from reading the YAML file it is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["ConfigError", "StartupError", "read_config_file"]


class ConfigError(ValueError):
    """A setting is missing, malformed or out of range (the router, the worker and the emulator
    report it as one line, exit status 2)."""


class StartupError(RuntimeError):
    """A process could not start serving (a port in use, an unknown host): the router and the
    worker report it as one line, exit status 1."""


def read_config_file(path: str, error: type[Exception] = ConfigError) -> dict[str, Any]:
    """The mapping in YAML file ``path`` (an empty file is ``{}``). Raises ``error`` when the
    file cannot be read or parsed or does not hold a mapping."""
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise error(f"cannot read config file {path}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise error(f"config file {path} must hold a mapping")
    return loaded
