"""The ``compare`` and ``demo`` subcommands of ``prefix-loadtest``: their flags, the checks before
anything starts (the runs, the trace slice, real engines' limits, the replay speed that fits
this machine), the comparison's settings, then the run (``orchestration``) and the text of the
report (``report``). Does process, network and file I/O, and prints."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtest.compare.orchestration import DEFAULT_SAMPLE_INTERVAL_S, CompareConfig, run_compare
from loadtest.compare.report import closing_text, run_notes, tables_text, write_results
from loadtest.compare.runs import OWN_POLICIES, resolve_runs
from loadtest.compare.verdict import TRUST_MACHINE_BUSY, verdict_lines
from loadtest.data import packaged_trace_path
from loadtest.harness.fleet import OURS, FleetConfig, RouterSpec
from loadtest.replay.replayer import ReplayConfig
from loadtest.replay.trace import read_trace
from router.shared.contract import DEFAULT_INDEX_STRIDE
from router.tools.trace_format import TraceRequest

# The demo: the first 1,000 requests of the packaged Mooncake slice on 8 replicas of 32,000
# 16-token blocks each (512k tokens: an 8B-class model on an 80 GB GPU, the DESIGN.md reference
# point where capacity matters: the slice's single-cache bound is well above round-robin's hit
# rate), replayed up to 10x faster with the emulator as much faster, so the fleet is as loaded as
# in the real trace (the slice's figures and run times: docs/benchmarks.md). The speed is chosen
# from the machine's headroom before the first run (``loadtest.compare.calibrate``) unless --speedup
# forces it.
DEMO_DEFAULTS: dict[str, Any] = {
    "replicas": 8,
    "limit": 1000,
    "num_gpu_blocks": 32_000,
}


def add_compare_parsers(sub: Any, add_slice_args: Callable[[argparse.ArgumentParser, int | None], None],
                        make_replay_config: Callable[[argparse.Namespace, str, str], ReplayConfig]) -> None:
    """Register ``compare`` and ``demo`` on the CLI's subparsers."""
    for name in ("compare", "demo"):
        demo = name == "demo"
        p = sub.add_parser(name, help=(
            "the main job: compare every policy on the packaged Mooncake slice (about 3 min; 5 with the peers)"
            if demo else "compare routing policies side by side, each on a fresh emulated fleet"))
        add_slice_args(p, DEMO_DEFAULTS["limit"] if demo else 1000)
        p.add_argument("--policies", default=",".join(OWN_POLICIES),
                       help="comma-separated: " + ", ".join(OWN_POLICIES) +
                            ", smg:cache_aware, smg:prefix_hash, vllm-router:cache_aware, "
                            "vllm-router:kv_aware (sglang:POLICY with sglang-router installed)")
        p.add_argument("--peers", choices=("auto", "yes", "no"), default="auto",
                       help="also run the peer routers (auto: when the peers extra is installed)")
        p.add_argument("--replicas", type=int, default=DEMO_DEFAULTS["replicas"])
        p.add_argument("--num-gpu-blocks", type=int,
                       default=DEMO_DEFAULTS["num_gpu_blocks"] if demo else None,
                       help="KV capacity per replica in block-size-token blocks "
                            "(emulator --num-gpu-blocks-override)")
        p.add_argument("--time-scale", type=float, default=None,
                       help="emulator time scale (default: equal to --speedup, so the fleet is as "
                            "loaded as in the real trace)")
        p.add_argument("--block-size", type=int, default=16)
        p.add_argument("--index-stride", type=int, default=DEFAULT_INDEX_STRIDE,
                       help="coarse-index stride of workers and router (1 = exact index)")
        p.add_argument("--model", default="emulated-llm")
        p.add_argument("--redis-url", default=None, help="use this Redis instead of an embedded one")
        p.add_argument("--emulator-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for prefix-worker emulate (repeatable)")
        p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for the router of every run (repeatable)")
        p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for every worker (repeatable; e.g. "
                            "--worker-arg=--kv-tiers --worker-arg=GPU hides the CPU tier)")
        p.add_argument("--cpu-tier-ratio", type=float, default=0.0, metavar="R",
                       help="give every replica a CPU tier (vLLM native KV offloading) of R x "
                            "its GPU KV capacity (emulator --num-cpu-blocks-override; needs "
                            "--num-gpu-blocks); the bounds then include the two-tier single cache")
        p.add_argument("--sample-interval", type=float, default=DEFAULT_SAMPLE_INTERVAL_S,
                       help="seconds between gauge scrapes for busy time")
        p.add_argument("--output-dir", type=Path, default=None,
                       help="default: results/<command>-<timestamp>/")
        p.add_argument("--repeat", type=int, default=1, metavar="N",
                       help="run every policy N times, interleaved, each on a fresh fleet, and "
                            "report medians and ranges (default 1)")
        p.add_argument("--no-priority", action="store_true",
                       help="do not run the emulator at a higher OS priority than the rest")
        p.add_argument("--no-plots", action="store_true")
        p.add_argument("--no-bounds", action="store_true",
                       help="skip the placement-only simulation of the slice")
        p.add_argument("--engine", choices=("emulator", "vllm"), default="emulator",
                       help="the replicas: the emulator, or real vLLM CPU engines (the vllm "
                            "extra; --replicas of them, about 4 GB each, started once and "
                            "reset between runs; block size 32; their TTFT is CPU TTFT)")
        p.set_defaults(func=lambda a, _demo=demo: cmd_compare(a, make_replay_config, _demo))
        if demo:
            p.set_defaults(speedup=None)  # chosen from the machine's headroom (loadtest.compare.calibrate)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Refused(Exception):
    """A comparison that cannot run as asked: the line to print (stderr) and the exit status."""

    def __init__(self, line: str, status: int = 2) -> None:
        super().__init__(line)
        self.status = status


def cmd_compare(args: argparse.Namespace,
                make_replay_config: Callable[[argparse.Namespace, str, str], ReplayConfig],
                demo: bool) -> int:
    """``prefix-loadtest compare`` and ``demo``: the runs, the slice, the fleet's settings, the
    bounds, then every run and the report. Exit status 0 when every run was measured, 1 when
    one was not, 2 for arguments that cannot run, 3 when the demo cannot fit this machine, 130
    when interrupted (Ctrl-C or SIGTERM)."""
    try:
        runs, skipped, requests = _runs_and_slice(args)
        if args.speedup is None and not _choose_speed(args, requests):
            return 3  # the demo without --speedup: no speed fits this machine
        config, cpu_blocks = _compare_config(args, runs, make_replay_config, demo)
    except _Refused as exc:
        print(exc, file=sys.stderr)
        return exc.status
    trace_info = _trace_info(args, requests)
    bounds = None if args.no_bounds else _bounds(args, requests, cpu_blocks,
                                                 config.fleet.time_scale)
    span_s = trace_info["trace_span_s"]
    _progress(f"comparing {len(runs)} runs ({', '.join(s.label for s in runs)}"
              f"{f', {args.repeat} rounds interleaved' if args.repeat > 1 else ''}) on "
              f"{len(requests)} requests ({span_s:.0f} s of trace, about {span_s / args.speedup:.0f} s "
              f"each at speedup {args.speedup}), {args.replicas} replicas, "
              f"{args.num_gpu_blocks or 'default'} KV blocks each"
              f"{f' + a CPU tier of {cpu_blocks}' if cpu_blocks else ''}, time scale "
              f"{config.fleet.time_scale}; output in {config.output_dir}")
    try:
        with contextlib.ExitStack() as stack:
            if args.engine == "vllm":
                config = _on_vllm_engines(stack, config, args)
            results = run_compare(config, requests, trace_info, _progress, bounds,
                                  argv=sys.argv if argv_is_cli() else None)
    except KeyboardInterrupt:
        _progress("interrupted; fleets stopped")
        return 130
    results["skipped"] = skipped
    write_results(results, config.output_dir)
    print(tables_text(results, bounds, cpu_tier=cpu_blocks > 0))
    results["notes"] = run_notes(results["policies"])
    results["verdict"] = verdict_lines(results)
    write_results(results, config.output_dir)
    print(closing_text(results, skipped, config.output_dir))
    return 0 if results["policies"] and not results["failed"] else 1


def _runs_and_slice(args: argparse.Namespace,
                    ) -> tuple[tuple[RouterSpec, ...], dict[str, str], list[TraceRequest]]:
    """The runs (``resolve_runs``; the peers left out said on stderr), the peers skipped
    (label -> reason) and the trace slice, with ``--engine vllm`` only the requests that fit
    its engines. Raises ``_Refused``."""
    try:
        runs, skipped = resolve_runs(args.policies, args.peers)
    except ValueError as exc:
        raise _Refused(f"error: {exc}") from exc
    for label, reason in skipped.items():
        _progress(f"note: skipping {label}: {reason}")
    requests = read_trace(args.trace or packaged_trace_path(), start=args.start,
                          limit=args.limit, window_s=args.window)
    if args.engine == "vllm":
        error = _check_vllm_args(args, runs)
        if error:
            raise _Refused(f"error: {error}")
        requests = _fitting_requests(args, requests)
    if not requests:
        raise _Refused("no requests in the selected slice")
    return runs, skipped, requests


def _compare_config(args: argparse.Namespace, runs: tuple[RouterSpec, ...],
                    make_replay_config: Callable[[argparse.Namespace, str, str], ReplayConfig],
                    demo: bool) -> tuple[CompareConfig, int]:
    """The comparison's settings from the flags, and the CPU tier's blocks per replica (0 for
    none). Raises ``_Refused`` for a CPU tier without GPU blocks or fewer than one round."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    output_dir = args.output_dir or Path("results") / f"{'demo' if demo else 'compare'}-{stamp}"
    time_scale = args.time_scale if args.time_scale is not None else args.speedup
    emulator_args = list(args.emulator_arg)
    cpu_blocks = 0
    if args.cpu_tier_ratio:
        if args.cpu_tier_ratio < 0 or not args.num_gpu_blocks:
            raise _Refused("error: --cpu-tier-ratio needs a ratio > 0 and --num-gpu-blocks")
        cpu_blocks = round(args.cpu_tier_ratio * args.num_gpu_blocks)
        emulator_args += ["--num-cpu-blocks-override", str(cpu_blocks)]
    fleet = FleetConfig(router=runs[0] if runs else RouterSpec(OURS, "prefix"),
                        replicas=args.replicas, model=args.model, block_size=args.block_size,
                        num_gpu_blocks=args.num_gpu_blocks, time_scale=time_scale,
                        redis_url=args.redis_url, emulator_args=tuple(emulator_args),
                        router_args=tuple(args.router_arg), worker_args=tuple(args.worker_arg),
                        emulator_priority=not args.no_priority, index_stride=args.index_stride)
    config = CompareConfig(runs=runs, fleet=fleet,
                           replay=make_replay_config(args, "http://unused", args.model),
                           output_dir=output_dir, sample_interval_s=args.sample_interval,
                           plots=not args.no_plots, repeat=args.repeat)
    if args.repeat < 1:
        raise _Refused("error: --repeat must be at least 1")
    return config, cpu_blocks


def _trace_info(args: argparse.Namespace, requests: Sequence[TraceRequest]) -> dict[str, Any]:
    """Which slice of which trace ran (results.json's ``trace``)."""
    return {"path": str(args.trace or packaged_trace_path()), "start": args.start,
            "limit": args.limit, "window_s": args.window, "num_requests": len(requests),
            "trace_span_s": (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0,
            "first_index": requests[0].index, "last_index": requests[-1].index}


def _bounds(args: argparse.Namespace, requests: Sequence[TraceRequest], cpu_blocks: int,
            time_scale: float) -> dict[str, Any]:
    """The placement-only simulation of the slice (``simulate_bounds``) and, on the emulator,
    its TTFT floor."""
    from loadtest.replay.simulate import simulate_bounds

    capacity_tokens = (args.num_gpu_blocks * args.block_size) if args.num_gpu_blocks else None
    bounds = simulate_bounds(requests, args.replicas, capacity_tokens,
                             cpu_capacity_tokens_per_replica=cpu_blocks * args.block_size)
    bounds["ttft_floor"] = (None if args.engine == "vllm" else slice_ttft_floor(
        requests, args.block_size, time_scale, args.emulator_arg))
    return bounds


def _check_vllm_args(args: argparse.Namespace, runs: Sequence[RouterSpec]) -> str | None:
    """Why ``--engine vllm`` cannot run as asked (None when it can); sets the block size and
    model to the engines' own."""
    import psutil

    from loadtest.harness.vllm_engine import BLOCK_SIZE, MODEL_NAME, unavailable_reason
    from loadtest.harness.vllm_fleet import ENGINE_BYTES, engines_that_fit

    reason = unavailable_reason()
    if reason is not None:
        return reason
    peers = [spec.label for spec in runs if spec.kind != OURS]
    if peers:
        return f"--engine vllm runs prefix-router's own policies only (not {', '.join(peers)})"
    if args.block_size not in (16, BLOCK_SIZE) or args.cpu_tier_ratio:
        return (f"vLLM's CPU build runs block size {BLOCK_SIZE} and has no CPU tier; drop "
                "--block-size and --cpu-tier-ratio")
    fit = engines_that_fit(psutil.virtual_memory().available)
    if args.replicas > fit:
        return (f"{args.replicas} vLLM engines need about {ENGINE_BYTES / 1e9:.0f} GB each; this "
                f"machine has room for {fit} now (--replicas {max(1, fit)})")
    args.block_size, args.model = BLOCK_SIZE, MODEL_NAME
    return None


def _fitting_requests(args: argparse.Namespace, requests: Sequence[TraceRequest],
                      ) -> list[TraceRequest]:
    """The requests whose prompt and output fit in the engines' ``max_model_len`` (vLLM
    refuses longer ones with a 400); says how many were left out."""
    from loadtest.harness.vllm_fleet import max_model_len

    limit = max_model_len(args.num_gpu_blocks)
    cap = args.max_output_tokens

    def fits(r: TraceRequest) -> bool:
        return r.input_length + min(r.output_length, cap or r.output_length) <= limit

    kept = [r for r in requests if fits(r)]
    if len(kept) < len(requests):
        _progress(f"note: left out {len(requests) - len(kept)} of {len(requests)} requests longer "
                  f"than the engines' max_model_len of {limit} tokens")
    return kept


def _on_vllm_engines(stack: contextlib.ExitStack, config: CompareConfig,
                     args: argparse.Namespace) -> CompareConfig:
    """Start ``args.replicas`` vLLM CPU engines (stopped with ``stack``) and return ``config``
    with its fleet on them: PYTHONHASHSEED 0 as the engines, the model directory as the
    router's tokenizer, first-byte deadlines and a drain time for CPU engines, their prefix
    caches emptied before every run."""
    from loadtest.harness.vllm_fleet import (
        DRAIN_TIMEOUT_S,
        ENGINE_FLEET_START_TIMEOUT_S,
        HASH_SEED,
        ROUTER_ARGS,
        started_engines,
    )

    engines = stack.enter_context(started_engines(
        args.replicas, args.num_gpu_blocks, config.output_dir / "logs", _progress))
    fleet = replace(config.fleet, engines=engines.replicas, engine_pids=engines.pids,
                    python_hash_seed=HASH_SEED, start_timeout_s=ENGINE_FLEET_START_TIMEOUT_S,
                    router_args=(*ROUTER_ARGS, *config.fleet.router_args,
                                 "--tokenizer", str(engines.model_dir)))
    replay = replace(config.replay, drain_timeout_s=max(config.replay.drain_timeout_s,
                                                        DRAIN_TIMEOUT_S))
    return replace(config, fleet=fleet, replay=replay, before_run=engines.reset)


def _choose_speed(args: argparse.Namespace, requests: Sequence[TraceRequest]) -> bool:
    """Measure the machine for a few seconds and set ``args.speedup`` (the time scale follows
    unless ``--time-scale`` was given); print what was chosen and why. False (after saying so)
    when even the slowest sensible speed would leave the machine over the verdict's limit."""
    from loadtest.compare.calibrate import CALIBRATION_S, choose_speedup, measure_headroom

    _progress(f"measuring this machine's CPU headroom for {CALIBRATION_S:.0f} s to choose the "
              "replay speed (--speedup X skips this)")
    headroom = measure_headroom()
    span_s = max(1e-3, (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0)
    choice = choose_speedup(headroom, len(requests), span_s, limit_busy=TRUST_MACHINE_BUSY)
    wake = (f"; this process woke up to {headroom.wake_lag_p99_s * 1000:.1f} ms late (p99) from "
            "short sleeps")
    if not choice.can_trust:
        _progress(f"cannot fit the demo to this machine: {choice.why}{wake}. Every row would be "
                  "untrusted (its latencies would include waits for a core). Stop other work and "
                  f"run again, or force a speed with --speedup {choice.speedup:g} (its rows "
                  "will say whether they can be trusted).")
        return False
    args.speedup = choice.speedup
    _progress(f"replay speed {choice.speedup:g} (emulator time scale "
              f"{args.time_scale if args.time_scale is not None else choice.speedup:g}): "
              f"{choice.why}{wake}")
    return True


def argv_is_cli() -> bool:
    return bool(sys.argv and sys.argv[0].endswith("prefix-loadtest"))


def slice_ttft_floor(requests: Sequence[TraceRequest], block_size: int, time_scale: float,
                     emulator_args: Sequence[str]) -> dict[str, Any] | None:
    """``loadtest.replay.simulate.ttft_floor`` of the slice in the latency model the fleet's emulator
    runs (its profile flags among ``emulator_args``); None when those flags do not parse."""
    from loadtest.replay.simulate import ttft_floor
    from worker.emulator.config import ConfigError as EmulatorConfigError
    from worker.emulator.config import from_args as emulator_config
    from worker.emulator.profiles import LatencyModel

    try:
        emu = emulator_config(["--block-size", str(block_size), *emulator_args])
    except (EmulatorConfigError, SystemExit):
        return None
    latency = LatencyModel(emu.model_profile, emu.gpu_profile, emu.step_overhead_s)
    return ttft_floor(requests, latency, time_scale=time_scale,
                      max_num_batched_tokens=emu.max_num_batched_tokens, block_size=block_size)
