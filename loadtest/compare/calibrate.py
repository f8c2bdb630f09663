"""Choose the demo's replay speed for the machine it finds: measure how busy the machine already
is (and how late this process wakes from short sleeps) for a few seconds before any fleet
starts, project the machine's busy share at each candidate speed from the stack's CPU cost per
request, and take the fastest speed whose projection leaves the verdict's headroom. The
measurement does I/O (psutil, sleeps); ``choose_speedup`` is pure.

Why a projection is enough: the fleet's CPU use grows with the request rate (the router, the
workers, the emulator's steps and the replayer all cost about the same per request at any
speed, and the emulator's time scale follows the speed, so the fleet's own load relative to its
capacity does not change). The trust verdict (``loadtest.compare.verdict``) fails a run when the
machine was more than 90% busy or the emulated engines fell behind their clock, which on a
saturated machine go together.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

__all__ = ["EMULATOR_TARGET_SHARE", "Headroom", "SpeedChoice", "choose_speedup", "measure_headroom"]

# Candidate replay speeds, fastest first. 2 is the slowest sensible one: the demo's five policies
# then take about 15 minutes (docs/benchmarks.md).
SPEEDUPS = (10.0, 8.0, 6.0, 5.0, 4.0, 3.0, 2.0)
# CPU seconds the whole stack (emulator, workers, router, Redis, replayer) uses per replayed
# request of the demo slice, as measured on 2026-12-03 (docs/benchmarks.md: 55-58 ms at speed 5
# on a busy machine, 56 ms at speed 10 on a quiet one; a busy machine's cores do less per second).
STACK_CPU_S_PER_REQUEST = 0.056
# The projected busy share a speed may reach: below the verdict's 90% (TRUST_MACHINE_BUSY) with
# room for the bursts of the trace and for the other work's own ups and downs.
TARGET_BUSY = 0.75
# CPU seconds the emulator process alone uses per replayed request of the demo slice (18.5-20.4 ms
# in the quiet demo of 2026-12-03 21:30, speed 8: docs/benchmarks.md).
EMULATOR_CPU_S_PER_REQUEST = 0.0195
# The share of one core the emulator process may use. All eight replicas' steps run in that one
# process's event loop, so its step lag is a queue on one core, not on the machine: on a quiet
# machine (1% busy) 46% of a core (speed 8) gave lag p99 39-53 ms and 58% (speed 10) 458 ms, both
# over the verdict's 20 ms, while the machine was only 60-84% busy. 35% is an extrapolation below
# the first point, not a measured limit; the lead's quiet run confirms or moves it.
EMULATOR_TARGET_SHARE = 0.35
CALIBRATION_S = 3.0  # seconds of measuring before the first fleet starts
WAKE_PROBE_SLEEP_S = 0.005


@dataclass(frozen=True)
class Headroom:
    """What the machine had to offer before the demo: ``busy`` the share of all ``num_cores``
    cores busy with other work during ``duration_s`` (0-1), ``wake_lag_p99_s`` how late this
    process woke from ``WAKE_PROBE_SLEEP_S`` sleeps (p99, seconds: the wait for a core that an
    emulator step would see without its raised priority)."""

    busy: float
    num_cores: int
    duration_s: float
    wake_lag_p99_s: float
    load_average_1m: float


@dataclass(frozen=True)
class SpeedChoice:
    """The replay speed chosen (``speedup``; the emulator's time scale follows it), the machine's
    projected busy share at it, whether that projection stays under the verdict's limit
    (``can_trust``) and one sentence saying why."""

    speedup: float
    projected_busy: float
    can_trust: bool
    why: str


def measure_headroom(duration_s: float = CALIBRATION_S) -> Headroom:
    """Sample the machine for ``duration_s`` seconds: its busy share of all cores (psutil
    ``cpu_times``, idle and iowait counted idle) and this process's wake-up lag."""
    import os

    import psutil

    before = psutil.cpu_times()
    lags = []
    start = time.monotonic()
    while time.monotonic() - start < duration_s:
        asked = time.monotonic()
        time.sleep(WAKE_PROBE_SLEEP_S)
        lags.append(max(0.0, time.monotonic() - asked - WAKE_PROBE_SLEEP_S))
    after = psutil.cpu_times()

    def idle(t: object) -> float:
        return float(getattr(t, "idle", 0.0) + getattr(t, "iowait", 0.0))

    total = sum(after) - sum(before)
    busy = 1.0 - (idle(after) - idle(before)) / total if total > 0 else 0.0
    p99 = statistics.quantiles(lags, n=100)[98] if len(lags) >= 2 else 0.0
    return Headroom(busy=min(1.0, max(0.0, busy)), num_cores=psutil.cpu_count() or 1,
                    duration_s=time.monotonic() - start, wake_lag_p99_s=p99,
                    load_average_1m=os.getloadavg()[0])


def projected_busy(headroom: Headroom, requests_per_s: float,
                   cpu_s_per_request: float = STACK_CPU_S_PER_REQUEST) -> float:
    """The machine's busy share (0-1, capped at 1) with the stack's ``cpu_s_per_request`` at
    ``requests_per_s`` added to the other work ``headroom`` saw."""
    stack_cores = requests_per_s * cpu_s_per_request
    return min(1.0, headroom.busy + stack_cores / headroom.num_cores)


def choose_speedup(headroom: Headroom, num_requests: int, trace_span_s: float,
                   limit_busy: float, speedups: tuple[float, ...] = SPEEDUPS,
                   target_busy: float = TARGET_BUSY,
                   cpu_s_per_request: float = STACK_CPU_S_PER_REQUEST,
                   emulator_cpu_s_per_request: float = EMULATOR_CPU_S_PER_REQUEST,
                   emulator_target_share: float = EMULATOR_TARGET_SHARE) -> SpeedChoice:
    """The fastest of ``speedups`` (fastest first) at which the projected busy share stays at or
    under ``target_busy`` and the emulator process's projected share of its one core
    (``emulator_cpu_s_per_request`` times the rate) at or under ``emulator_target_share``; else the slowest, with ``can_trust`` False when even there the
    projection passes ``limit_busy`` (the verdict's own limit). ``num_requests`` over
    ``trace_span_s`` trace seconds is the slice's rate at speed 1. Raises ``ValueError`` for an
    empty ladder or a non-positive span."""
    if not speedups or trace_span_s <= 0 or num_requests < 1:
        raise ValueError("need candidate speeds, requests and a positive trace span")
    rate_1x = num_requests / trace_span_s
    other = (f"other work kept the machine {headroom.busy:.0%} busy of {headroom.num_cores} "
             f"cores (load average {headroom.load_average_1m:.1f})")
    for speedup in speedups:
        busy = projected_busy(headroom, rate_1x * speedup, cpu_s_per_request)
        share = rate_1x * speedup * emulator_cpu_s_per_request
        if busy <= target_busy and share <= emulator_target_share:
            fastest = speedup == speedups[0]
            return SpeedChoice(speedup, busy, True, (
                f"{other}; at speedup {speedup:g} ({rate_1x * speedup:.0f} requests/s, "
                f"{cpu_s_per_request * 1000:.0f} ms of CPU each) the machine would be about "
                f"{busy:.0%} busy, under the {target_busy:.0%} this demo aims for, and the "
                f"emulator process (one event loop for all replicas, "
                f"{emulator_cpu_s_per_request * 1000:.1f} ms each) about {share:.0%} of a core, "
                f"under the {emulator_target_share:.0%} at which its steps keep their clock"
                + ("" if fastest else f" (speedup {speedups[0]:g} would need more)")))
    slowest = speedups[-1]
    busy = projected_busy(headroom, rate_1x * slowest, cpu_s_per_request)
    can_trust = busy <= limit_busy
    return SpeedChoice(slowest, busy, can_trust, (
        f"{other}; even at speedup {slowest:g}, the slowest sensible one "
        f"({rate_1x * slowest:.0f} requests/s), the machine would be about {busy:.0%} busy"
        + (f", over the {target_busy:.0%} aimed for but under the verdict's {limit_busy:.0%}"
           if can_trust else f", over the verdict's {limit_busy:.0%} limit")))
