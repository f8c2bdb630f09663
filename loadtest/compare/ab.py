"""The prefix-caching A/B (the seed's step 5): the same prompts with ``max_tokens`` 1, once with
prefix caching on and once off, each in a fresh engine process, and the TTFT a hit saves per
prompt and by prefix-to-suffix ratio. Does I/O (processes, HTTP, files); ``analyse`` is pure.

The seed: "replay real prompts with max_tokens set to 1, once with caching enabled and once
disabled, each in a fresh engine process so neither run inherits the other's cache", and "a
single speedup factor for prefix caching means nothing without the prefix-to-suffix ratio": the
prefill saving on a hit is roughly ``(prefix + suffix) / suffix``, less for suffix attention and
fixed overheads. Here the prefix ``C`` of a prompt is what the engine itself reported cached in the
caching-on run (``usage.prompt_tokens_details.cached_tokens``), the suffix ``N - C``.

Prompts are sent one at a time (streamed, usage included), so a TTFT is one prompt's queue-free
prefill plus HTTP, and each run starts with one warm-up request that is not measured. Engines:
two fresh emulator processes (``--enable-prefix-caching`` / ``--no-enable-prefix-caching``,
vLLM's flags), or two endpoints the operator started (``--on URL --off URL``, e.g. two vLLM
servers, each started fresh, the second with ``--no-enable-prefix-caching``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import numpy as np

from loadtest.harness.processes import ProcessExited, start_emulator, stop_process
from loadtest.replay.replayer import RequestRecord, send_one
from loadtest.replay.trace import read_trace
from router.tools.trace_format import TokenMapper

logger = logging.getLogger(__name__)

DEFAULT_LIMIT: Final = 50  # prompts per run
DEFAULT_TIMEOUT_S: Final = 600.0  # per request
START_TIMEOUT_S: Final = 60.0  # for a fresh emulator to write its ready file
# prefix-to-suffix ratio buckets (upper bounds, inclusive); a prompt without a hit is its own row
RATIO_BUCKETS: Final = (1.0, 4.0, 16.0, 64.0, math.inf)


class ABError(RuntimeError):
    """The A/B could not run (bad input file, an engine that did not start or answer)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request to replay: ``path`` ``/v1/completions`` or ``/v1/chat/completions`` and its
    body (without the A/B's own fields: ``max_tokens``, ``stream``, ``stream_options``)."""

    path: str
    body: dict[str, Any]
    label: str


def trace_prompts(path: Path, start: int = 0, limit: int | None = DEFAULT_LIMIT,
                  model: str = "emulated-llm", token_seed: int = 0) -> list[Prompt]:
    """A Mooncake trace slice as token-id completions (the replay's prompts, same mapping)."""
    mapper = TokenMapper(seed=token_seed)
    return [Prompt("/v1/completions", {"model": model, "prompt": mapper.request_prompt(r)},
                   f"trace line {r.index}")
            for r in read_trace(path, start=start, limit=limit)]


def file_prompts(path: Path, limit: int | None = DEFAULT_LIMIT,
                 model: str = "emulated-llm") -> list[Prompt]:
    """JSONL of OpenAI request bodies: ``messages`` -> chat, ``prompt`` -> completions; a body
    without ``model`` gets ``model``. Raises ``ABError`` naming the bad line."""
    from router.cli import UsageError, read_request_file

    try:
        requests = read_request_file(path, limit)
    except UsageError as exc:
        raise ABError(str(exc)) from exc
    out: list[Prompt] = []
    for number, (kind, body) in enumerate(requests, 1):
        if kind == "trace":
            raise ABError(f"{path}: request {number} is a Mooncake trace line: use --trace")
        body.setdefault("model", model)
        out.append(Prompt("/v1/chat/completions" if kind == "chat" else "/v1/completions", body,
                          f"{path.name} request {number}"))
    return out


@dataclass(slots=True)
class Measured:
    """One prompt in one run."""

    ttft_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    error: str | None


async def measure(base_url: str, prompts: Sequence[Prompt], timeout_s: float = DEFAULT_TIMEOUT_S,
                  progress: Callable[[str], None] | None = None) -> list[Measured]:
    """Send each prompt once, one at a time, with ``max_tokens`` 1 (after one unmeasured warm-up
    request), streamed with usage; TTFT = first token event (``loadtest.replay.replayer.send_one``)."""
    headers = {"content-type": "application/json"}
    out: list[Measured] = []
    async with aiohttp.ClientSession() as session:
        warm = prompts[0] if prompts else None
        if warm is not None:
            body = _body(warm, unique=True)
            await send_one(session, base_url.rstrip("/") + warm.path, body,
                           RequestRecord(-1, -1, 0.0), time.perf_counter(), headers, timeout_s)
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            record = RequestRecord(i, i, 0.0)
            await send_one(session, base_url.rstrip("/") + prompt.path, _body(prompt), record,
                           t0, headers, timeout_s)
            out.append(Measured(record.ttft_s, record.prompt_tokens, record.cached_tokens,
                                None if record.ok else record.error))
            if progress is not None and (i + 1) % 10 == 0:
                progress(f"  {i + 1}/{len(prompts)} prompts")
    return out


def _body(prompt: Prompt, unique: bool = False) -> bytes:
    body = dict(prompt.body, max_tokens=1, stream=True,
                stream_options={"include_usage": True})
    body.pop("max_completion_tokens", None)
    if unique:  # the warm-up: a short prompt of its own, so it caches nothing the run uses
        marker = uuid.uuid4().hex
        if prompt.path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": f"warm-up {marker}"}]
        else:
            body["prompt"] = f"warm-up {marker}"
    return json.dumps(body).encode()


@dataclass(frozen=True, slots=True)
class PromptResult:
    """One prompt of the A/B. ``prefix_tokens``: cached tokens the caching-on engine reported;
    ``ratio``: prefix / suffix (0 without a hit); ``saving_s`` = off - on; ``speedup`` = off / on;
    ``expected_speedup``: the seed's rough ``(prefix + suffix) / suffix``."""

    label: str
    prompt_tokens: int
    prefix_tokens: int
    suffix_tokens: int
    ratio: float
    ttft_on_s: float
    ttft_off_s: float
    saving_s: float
    speedup: float
    expected_speedup: float


@dataclass(slots=True)
class ABReport:
    """Everything the A/B found; ``as_dict`` is what ``results.json`` holds."""

    on: str
    off: str
    prompts: list[PromptResult]
    buckets: list[dict[str, Any]]
    failed: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"on": self.on, "off": self.off, "prompts": [asdict(p) for p in self.prompts],
                "buckets": self.buckets, "failed": self.failed, "warnings": self.warnings}


def _bucket_name(ratio: float) -> str:
    if ratio == 0:
        return "no hit"
    low = 0.0
    for high in RATIO_BUCKETS:
        if ratio <= high:
            return f"> {low:g}" if math.isinf(high) else f"({low:g}, {high:g}]"
        low = high
    raise AssertionError("unreachable: the last bucket is unbounded")


def analyse(prompts: Sequence[Prompt], on: Sequence[Measured], off: Sequence[Measured],
            on_label: str = "on", off_label: str = "off") -> ABReport:
    """Pair the two runs prompt by prompt and group by prefix-to-suffix ratio (medians)."""
    results: list[PromptResult] = []
    failed: list[dict[str, Any]] = []
    warnings: list[str] = []
    for prompt, a, b in zip(prompts, on, off, strict=True):
        if a.error or b.error or a.ttft_s is None or b.ttft_s is None or not a.prompt_tokens:
            failed.append({"label": prompt.label, "on_error": a.error, "off_error": b.error})
            continue
        n = a.prompt_tokens
        c = a.cached_tokens or 0
        suffix = max(n - c, 1)
        results.append(PromptResult(
            prompt.label, n, c, suffix, c / suffix, a.ttft_s, b.ttft_s, b.ttft_s - a.ttft_s,
            b.ttft_s / a.ttft_s if a.ttft_s > 0 else math.inf, (c + suffix) / suffix))
    if any(m.cached_tokens is None for m in on if m.error is None):
        warnings.append("the caching-on engine reported no usage.prompt_tokens_details."
                        "cached_tokens (vLLM needs --enable-prompt-tokens-details): every prompt "
                        "is counted as a miss")
    off_hits = sum(1 for m in off if m.cached_tokens)
    if off_hits:
        warnings.append(f"the caching-off engine reported cached tokens for {off_hits} prompts: "
                        "is prefix caching really off there?")
    buckets = []
    names = ["no hit", *(_bucket_name(h) for h in RATIO_BUCKETS)]
    for name in names:
        rows = [r for r in results if _bucket_name(r.ratio) == name]
        if not rows:
            continue
        buckets.append({
            "ratio": name, "prompts": len(rows),
            "median_prefix_tokens": _median([r.prefix_tokens for r in rows]),
            "median_suffix_tokens": _median([r.suffix_tokens for r in rows]),
            "median_ttft_on_s": _median([r.ttft_on_s for r in rows]),
            "median_ttft_off_s": _median([r.ttft_off_s for r in rows]),
            "median_saving_s": _median([r.saving_s for r in rows]),
            "median_speedup": _median([r.speedup for r in rows]),
            "median_expected_speedup": _median([r.expected_speedup for r in rows]),
        })
    return ABReport(on_label, off_label, results, buckets, failed, warnings)


def _median(values: Sequence[float]) -> float:
    return float(np.median(np.asarray(values, dtype=float)))


def format_report(report: ABReport) -> str:
    """The text ``prefix-loadtest ab`` prints: the table by ratio, then totals."""
    lines = [f"prefix caching A/B: on = {report.on}, off = {report.off}; "
             f"{_count(len(report.prompts), 'prompt')}, max_tokens 1, one at a time",
             f"{'prefix/suffix':>14} {'prompts':>7} {'prefix':>7} {'suffix':>7} "
             f"{'TTFT on':>9} {'TTFT off':>9} {'saved':>9} {'speedup':>8} {'(P+S)/S':>8}"]
    for b in report.buckets:
        lines.append(
            f"{b['ratio']:>14} {b['prompts']:>7} {b['median_prefix_tokens']:>7.0f} "
            f"{b['median_suffix_tokens']:>7.0f} {b['median_ttft_on_s'] * 1e3:>7.1f}ms "
            f"{b['median_ttft_off_s'] * 1e3:>7.1f}ms {b['median_saving_s'] * 1e3:>7.1f}ms "
            f"{b['median_speedup']:>7.2f}x {b['median_expected_speedup']:>7.1f}x")
    if report.prompts:
        saved = sum(r.saving_s for r in report.prompts)
        off_total = sum(r.ttft_off_s for r in report.prompts)
        hits = sum(1 for r in report.prompts if r.prefix_tokens)
        lines.append(f"(medians per row) {hits} of {len(report.prompts)} prompts hit; caching "
                     f"saved {saved:.2f} s of {off_total:.2f} s TTFT in all ({saved / off_total:.0%})")
    lines.extend(f"failed: {f}" for f in report.failed)
    lines.extend(f"warning: {w}" for w in report.warnings)
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    """"1 prompt", "2 prompts"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _readable_axis(axis: Any, values: Sequence[float], label: Callable[[float], str]) -> None:
    """Log scale for ``values`` spanning a decade or more, linear below that (a log axis over
    less than a decade gets one or two ticks, labelled like "1.6x10^0"); ticks labelled by
    ``label`` ("1.6x", "40 ms"), minor ones unlabelled."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) >= 10:
        if axis is axis.axes.xaxis:
            axis.axes.set_xscale("log")
        else:
            axis.axes.set_yscale("log")
        axis.set_minor_formatter(NullFormatter())
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: label(v)))


def plot(report: ABReport, path: Path) -> None:
    """Speedup against prefix-to-suffix ratio (with the seed's (P+S)/S line), and TTFT on/off per
    prompt, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    hits = [r for r in report.prompts if r.ratio > 0]
    misses = [r for r in report.prompts if r.ratio == 0]
    if hits:
        xs = np.asarray([r.ratio for r in hits])
        left.scatter(xs, [r.speedup for r in hits], s=14, label="prompt with a hit")
        grid = np.logspace(math.log10(max(xs.min() / 2, 1e-2)), math.log10(xs.max() * 2), 50)
        left.plot(grid, 1 + grid, color="grey", linestyle="--", label="(prefix + suffix) / suffix")
        ys = [r.speedup for r in hits]
        _readable_axis(left.xaxis, [*xs, *grid], lambda x: f"{x:g}")
        _readable_axis(left.yaxis, [*ys, *(1 + grid)], lambda y: f"{y:g}x")
    left.set_xlabel("prefix-to-suffix ratio (engine cached tokens / new tokens)")
    left.set_ylabel("TTFT off / TTFT on")
    left.set_title(f"speedup by prefix-to-suffix ratio ({_count(len(misses), 'prompt')} "
                   "without a hit)")
    left.legend(loc="upper left")
    order = list(range(len(report.prompts)))
    right.plot(order, [r.ttft_off_s for r in report.prompts], ".", label="caching off")
    right.plot(order, [r.ttft_on_s for r in report.prompts], ".", label="caching on")
    _readable_axis(right.yaxis, [t for r in report.prompts for t in (r.ttft_on_s, r.ttft_off_s)],
                   lambda y: f"{y * 1000:g} ms")
    right.set_xlabel("prompt (replay order)")
    right.set_ylabel("TTFT (time to first token)")
    right.set_title("TTFT per prompt, max_tokens 1")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@contextlib.contextmanager
def fresh_emulator(caching: bool, extra_args: Sequence[str] = (), time_scale: float = 1.0,
                   model: str = "emulated-llm", log_dir: Path | None = None) -> Iterator[str]:
    """A new emulator process (one replica) with prefix caching on or off; yields its base URL
    and stops it on exit. Raises ``ABError`` when it does not start."""
    tmp = Path(tempfile.mkdtemp(prefix="prefix-ab-"))
    ready = tmp / "ready.json"
    log_path = (log_dir or tmp) / f"emulator-{'on' if caching else 'off'}.log"
    args = ["--served-model-name", model, "--enable-prompt-tokens-details",
            "--enable-prefix-caching" if caching else "--no-enable-prefix-caching",
            "--time-scale", repr(time_scale), *extra_args]
    try:
        proc, replicas = start_emulator(ready, args, log_path=log_path, timeout_s=START_TIMEOUT_S)
    except (TimeoutError, ProcessExited) as exc:
        raise ABError(f"the emulator (caching {'on' if caching else 'off'}) did not "
                      f"start; see {log_path}") from exc
    try:
        yield str(replicas[0]["url"])
    finally:
        stop_process(proc)


def run_ab(prompts: Sequence[Prompt], output_dir: Path, on_url: str | None = None,
           off_url: str | None = None, emulator_args: Sequence[str] = (),
           time_scale: float = 1.0, model: str = "emulated-llm",
           timeout_s: float = DEFAULT_TIMEOUT_S, make_plot: bool = True,
           progress: Callable[[str], None] | None = None) -> ABReport:
    """Run both halves (fresh emulators unless both URLs are given), write ``results.json`` and
    ``ab.png`` into ``output_dir``, return the report. Raises ``ABError``."""
    if not prompts:
        raise ABError("no prompts to replay")
    if (on_url is None) != (off_url is None):
        raise ABError("give both --on and --off endpoints, or neither (fresh emulators)")
    output_dir.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda _line: None)
    runs: dict[bool, list[Measured]] = {}
    labels: dict[bool, str] = {}
    for caching in (True, False):
        name = "on" if caching else "off"
        if on_url is not None and off_url is not None:
            url = on_url if caching else off_url
            labels[caching] = url
            say(f"caching {name}: {url}")
            runs[caching] = asyncio.run(measure(url, prompts, timeout_s, say))
            continue
        with fresh_emulator(caching, emulator_args, time_scale, model, output_dir) as url:
            flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
            labels[caching] = f"fresh emulator {flag} (time scale {time_scale:g})"
            say(f"caching {name}: fresh emulator at {url}")
            runs[caching] = asyncio.run(measure(url, prompts, timeout_s, say))
    report = analyse(prompts, runs[True], runs[False], labels[True], labels[False])
    (output_dir / "results.json").write_text(json.dumps(report.as_dict(), indent=2))
    if make_plot and report.prompts:
        plot(report, output_dir / "ab.png")
    if not report.prompts:
        raise ABError(f"no prompt succeeded in both runs: {report.failed[:3]}")
    return report


def add_ab_parser(sub: Any) -> None:
    """``prefix-loadtest ab`` on the CLI's subparsers (``loadtest.cli``)."""
    from loadtest.data import packaged_trace_path

    p = sub.add_parser("ab", help="prefix caching on vs off: TTFT saving per prompt and by "
                       "prefix-to-suffix ratio (the seed's max_tokens=1 A/B)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, default=None,
                        help="Mooncake JSONL (default: the packaged conversation slice)")
    source.add_argument("--requests", type=Path, default=None,
                        help="JSONL of OpenAI bodies (completions 'prompt' or chat 'messages')")
    p.add_argument("--start", type=int, default=0, help="first trace line (with --trace)")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="prompts to replay")
    p.add_argument("--model", default="emulated-llm", help="model for bodies without one")
    p.add_argument("--on", default=None, metavar="URL",
                   help="an engine with prefix caching on (with --off; else fresh emulators)")
    p.add_argument("--off", default=None, metavar="URL",
                   help="an engine started fresh with --no-enable-prefix-caching")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="emulator only: run it N times faster (TTFTs shrink N-fold)")
    p.add_argument("--emulator-arg", action="append", default=[],
                   help="extra emulator flag (repeatable), e.g. --emulator-arg=--model-params "
                        "--emulator-arg=14e9")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_TIMEOUT_S)
    p.add_argument("--output-dir", type=Path, default=None,
                   help="where results.json and ab.png go (default results/ab-<time>)")
    p.add_argument("--no-plot", action="store_true")

    def run(args: Any) -> int:
        try:
            if args.requests is not None:
                prompts = file_prompts(args.requests, args.limit, args.model)
            else:
                prompts = trace_prompts(args.trace or packaged_trace_path(), args.start,
                                        args.limit, args.model)
            out = args.output_dir or Path("results") / time.strftime("ab-%Y%m%d-%H%M%S")
            report = run_ab(prompts, out, args.on, args.off, args.emulator_arg, args.time_scale,
                            args.model, args.request_timeout, not args.no_plot,
                            progress=lambda line: print(line, file=sys.stderr, flush=True))
        except (ABError, OSError) as exc:
            print(f"prefix-loadtest ab: error: {exc}", file=sys.stderr)
            return 2
        print(format_report(report))
        print(f"results: {out / 'results.json'}" + ("" if args.no_plot else
                                                     f", plot: {out / 'ab.png'}"))
        return 0

    p.set_defaults(func=run)
