"""The one settings mechanism of the router, the worker and the emulator: command-line flags,
``<PREFIX>_*`` environment variables and a YAML file, all derived from one frozen dataclass.
Pure apart from reading the YAML file it is given.

A component declares its settings once, as the fields of a dataclass (name, type, default), and
a ``Settings`` over it: each field ``name`` gets the flag ``--name-with-dashes``, the environment
variable ``<PREFIX>NAME`` and the YAML key ``name`` (``name-with-dashes`` too, as vLLM's
``--config`` files spell them, and the spelling of every other flag of the setting: the
router's ``replica`` for ``replicas``). Precedence: flag > environment > YAML > the field's
default. Values are converted by the field's type (``str``, ``int``, ``float``, ``bool``,
``tuple[str, ...]``, optionally ``| None``); lists come as repeated flags, a comma-separated
environment value or a YAML list; an empty string for an optional field is ``None``.

Every error is one line that names where the bad value came from: the flag, the environment
variable or the YAML file and key (``Settings.build``), an unknown flag with a pointer to
``--help``, a YAML syntax error with its line and column.

Why not pydantic-settings (measured): importing it takes ~0.3 s more per process start than
argparse + PyYAML (0.25-0.49 s against 0.05-0.10 s, 5 runs), which every router, worker and
emulator start in the tests pays; its models read ``os.environ`` when built directly, raise
``ValidationError`` (not ``AttributeError``) on assignment to a frozen model and report errors in
their own multi-line format, and its CLI source does not take vLLM's flag shapes (a positional
model tag, ``nargs="+"`` lists) the emulator must accept.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn, TypeVar

import msgspec
import yaml

__all__ = ["ConfigError", "Settings", "StartupError", "did_you_mean", "read_config_file",
           "read_config_lines", "unknown_command_line", "usage_error_line"]

KINDS: Final = ("tuple", "int", "float", "bool")  # else str
TRUE_WORDS: Final = ("1", "true", "yes", "on")
FALSE_WORDS: Final = ("0", "false", "no", "off")

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is missing, malformed or out of range (the router, the worker and the emulator
    report it as one line, exit status 2). ``setting``: the field whose value is bad, when one
    is (``Settings.build`` then names where that value came from)."""

    def __init__(self, message: str, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting


class StartupError(RuntimeError):
    """A process could not start serving (a port in use, an unknown host): the router and the
    worker report it as one line, exit status 1."""


def read_config_file(path: str, error: type[Exception] = ConfigError) -> dict[str, Any]:
    """The mapping in YAML file ``path`` (an empty file is ``{}``). Raises ``error`` when the
    file cannot be read or parsed or does not hold a mapping."""
    return read_config_lines(path, error)[0]


def read_config_lines(path: str, error: type[Exception] = ConfigError,
                      ) -> tuple[dict[str, Any], dict[Any, int]]:
    """``read_config_file(path)`` and ``{key: its 1-based line}`` for the mapping's keys (PyYAML's
    node marks: the file is composed into nodes once, then constructed)."""
    lines: dict[Any, int] = {}
    try:
        loader = _UniqueKeyLoader(Path(path).read_text(encoding="utf-8"))
        try:
            node = loader.get_single_node()
            loaded = loader.construct_document(node) if node is not None else None
            if isinstance(node, yaml.MappingNode) and isinstance(loaded, dict):
                for key_node, _ in node.value:
                    key = loader.construct_object(key_node, deep=True)
                    with contextlib.suppress(TypeError):  # an unhashable key: refused below
                        lines.setdefault(key, key_node.start_mark.line + 1)
        finally:
            loader.dispose()
        loaded = loaded or {}
    except OSError as exc:
        raise error(f"cannot read config file {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise error(f"config file {path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
                    f"at offset {exc.start})") from exc
    except yaml.YAMLError as exc:
        raise error(f"config file {path}: {_yaml_problem(exc)}") from exc
    if not isinstance(loaded, dict):
        raise error(f"config file {path} must hold a mapping")
    return loaded, lines


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping key given twice (PyYAML keeps the last one
    silently; YAML 1.2 says keys are unique)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                line = first_line.setdefault(key, key_node.start_mark.line)
            except TypeError:  # an unhashable key: construct_mapping names it
                continue
            if line != key_node.start_mark.line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {line + 1})",
                    key_node.start_mark)
        return super().construct_mapping(node, deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's multi-line error as one line: ``line L, column C: problem`` (1-based, where the
    parser stopped; PyYAML's ``Mark`` is 0-based)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "not valid YAML"
        if exc.context and exc.problem:
            problem = f"{problem} ({exc.context})"
        if mark is not None:
            return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
        return problem
    return " ".join(str(exc).split())


def did_you_mean(word: str, known: Collection[str]) -> str:
    """`` (did you mean X?)`` for the entry of ``known`` closest to ``word`` (difflib, ratio 0.75, compared
    without leading dashes, so that ``--bogus`` does not suggest ``--host`` for the dashes they
    share), else ``""``."""
    names = {k.lstrip("-"): k for k in known}
    close = difflib.get_close_matches(word.lstrip("-"), list(names), n=1, cutoff=0.75)
    return f" (did you mean {names[close[0]]}?)" if close else ""


def usage_error_line(parser: argparse.ArgumentParser, message: str) -> str:
    """argparse's error ``message`` as one line: unknown arguments named with the closest flag
    of ``parser`` (the value after an unknown ``--flag`` is not listed again), an unknown
    subcommand with the closest one, and a pointer to ``PROG --help``."""
    unknown = message.removeprefix("unrecognized arguments: ")
    if unknown != message:
        flags = [o for a in parser._actions for o in a.option_strings]
        hints: list[str] = []
        previous = ""
        for word in unknown.split():
            if word.startswith("-"):
                hints.append(word + did_you_mean(word.split("=", 1)[0], flags))
            elif not previous.startswith("-") or "=" in previous:  # else: the flag's value
                hints.append(word)
            previous = word
        message = f"unknown argument{'s' if len(hints) > 1 else ''} {', '.join(hints)}"
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and "invalid choice: " in message:
            word = message.split("invalid choice: ", 1)[1].split(" (", 1)[0].strip("'")
            return unknown_command_line(parser.prog, word, list(action.choices)).split(
                ": error: ", 1)[1]
    return f"{message}; see {parser.prog} --help"


def unknown_command_line(prog: str, word: str, commands: Collection[str]) -> str:
    """The one line a CLI prints for an unknown subcommand or option before one."""
    what = "option" if word.startswith("-") else "command"
    return (f"{prog}: error: unknown {what} {word!r}{did_you_mean(word, list(commands))}; "
            f"commands: {', '.join(commands)}; see {prog} --help")


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``ConfigError`` (one line, naming the flag, pointing at ``--help``)
    where argparse prints its whole usage and exits."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(usage_error_line(self, message))


@dataclasses.dataclass(frozen=True)
class Settings:
    """Flags, environment and YAML of the dataclass ``schema``, one declaration.

    ``schema``'s fields are the settings; a field named ``config`` (if any) receives the YAML
    file's path and is no setting of its own. A field without a default is required. Per field,
    optional: ``help`` text; ``flags``, a flag other than ``--name`` (a list field's singular
    ``--replica``, also read from the environment as ``<PREFIX>REPLICA`` and from the YAML key
    ``replica``); ``aliases``, more option strings of the same flag (vLLM's ``-dp``, YAML key
    ``dp``); ``nargs`` ``"+"`` for
    list flags taking several values at once (vLLM's ``--lora-modules a=1 b=2``; default: the
    flag repeats); ``choices``, the accepted values; ``positional``, fields taken as an optional
    positional argument (``vllm serve MODEL``).
    """

    schema: type
    prog: str
    env_prefix: str  # e.g. "ROUTER_"
    description: str = ""
    version: str | None = None  # what ``--version`` prints; None: no such flag
    help: Mapping[str, str] = dataclasses.field(default_factory=dict)
    flags: Mapping[str, str] = dataclasses.field(default_factory=dict)
    aliases: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    nargs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    choices: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    positional: Sequence[str] = ()
    lower: Sequence[str] = ("log_level",)  # fields whose values are lower-cased

    @property
    def fields(self) -> dict[str, dataclasses.Field[Any]]:
        """``{name: field}`` of the settings (every schema field but ``config``)."""
        return {f.name: f for f in dataclasses.fields(self.schema) if f.name != "config"}

    def kind(self, name: str) -> str:
        """``tuple``, ``int``, ``float``, ``bool`` or ``str``: how ``name``'s values convert."""
        annotation = str(self.fields[name].type)
        return next((k for k in KINDS if annotation.startswith(k)), "str")

    def flag(self, name: str) -> str:
        """The command-line flag of setting ``name``."""
        return self.flags.get(name) or "--" + name.replace("_", "-")

    def env_name(self, name: str) -> str:
        """The environment variable of setting ``name``."""
        return self.env_prefix + name.upper()

    def misspelled_env(self, env: Mapping[str, str]) -> list[str]:
        """One line per ``<PREFIX>*`` variable in ``env`` that is no setting's but close to one
        (``ROUTER_POLCY (did you mean ROUTER_POLICY?)``): ignored, so the process says so. A
        name close to none is not reported: other software sets such names too (Kubernetes
        service links: ``ROUTER_SERVICE_HOST``)."""
        known = {self.env_name(name) for name in self.fields} | {self.env_prefix + "CONFIG"}
        known |= {self.flag_env_name(name) for name in self.flags}
        lines = []
        for name in sorted(env):
            if name.startswith(self.env_prefix) and name not in known:
                hint = did_you_mean(name, sorted(known))
                if hint:
                    lines.append(f"ignoring env {name}: no such setting{hint}")
        return lines

    def flag_env_name(self, name: str) -> str:
        """The environment variable spelled after setting ``name``'s own flag (``replicas``:
        ``ROUTER_REPLICA``), read when ``env_name(name)`` is not set."""
        return self.env_prefix + self.flag(name).lstrip("-").replace("-", "_").upper()

    def yaml_names(self) -> dict[str, str]:
        """``{YAML key with underscores: setting}``: each setting's name and the spelling of
        each of its flags (``--replica`` -> ``replica``; ``aliases`` too); a key may also be
        written with dashes."""
        names = {name: name for name in self.fields}
        for name in self.fields:
            if name in self.positional:
                continue
            for option in (self.flag(name), *self.aliases.get(name, ())):
                names.setdefault(option.lstrip("-").replace("-", "_"), name)
        return names

    def parser(self) -> argparse.ArgumentParser:
        """The argument parser; every flag defaults to ``None`` (= not given)."""
        parser = _Parser(prog=self.prog, description=self.description or None)
        if self.version is not None:
            parser.add_argument("--version", action="version", version=self.version)
        for name, f in self.fields.items():
            shown = f.default if f.default is not dataclasses.MISSING else None
            text = "; ".join(t for t in (
                self.help.get(name), "" if shown in (None, "", ()) else f"default {shown}",
                f"env {self.env_name(name)}") if t)
            kind = self.kind(name)
            flags = (self.flag(name), *self.aliases.get(name, ()))
            if name in self.positional:
                parser.add_argument(name, nargs="?", default=None, help=text)
            elif kind == "tuple":
                many = self.nargs.get(name)
                parser.add_argument(*flags, dest=name, default=None, help=text,
                                    action="extend" if many else "append", nargs=many)
            elif kind == "bool":
                parser.add_argument(*flags, dest=name, default=None, help=text,
                                    action=argparse.BooleanOptionalAction)
            else:
                allowed = self.choices.get(name)
                metavar = "{" + ",".join(allowed) + "}" if allowed else kind.upper()
                parser.add_argument(*flags, dest=name, default=None, help=text,
                                    metavar=metavar)
        parser.add_argument("--config", default=None,
                            help=f"YAML file with the same keys (env {self.env_prefix}CONFIG)")
        return parser

    def values(self, argv: Sequence[str], env: Mapping[str, str]) -> dict[str, Any]:
        """The settings given in ``argv``, ``env`` or the YAML file (``--config`` /
        ``<PREFIX>CONFIG``), merged flag > env > YAML and converted; a setting given nowhere is
        absent (its default applies). Adds ``config`` (the YAML path) when the schema has it.

        Raises ``ConfigError`` for unknown flags or YAML keys, bad values, an unreadable or
        malformed file or a missing required setting.
        """
        return self.sourced_values(argv, env)[0]

    def build(self, argv: Sequence[str], env: Mapping[str, str],
              make: Callable[[dict[str, Any]], T]) -> T:
        """``make(values)`` of this ``values(argv, env)``; a ``ConfigError`` it raises about one
        setting (``ConfigError.setting``) that was given is raised again naming where its value
        came from: ``--block-size: ...``, ``env ROUTER_BLOCK_SIZE: ...`` or
        ``config file F, key block_size: ...``."""
        values, sources = self.sourced_values(argv, env)
        try:
            return make(values)
        except ConfigError as exc:
            where = sources.get(exc.setting or "")
            if where is None:
                raise
            raise ConfigError(f"{where}: {exc}") from exc

    def sourced_values(self, argv: Sequence[str], env: Mapping[str, str],
                       ) -> tuple[dict[str, Any], dict[str, str]]:
        """``values(argv, env)`` and ``{setting: where its value came from}`` (the flag, ``env
        NAME`` or ``config file F, key K``) for every setting given."""
        args = vars(self.parser().parse_args(list(argv)))
        settings = self.fields
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        config_path = args.pop("config") or env.get(self.env_prefix + "CONFIG")
        if config_path:
            yaml_names = self.yaml_names()
            loaded, lines = read_config_lines(config_path)
            for key, value in loaded.items():
                name = yaml_names.get(str(key).replace("-", "_"))
                where = f"config file {config_path}, line {lines.get(key, '?')}"
                if name is None:
                    hint = did_you_mean(str(key), sorted({*yaml_names, *self.fields}))
                    raise ConfigError(f"{where}: unknown key {key!r}{hint}")
                source = f"{where}, key {key}"
                if name in sources:
                    raise ConfigError(f"{source}: {name} is given twice ({sources[name]})")
                values[name] = self.convert(name, value, source, typed=True)
                sources[name] = source
            if "config" in {f.name for f in dataclasses.fields(self.schema)}:
                values["config"] = str(config_path)
        for name in settings:
            env_name = self.env_name(name)
            raw = env.get(env_name)
            if raw is None and name in self.flags:  # the flag is singular: --replica
                env_name = self.flag_env_name(name)
                raw = env.get(env_name)
            if raw is not None:
                values[name] = self.convert(name, raw, f"env {env_name}")
                sources[name] = f"env {env_name}"
        for name, value in args.items():
            if isinstance(value, list) and name not in self.nargs:  # --replica a --replica b,c
                value = ",".join(value)
            if value is not None:
                values[name] = self.convert(name, value, self.flag(name))
                sources[name] = self.flag(name)
        for name, f in settings.items():
            # a required setting given as "" is not missing: say what is wrong with it
            if f.default is dataclasses.MISSING and name in sources and values.get(name) == "":
                raise ConfigError(f"{sources[name]}: {name} must not be empty", name)
        missing = [self.flag(name) for name, f in settings.items()
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and not values.get(name)]
        if missing:
            raise ConfigError(f"missing required settings: {', '.join(missing)}")
        return values, sources

    def convert(self, name: str, value: Any, source: str, typed: bool = False) -> Any:
        """``value`` (a flag's or env var's string, or a YAML value: ``typed``) as setting
        ``name``'s type. A YAML value must have the setting's YAML type (``YAML_TYPES``): a
        quoted ``"16"`` is a string, not an integer. Raises ``ConfigError`` naming ``source``,
        the value and the setting."""
        kind = self.kind(name)
        optional = "None" in str(self.fields[name].type)
        try:
            if value is None and not optional:
                raise ValueError(f"expected {_KIND_NAMES[kind]}, got nothing")
            if typed and not _nested(kind, value):  # (nested: _convert names the shape)
                try:
                    msgspec.convert(value, YAML_TYPES[kind] | None, strict=True)
                except msgspec.ValidationError as exc:  # "Expected `int`, got `str`"
                    message = str(exc).replace(" | null", "")
                    raise TypeError(message[:1].lower() + message[1:]) from exc
            converted = _convert(kind, value)
            if kind == "str" and converted == "" and optional:
                return None
            if name in self.lower and isinstance(converted, str):
                converted = converted.lower()
            allowed = self.choices.get(name)
            if allowed is not None and converted is not None and converted not in allowed:
                raise ValueError(f"expected one of {', '.join(allowed)}")
            return converted
        except (TypeError, ValueError) as exc:
            shown = repr(value) if self.fields[name].repr else "(hidden)"  # a password
            raise ConfigError(f"{source}: bad value {shown} for {name}: {exc}") from exc


# a YAML value's type per kind of setting (msgspec, strict: no string is read as a number or a
# bool); a string setting takes a whole number as its digits (``hash_seed: 0``, PYTHONHASHSEED)
YAML_TYPES: Final[dict[str, Any]] = {"int": int, "float": float, "bool": bool, "str": str | int,
                                     "tuple": str | list[str]}
_KIND_NAMES: Final = {"tuple": "a list", "int": "an integer", "float": "a number",
                      "bool": "true or false", "str": "a string"}


def _convert(kind: str, value: Any) -> Any:
    if value is None:
        return None
    if kind == "tuple":
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if isinstance(value, Sequence):
            for item in value:
                _scalar(item, "a list of strings")
            return tuple(str(v) for v in value)
        raise TypeError(f"expected a list, got {_shape(value)}")
    _scalar(value, _KIND_NAMES[kind])
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in TRUE_WORDS or text in FALSE_WORDS:
            return text in TRUE_WORDS
        raise ValueError("expected true or false")
    if kind == "int":
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise TypeError("expected an integer")
        return int(value)
    if kind == "float":
        if isinstance(value, bool):
            raise TypeError("expected a number")
        number = float(value)
        if not math.isfinite(number):
            raise ValueError("expected a finite number")
        return number
    return str(value)


def _scalar(value: Any, expected: str) -> None:
    """Raises ``TypeError`` for a YAML mapping or list where ``expected`` (a scalar) belongs:
    ``str({'a': 1})`` would pass for a string setting."""
    if isinstance(value, (Mapping, list, tuple, set)):
        raise TypeError(f"expected {expected}, got {_shape(value)}")


def _nested(kind: str, value: Any) -> bool:
    """Whether YAML ``value`` is a collection where a ``kind`` setting takes a scalar (for a list
    setting: a collection among its items)."""
    items = value if kind == "tuple" and isinstance(value, list) else [value]
    return any(isinstance(v, (Mapping, list, tuple, set)) for v in items)


def _shape(value: Any) -> str:
    return "a mapping" if isinstance(value, Mapping) else (
        "a list" if isinstance(value, (list, tuple, set)) else type(value).__name__)
