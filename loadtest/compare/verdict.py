"""Whether a comparison's figures can be trusted: one run's verdict (an emulator that fell behind
its clock, a machine without CPU headroom, a replayer that sent late, failed requests), the
ranking of the policies by TTFT p50 over the rounds, and the closing lines that say both in
plain words. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The verdict's thresholds. Quiet-machine demo runs show an emulator lag p99 far below the TTFT
# p50 the demo compares (both: docs/benchmarks.md), so a typical step delayed by more than 20 ms
# moves the figures by more than the gaps between policies. A machine over 90% busy has no headroom:
# every process, the router stack included, queues for a core. A replayer that sends more than
# 250 ms late no longer offers the trace's arrival pattern.
TRUST_LAG_P99_S = 0.020
TRUST_LAG_MAX_S = 1.0
TRUST_MACHINE_BUSY = 0.90
TRUST_SEND_LAG_S = 0.25

# The causes a run can fail the verdict for, in the plain words the closing lines use.
CAUSE_WORDS = {
    "emulator_lag": "the emulated GPUs fell behind their own schedule",
    "machine_busy": "the machine had no CPU headroom, so every process waited for a core",
    "replayer_late": "the replayer could not send on the trace's schedule",
    "no_lag_figures": "the emulator reported no lag figures",
    "errors": "requests failed, so its latencies leave those requests out",
}


def untrusted_causes(m: dict[str, Any]) -> list[tuple[str, str]]:
    """Why one run's latencies cannot be trusted: ``(cause, figure)`` pairs, the cause a key of
    ``CAUSE_WORDS`` and the figure what was measured against which limit; empty when trusted.

    Untrusted when the emulated engines fell behind their own clock (lag p99 over
    ``TRUST_LAG_P99_S`` or max over ``TRUST_LAG_MAX_S``), when the machine was more than
    ``TRUST_MACHINE_BUSY`` busy, when the replayer sent more than ``TRUST_SEND_LAG_S`` late, or
    when requests failed (``num_errors``; the kinds from ``errors_by_kind``). A run without lag
    figures (an emulator that exports none) is untrusted too.
    """
    causes: list[tuple[str, str]] = []
    p99, lag_max = m.get("emulator_lag_p99_s"), m.get("emulator_lag_max_s")
    if m.get("engine") == "vllm":
        pass  # real engines keep no emulated clock to fall behind
    elif p99 is None or lag_max is None:
        causes.append(("no_lag_figures", "the emulator reported no lag figures"))
    else:
        if p99 > TRUST_LAG_P99_S:
            causes.append(("emulator_lag", f"emulator lag p99 {p99 * 1000:.0f} ms > "
                                           f"{TRUST_LAG_P99_S * 1000:.0f} ms"))
        if lag_max > TRUST_LAG_MAX_S:
            causes.append(("emulator_lag", f"emulator lag max {lag_max:.2f} s > "
                                           f"{TRUST_LAG_MAX_S:.2f} s"))
    busy = (m.get("cpu_s") or {}).get("machine_util")
    if busy is not None and busy > TRUST_MACHINE_BUSY:
        causes.append(("machine_busy", f"machine {busy:.1%} busy > {TRUST_MACHINE_BUSY:.0%}"))
    send_lag = m.get("max_send_lag_s")
    if send_lag is not None and send_lag > TRUST_SEND_LAG_S:
        causes.append(("replayer_late", f"replayer sent up to {send_lag:.2f} s late > "
                                        f"{TRUST_SEND_LAG_S:.2f} s"))
    num_errors = m.get("num_errors") or 0
    if num_errors:
        causes.append(("errors", f"{num_errors} of {m.get('num_requests', '?')} requests failed"
                                 + (f" ({describe_errors(m['errors_by_kind'], 3)})"
                                    if m.get("errors_by_kind") else "")))
    return causes


def verdict(m: dict[str, Any]) -> tuple[bool, str | None]:
    """Whether one run's latencies can be trusted: (trusted, reason or None), the reason the
    ``untrusted_causes`` figures joined by "; "."""
    causes = untrusted_causes(m)
    return (not causes, "; ".join(figure for _, figure in causes) or None)


def describe_errors(kinds: Sequence[dict[str, Any]], top: int | None = None) -> str:
    """``errors_by_kind`` in one line: "141 x HTTP 503 'no routable replica' at 12.1-15.3 s"
    per kind, the ``top`` most frequent (all when None), then how many kinds were left out."""
    shown = list(kinds if top is None else kinds[:top])
    parts = []
    for k in shown:
        status = f"HTTP {k['status']}" if k["status"] else "no response"
        when = (f"{k['first_s']:.1f} s" if k["first_s"] == k["last_s"]
                else f"{k['first_s']:.1f}-{k['last_s']:.1f} s")
        parts.append(f"{k['count']} x {status} {k['reason']!r} at {when}")
    if len(kinds) > len(shown):
        parts.append(f"{len(kinds) - len(shown)} more kinds")
    return ", ".join(parts)


def ranking(rounds: Sequence[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The order by TTFT p50 in each round (fastest first) of the policies measured and trusted
    in every round, and whether it was the same in every round: ``held`` only with two rounds
    or more and at least two policies ranked (an order of untrusted latencies proves nothing, so
    with none trusted there is no ``held``). ``untrusted`` lists the policies measured in every round but not
    trusted in all, ``left_out`` those not measured in every round."""
    measured = [label for label in (rounds[0] if rounds else {})
                if all(label in rnd and rnd[label].get("ttft_p50_s") is not None
                       for rnd in rounds)]
    common = [label for label in measured if all(rnd[label].get("trusted") for rnd in rounds)]

    def order(rnd: dict[str, dict[str, Any]]) -> list[str]:
        return sorted(common, key=lambda label: float(rnd[label]["ttft_p50_s"]))

    orders = [order(rnd) for rnd in rounds]
    left_out = sorted({label for rnd in rounds for label in rnd} - set(measured))
    out: dict[str, Any] = {"by": "ttft_p50_s", "orders": orders, "left_out": left_out,
                           "untrusted": [label for label in measured if label not in common]}
    if len(common) >= 2 and len(rounds) > 1:
        out["held"] = all(o == orders[0] for o in orders)
    return out


def verdict_lines(results: dict[str, Any]) -> list[str]:
    """The closing lines: which runs can be trusted and why not, what to do, and (with
    repeats) whether the ranking by TTFT p50 held in every round."""
    policies = results["policies"]
    bad = {label: m for label, m in policies.items() if not m.get("trusted")}
    lines: list[str] = []
    if not policies:
        return lines
    if bad:
        lines.append(f"NOT TRUSTED: {len(bad)} of {len(policies)} rows. Their latencies include "
                     "waits a real fleet would not have (or leave failed requests out), and their "
                     "ranking may be wrong. Do not quote them:")
        causes: set[str] = set()
        for label, m in bad.items():
            own = m.get("untrusted_causes") or []
            causes.update(own)
            words = "; ".join(CAUSE_WORDS[c] for c in own if c in CAUSE_WORDS)
            lines.append(f"  {label}: {words + ' (' if words else ''}{m['untrusted_reason']}"
                         f"{')' if words else ''}")
        good = [label for label in policies if label not in bad]
        if good:
            lines.append(f"trusted: {', '.join(good)}")
        todo = []
        if causes & {"emulator_lag", "machine_busy", "replayer_late"}:
            todo.append("stop other work on this machine and run again, or lower the load "
                        "(a lower --speedup, fewer --replicas)")
        if "errors" in causes:
            todo.append("see the errors note above and the logs under the output directory's "
                        "logs/")
        todo.append("--repeat N shows the spread")
        lines.append(f"  What to do: {'; '.join(todo)}.")
    else:
        lines.append(f"trusted: every row (emulator lag p99 <= {TRUST_LAG_P99_S * 1000:.0f} ms and "
                     f"max <= {TRUST_LAG_MAX_S:.0f} s, machine <= {TRUST_MACHINE_BUSY:.0%} busy, "
                     f"replayer on time within {TRUST_SEND_LAG_S * 1000:.0f} ms, no failed "
                     "requests).")
    rank = results.get("ranking") or {}
    if results.get("repeat", 1) > 1 and "held" in rank:
        if rank["held"]:
            lines.append(f"ranking by TTFT p50 of the trusted rows held in all "
                         f"{len(rank['orders'])} rounds: " + " < ".join(rank["orders"][0]))
        else:
            lines.append("ranking by TTFT p50 of the trusted rows did NOT hold in every round:")
            lines.extend(f"  round {i + 1}: " + " < ".join(order)
                         for i, order in enumerate(rank["orders"]))
    elif results.get("repeat", 1) > 1:
        lines.append("ranking: not checked (fewer than two rows trusted in every round)")
    if rank.get("left_out"):
        lines.append("not ranked (not measured in every round): " + ", ".join(rank["left_out"]))
    prio = next((m.get("priority") for m in policies.values() if m.get("priority")), None)
    if prio:
        lines.append(f"priority: {prio['note']}")
    return lines
