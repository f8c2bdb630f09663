"""``prefix-router`` command line: ``hash`` (debug hash agreement) and ``serve`` (the router).

CLI edge: parses arguments, prints results, maps errors to exit codes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import NoReturn

from router.hashing import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HASH_ALGO,
    HASH_ALGOS,
    BlockHasher,
    HashConfigError,
    MultiModalItem,
    block_key,
)


class UsageError(ValueError):
    """Bad command-line input; reported as one line on stderr with exit code 2."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line on stderr (exit 2), not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parse_mm(spec: str) -> MultiModalItem:
    parts = spec.rsplit(":", 2)
    if len(parts) != 3:
        raise UsageError(f"--mm expects ID:OFFSET:LENGTH, got {spec!r}")
    identifier, offset, length = parts
    try:
        item = MultiModalItem(identifier, int(offset), int(length))
    except ValueError as exc:
        raise UsageError(f"--mm expects integer OFFSET and LENGTH, got {spec!r}") from exc
    if not identifier or item.offset < 0 or item.length < 1:
        raise UsageError(f"--mm expects a non-empty ID, OFFSET >= 0 and LENGTH >= 1, got {spec!r}")
    return item


def _parse_tokens(text: str) -> list[int]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"tokens are not valid JSON: {exc.msg} at position {exc.pos}") from exc
    except (ValueError, RecursionError) as exc:  # e.g. an integer beyond Python's digit limit
        raise UsageError(f"tokens are not a usable JSON array: {exc}") from exc
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise UsageError("tokens must be a JSON array of non-negative integers")
    return value


def _hash_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="prefix-router hash",
        description="Print vLLM's block hashes of a token-id prompt: one line per full block, "
        "'<hex digest> <64-bit event key>'.",
    )
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per block")
    parser.add_argument("--hash-algo", default=DEFAULT_HASH_ALGO, help=f"one of {', '.join(HASH_ALGOS)}")
    parser.add_argument("--hash-seed", default=None, help="the engines' PYTHONHASHSEED value, if set")
    parser.add_argument("--cache-salt", default=None, help="request cache_salt (block 0 only)")
    parser.add_argument("--lora-name", default=None)
    parser.add_argument("--lora-path", default=None)
    parser.add_argument("--mm", action="append", default=[], metavar="ID:OFFSET:LENGTH",
                        help="multimodal item (repeatable), in prompt order")
    parser.add_argument("--tokens", default=None, help="JSON array of token ids (default: stdin)")
    return parser


def run_hash(argv: Sequence[str]) -> int:
    """The ``hash`` subcommand. Returns the process exit code."""
    parser = _hash_parser()
    args = parser.parse_args(argv)
    try:
        if (args.lora_name is None) != (args.lora_path is None):
            raise UsageError("--lora-name and --lora-path must be given together")
        mm_items = [_parse_mm(spec) for spec in args.mm]
        hasher = BlockHasher(args.block_size, args.hash_algo, args.hash_seed)
        tokens = _parse_tokens(args.tokens if args.tokens is not None else sys.stdin.read())
        lora = (args.lora_name, args.lora_path) if args.lora_name is not None else None
        digests = hasher.digests(tokens, lora=lora, cache_salt=args.cache_salt, mm_items=mm_items)
    except (UsageError, HashConfigError) as exc:
        print(f"prefix-router hash: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write("".join(f"{d.hex()} {block_key(d)}\n" for d in digests))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``prefix-router``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"hash": "print vLLM block hashes of a token prompt", "serve": "run the router"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        lines = "\n".join(f"  {name:8s} {text}" for name, text in commands.items())
        stream = sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr
        print(f"usage: prefix-router {{{','.join(commands)}}} ...\n\ncommands:\n{lines}", file=stream)
        return 0 if stream is sys.stdout else 2
    command, rest = argv[0], argv[1:]
    if command == "hash":
        return run_hash(rest)
    from router.server import main as serve_main  # heavy imports only when serving

    return serve_main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
