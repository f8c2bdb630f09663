"""Secret settings (the Redis password; any key material) from files or the environment, never
from a command line, where every user of the machine can read them (``ps``, ``/proc/PID/cmdline``).
Pure apart from reading the named file.

A secret ``NAME`` has a ``NAME_file`` companion (``--redis-password-file``: a file holding only
the secret, as a Kubernetes Secret volume mounts it; one trailing newline is dropped), its own
environment variables, and a conventional one read last (``REDIS_PASSWORD``, as the Redis images
and clients use). The old ``--NAME`` flag still works, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from router.shared.settings import ConfigError

logger = logging.getLogger(__name__)

MAX_SECRET_BYTES: Final = 64 * 1024  # a password or key file is small; refuse to read a wrong path whole
REDIS_PASSWORD_ENV: Final = "REDIS_PASSWORD"  # the conventional variable, read after the component's own


class SecretError(ValueError):
    """A secret file that cannot be read, is empty, or a secret given two ways."""


def read_secret_file(path: str) -> str:
    """The secret held in file ``path``, without one trailing newline (``\\n`` or ``\\r\\n``).

    Raises ``SecretError`` when the file cannot be read, is larger than ``MAX_SECRET_BYTES``,
    is not UTF-8 or holds nothing."""
    try:
        with Path(path).open("rb") as handle:
            data = handle.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise SecretError(f"cannot read secret file {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_SECRET_BYTES:
        raise SecretError(f"secret file {path} is larger than {MAX_SECRET_BYTES} bytes")
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise SecretError(f"secret file {path} is not UTF-8 text") from exc
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise SecretError(f"secret file {path} is empty")
    return text


def resolve_secret(name: str, value: str | None, path: str | None, env: Mapping[str, str],
                   fallback_env: str | None = None) -> str | None:
    """The secret ``name`` from ``value`` (flag, component env var or YAML, already merged),
    else file ``path``, else the conventional ``fallback_env`` variable; ``None`` when none is
    set. Raises ``SecretError`` when both ``value`` and ``path`` are given or the file is bad."""
    if value and path:
        raise SecretError(f"{name} and {name}_file are both set; give one")
    if path:
        return read_secret_file(path)
    if value:
        return value
    return (env.get(fallback_env) or None) if fallback_env else None


def warn_if_on_command_line(argv: Sequence[str], flag: str, replacement: str) -> bool:
    """Log a warning when ``flag`` (``--redis-password``) is in ``argv``; return whether it was."""
    given = any(arg == flag or arg.startswith(flag + "=") for arg in argv)
    if given:
        logger.warning("%s puts the secret on the command line, where any user of the machine "
                       "can read it (ps); use %s instead", flag, replacement)
    return given


def resolve_redis_password(values: Mapping[str, Any], argv: Sequence[str],
                           env: Mapping[str, str]) -> str | None:
    """The Redis password of a component whose merged settings are ``values`` (keys
    ``redis_password``, ``redis_password_file``), parsed from ``argv`` (a ``--redis-password``
    there is warned about). Raises ``SecretError`` as ``resolve_secret`` does."""
    warn_if_on_command_line(argv, "--redis-password", "--redis-password-file")
    return resolve_secret("redis_password", values.get("redis_password"),
                          values.get("redis_password_file"), env, REDIS_PASSWORD_ENV)


def with_redis_password(values: dict[str, Any], argv: Sequence[str],
                        env: Mapping[str, str]) -> dict[str, Any]:
    """``values`` (``Settings.values(argv, env)``) with the Redis password resolved from its
    flag, env, YAML, file or ``REDIS_PASSWORD``; the router's and the worker's
    loaders. Raises ``ConfigError``."""
    try:
        values["redis_password"] = resolve_redis_password(values, argv, env)
    except SecretError as exc:
        raise ConfigError(str(exc)) from exc
    return values
