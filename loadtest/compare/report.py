"""What a comparison shows: the results table and its legend, the CPU table, the simulated
bounds, the notes a reader must know, the plots, and results.json. Writes files (plots,
results.json); the text it returns for the command to print."""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtest.compare.runs import (
    KV_AWARE_HASH_ALGO,
    KV_AWARE_PYTHONHASHSEED,
    OWN_POLICIES,
    TEXT_ONLY_PEERS,
)
from loadtest.compare.verdict import (
    TRUST_LAG_MAX_S,
    TRUST_LAG_P99_S,
    TRUST_MACHINE_BUSY,
    TRUST_SEND_LAG_S,
    describe_errors,
    ranking,
)
from loadtest.harness.fleet import DEFAULT_HASH_ALGO, VLLM_ROUTER, FleetConfig
from loadtest.replay.replayer import ReplayConfig, RequestRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure

def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value * scale, spec)


TABLE_COLUMNS = (  # (header, key, format, scale, legend)
    ("policy", None, "", 1.0, ""),
    ("prefix hit %", "token_hit_rate", ".1f", 100.0,
     "share of prompt tokens the engines found in their GPU prefix cache (their own "
     "vllm:prefix_cache_hits / queries counters)"),
    ("+CPU tier hit %", "tiers_token_hit_rate", ".1f", 100.0,
     "the same with the prompt tokens loaded from the replicas' CPU tier added"),
    ("TTFT p50 s", "ttft_p50_s", ".3f", 1.0,
     "time to first token, seconds from sending to the first token (client side; successful "
     "requests only); p50/p90/p99 = median, 90th, 99th percentile"),
    ("TTFT p90 s", "ttft_p90_s", ".3f", 1.0, ""),
    ("TTFT p99 s", "ttft_p99_s", ".3f", 1.0, ""),
    ("e2e p50 s", "e2e_p50_s", ".2f", 1.0, "median end-to-end time of a request, seconds"),
    ("req/s", "throughput_rps", ".2f", 1.0, "successful requests per second"),
    ("busy max/mean", "imbalance", ".2f", 1.0,
     "busy time of the busiest replica over the mean of all replicas (1.00 = even load)"),
    ("work max/mean", "imbalance_work", ".2f", 1.0,
     "the same for request-seconds (requests running or waiting, integrated over time)"),
    ("requests", "num_requests", "d", 1.0, "requests replayed"),
    ("failed", "num_errors", "d", 1.0, "requests that failed (by kind in the notes below)"),
    ("router CPU ms/req", "router_cpu_s_per_request", ".2f", 1000.0,
     "CPU milliseconds the router process used per request"),
    ("trusted", "trusted", "t", 1.0,
     "whether the row's latencies can be trusted (why not: the verdict at the end)"),
)
TIER_KEYS = ("tiers_token_hit_rate",)  # columns shown only for a fleet with a CPU tier
RANGED = ("token_hit_rate", "tiers_token_hit_rate", "ttft_p50_s", "ttft_p99_s")  # shown as median (min-max)


def _cell(m: dict[str, Any], key: str, spec: str, scale: float) -> str:
    if spec == "d":
        return str(m.get(key, "-"))
    if spec == "t":
        return "-" if key not in m else ("yes" if m[key] else "NO")
    text = _fmt(m.get(key), spec, scale)
    span = (m.get("range") or {}).get(key)
    if span and key in RANGED:
        text += f" ({_fmt(span[0], spec, scale)}-{_fmt(span[1], spec, scale)})"
    return text


def _fixed_width(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as fixed-width lines, the first column left-aligned, a rule under the
    header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def format_table(policies: dict[str, dict[str, Any]], cpu_tier: bool = False,
                 legend: bool = True) -> str:
    """A fixed-width text table, one row per policy; with repeats, the medians, and the range
    over the rounds beside the hit rate and TTFT figures. The ``TIER_KEYS`` columns only with
    ``cpu_tier``; with ``legend``, one line per column under the table saying what it holds."""
    columns = [c for c in TABLE_COLUMNS if cpu_tier or c[1] not in TIER_KEYS]
    rows = [[name for name, *_ in columns]]
    for label, m in policies.items():
        row = [label]
        for _name, key, spec, scale, _legend in columns[1:]:
            assert key is not None
            row.append(_cell(m, key, spec, scale))
        rows.append(row)
    lines = _fixed_width(rows)
    if legend:
        rounds = max((m.get("rounds") or 1 for m in policies.values()), default=1)
        lines.append("")
        lines.extend(f"  {name}: {text}" for name, _key, _spec, _scale, text in columns if text)
        if rounds > 1:
            lines.append(f"  with {rounds} rounds: each figure is the median over the rounds, "
                         "(min-max) beside the hit rates and TTFT p50/p99")
    return "\n".join(lines)


def format_cpu_table(policies: dict[str, dict[str, Any]]) -> str:
    """CPU seconds per component during each replay (with repeats: of the median round), the
    machine's busy share of its cores, the emulator's CPU per request and its lag."""
    comps = ["redis", "emulator", "workers", "router", "replayer"]
    header = ["policy", *[f"{c} s" for c in comps], "wall s", "machine busy",
              "emulator ms/req", "emulator lag p50 / p99 / max s"]
    rows = [header]
    for label, m in policies.items():
        cpu = m.get("cpu_s", {})
        lag = " / ".join(_fmt(m.get(k), ".3f") for k in
                         ("emulator_lag_p50_s", "emulator_lag_p99_s", "emulator_lag_max_s"))
        rows.append([label, *[_fmt(cpu.get(c), ".1f") for c in comps], _fmt(cpu.get("wall_s"), ".1f"),
                     _fmt(cpu.get("machine_util"), ".1%"),
                     _fmt(m.get("emulator_cpu_s_per_request"), ".1f", 1000.0), lag])
    return "\n".join([*_fixed_width(rows), "", *CPU_TABLE_LEGEND])


CPU_TABLE_LEGEND = (  # under the CPU table, so it reads without the docs
    "  redis .. replayer s: CPU seconds each process used during the replay (workers: all of "
    "them together; a peer router has no workers or Redis: -)",
    "  wall s: the replay's duration; machine busy: the share of all cores busy (every process "
    f"on the machine; over {TRUST_MACHINE_BUSY:.0%} makes a row untrusted)",
    "  emulator ms/req: emulator CPU per request; emulator lag: how late its engine steps ran "
    f"behind their own clock (p99 over {TRUST_LAG_P99_S * 1000:.0f} ms or max over "
    f"{TRUST_LAG_MAX_S:g} s makes a row untrusted)",
)


def write_plots(policies: dict[str, dict[str, Any]], records: dict[str, list[RequestRecord]],
                output_dir: Path, bounds: dict[str, Any] | None = None) -> list[Path]:
    """TTFT CDF per policy, hit rate per policy (with simulated bounds as lines), requests and
    busy time per replica per policy. Returns the written PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    for name, draw in (("ttft_cdf.png", _plot_ttft_cdf), ("hit_rate.png", _plot_hit_rate),
                       ("load_per_replica.png", _plot_load_per_replica)):
        fig = draw(policies, records, bounds)
        path = output_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _plot_ttft_cdf(policies: dict[str, dict[str, Any]], records: dict[str, list[RequestRecord]],
                   bounds: dict[str, Any] | None) -> Figure:
    """The TTFT CDF of every policy over all its requests, with the slice's TTFT floor."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label in policies:
        recs = records.get(label, [])
        ttfts = np.sort([r.ttft_s for r in recs if r.ok and r.ttft_s is not None])
        failed = sum(1 for r in recs if not r.ok)
        trusted = policies[label].get("trusted", True)
        name = label + ("" if trusted else " (NOT TRUSTED)") + (f", {failed} failed" if failed else "")
        if len(ttfts):  # over all requests: failed ones never arrive, so the curve stops short of 1
            ax.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(recs), label=name,
                    linestyle="-" if trusted else "--")
        elif failed:
            ax.plot([], [], label=name + " (no successful request)")
    floor = (bounds or {}).get("ttft_floor") or {}
    if floor.get("percentiles_s"):
        ax.plot(floor["percentiles_s"], np.arange(len(floor["percentiles_s"])) / 100.0,
                color="black", linestyle=":", linewidth=1.5,
                label="TTFT floor: each prompt's own prefill on an idle replica "
                      "(no policy can be left of it)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT: seconds from sending a request to its first token (log scale)")
    ax.set_ylabel("fraction of all requests (failed ones never arrive)")
    ax.set_title("TTFT CDF per policy (dashed: an untrusted row, whose latencies include waits "
                 "for a core)", fontsize="medium")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    return fig


def _plot_hit_rate(policies: dict[str, dict[str, Any]], records: dict[str, list[RequestRecord]],
                   bounds: dict[str, Any] | None) -> Figure:
    """The fleet's hit rate per policy as bars, the simulated bounds as lines."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = list(policies)
    fig, ax = plt.subplots(figsize=(8, 5))
    rates = [100.0 * (policies[label].get("token_hit_rate") or 0.0) for label in labels]
    default = f"{OWN_POLICIES[0]}"  # the router's default policy, green
    ax.bar(range(len(labels)), rates,
           color=["tab:green" if lb == default else "tab:gray" for lb in labels])
    # the values go under the bars, with the names, where no bound line can cross them
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([f"{lb}\n{rate:.1f}%" for lb, rate in zip(labels, rates, strict=True)],
                       rotation=20, ha="right")
    handles: list[Any] = [Patch(color="tab:green", label=f"{default}: prefix-router's default "
                                                          "policy"),
                          Patch(color="tab:gray", label="other policies and routers")]
    if bounds:
        for key, style, what in (
                ("single_cache", "--", "single cache as large as the whole fleet's KV "
                                       "(the placement bound)"),
                ("round_robin", ":", "round-robin placement")):
            value = bounds.get(key, {}).get("token_hit_rate")
            if value is not None:
                handles.append(ax.axhline(100 * value, linestyle=style, color="black",
                                          label=f"simulated {what} ({100 * value:.1f}%)"))
    ax.legend(handles=handles, fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.25),
              ncol=1)
    ax.set_ylabel("fleet token prefix-hit rate (%)")
    ax.set_title("Prefix-cache hit rate per policy (the engines' own counters)")
    fig.tight_layout()
    return fig


def _plot_load_per_replica(policies: dict[str, dict[str, Any]],
                           records: dict[str, list[RequestRecord]],
                           bounds: dict[str, Any] | None) -> Figure:
    """Requests and busy time per replica, a bar per policy."""
    import matplotlib.pyplot as plt
    import numpy as np

    labels = list(policies)
    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    width = 0.8 / max(1, len(labels))
    for k, label in enumerate(labels):
        m = policies[label]
        for ax, key in zip(axes, ("requests_per_replica", "busy_s_per_replica"), strict=True):
            per = m.get(key) or {}
            xs = np.arange(len(per)) + k * width
            ax.bar(xs, list(per.values()), width=width, label=label)
    axes[0].set_ylabel("requests")
    axes[1].set_ylabel("busy time (s)")
    any_policy = next(iter(policies.values()), {})
    names = list((any_policy.get("requests_per_replica") or {}).keys())
    axes[1].set_xticks(np.arange(len(names)) + 0.4 - width / 2)
    axes[1].set_xticklabels(names, rotation=20, ha="right")
    axes[0].set_title("Load per replica per policy")
    handles, names_ = axes[0].get_legend_handles_labels()
    fig.legend(handles, names_, loc="lower center", ncol=4, fontsize="small")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def format_bounds(bounds: dict[str, Any], policies: dict[str, dict[str, Any]]) -> str:
    """The simulated bounds and how close each measured policy came to the single-cache bound."""
    single = bounds["single_cache"]["token_hit_rate"]
    lines = [f"placement-only simulation of this slice ({bounds['replicas']} replicas, "
             f"{bounds['capacity_blocks_per_replica'] or 'unlimited'} {bounds['block_tokens']}-token "
             f"blocks each, LRU): single-cache bound {single:.1%}, round-robin "
             f"{bounds['round_robin']['token_hit_rate']:.1%}"]
    two_tier = bounds.get("single_cache_two_tier")
    if two_tier:
        lines.append(f"with a CPU tier of {bounds['cpu_capacity_blocks_per_replica']} blocks per "
                     f"replica (write-through, LRU): two-tier single-cache bound "
                     f"{two_tier['token_hit_rate']:.1%} (GPU {two_tier['gpu_token_hit_rate']:.1%} "
                     f"+ CPU tier {two_tier['cpu_token_hit_rate']:.1%})")
    for label, m in policies.items():
        rate = m.get("token_hit_rate")
        if rate is not None and single > 0:
            line = f"  {label}: {rate:.1%} = {rate / single:.0%} of the single-cache bound"
            both = m.get("tiers_token_hit_rate")
            if two_tier and both is not None and two_tier["token_hit_rate"] > 0:
                line += (f"; both tiers {both:.1%} = {both / two_tier['token_hit_rate']:.0%} of "
                         "the two-tier bound")
            lines.append(line)
    floor = bounds.get("ttft_floor")
    if floor:
        lines.append(
            f"TTFT floor of this slice (each request's own prefill alone on an idle replica, with "
            f"every block an earlier request had as a hit): p50 {floor['p50_s']:.3f} s, p90 "
            f"{floor['p90_s']:.3f} s, p99 {floor['p99_s']:.3f} s; no policy's quantile can be lower")
    return "\n".join(lines)


def run_notes(policies: dict[str, dict[str, Any]]) -> list[str]:
    """Caveats a reader of the table must know, derived from the runs that happened: every
    failed request by kind, and the peers' own conditions."""
    notes = []
    for label, m in policies.items():
        kinds = m.get("errors_by_kind") or []
        if kinds:
            rounds = sorted({k["round"] for k in kinds if "round" in k})
            per_round = [(f"round {r}: ", [k for k in kinds if k.get("round") == r])
                         for r in rounds] or [("", kinds)]
            total = sum(k["count"] for k in kinds)
            notes.append(f"{label}: {total} failed requests, by kind (HTTP status, reason, when "
                         "sent in seconds from the replay's start): "
                         + "; ".join(f"{head}{describe_errors(ks)}" for head, ks in per_round))
        if label.split(":", 1)[0] in TEXT_ONLY_PEERS:
            cpu = m.get("cpu_s", {})
            per_req = cpu.get("emulator", 0.0) / max(1, m.get("num_requests") or 1)
            notes.append(
                f"{label} accepts only text prompts over HTTP, so its run sends text of exactly the same "
                f"Qwen3 token counts and the emulator tokenizes it on this machine's CPU "
                f"({per_req * 1000:.0f} ms of emulator CPU per request in this run; the machine "
                f"was {cpu.get('machine_util', 0.0):.0%} busy): its hit rate and balance are "
                f"comparable, its TTFT and e2e latency are not.")
        if m.get("engine") == "vllm" and not any("CPU engines" in n for n in notes):
            from loadtest.harness.vllm_fleet import CPU_TTFT_NOTE

            notes.append(CPU_TTFT_NOTE)
        if label == f"{VLLM_ROUTER}:kv_aware":
            notes.append(
                f"{label} ran on a fleet with {KV_AWARE_HASH_ALGO}, PYTHONHASHSEED="
                f"{KV_AWARE_PYTHONHASHSEED} and byte-form KV-event hashes (its documented tested "
                f"setup); every other run used {DEFAULT_HASH_ALGO} with integer event hashes.")
    return notes


def run_line(label: str, m: dict[str, Any]) -> str:
    """One run's headline figures and verdict in one progress line."""
    return (f"[{label}] hit rate {_fmt(m['token_hit_rate'], '.1%')}, "
            f"TTFT p50 {_fmt(m['ttft_p50_s'], '.3f')} s, errors {m['num_errors']}, "
            f"emulator lag p99 {_fmt(m['emulator_lag_p99_s'], '.3f')} s, "
            + ("trusted" if m["trusted"] else f"NOT TRUSTED: {m['untrusted_reason']}"))


def results_document(fleet: FleetConfig, replay: ReplayConfig, trace_info: dict[str, Any],
                     bounds: dict[str, Any] | None, rounds: Sequence[dict[str, dict[str, Any]]],
                     policies: dict[str, dict[str, Any]], failed: dict[str, str],
                     argv: Sequence[str] | None, duration_s: float) -> dict[str, Any]:
    """results.json of a comparison: when and how it ran (command, trace slice, fleet, replay),
    the simulated ``bounds``, per policy its figures (``policies``, aggregated over ``rounds``),
    the ranking, the verdict's thresholds, the runs that failed and, with repeats, each
    round's own figures."""
    results: dict[str, Any] = {
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": list(argv) if argv is not None else None,
        "trace": trace_info,
        "fleet": {"engine": "vllm" if fleet.engines else "emulator",
                  "replicas": fleet.replicas, "model": fleet.model,
                  "block_size": fleet.block_size, "hash_algo": fleet.hash_algo,
                  "num_gpu_blocks_per_replica": fleet.num_gpu_blocks,
                  "time_scale": fleet.time_scale,
                  "emulator_args": list(fleet.emulator_args),
                  "router_args": list(fleet.router_args)},
        "replay": {k: v for k, v in asdict(replay).items() if k != "target"},
        "bounds": bounds,
        "repeat": len(rounds),
        "policies": policies,
        "ranking": ranking(rounds),
        "trust_thresholds": {"emulator_lag_p99_s": TRUST_LAG_P99_S,
                             "emulator_lag_max_s": TRUST_LAG_MAX_S,
                             "machine_busy": TRUST_MACHINE_BUSY,
                             "max_send_lag_s": TRUST_SEND_LAG_S},
        "failed": failed,
        "duration_s": duration_s,
    }
    if len(rounds) > 1:
        results["rounds"] = list(rounds)
    return results


def write_results(results: dict[str, Any], output_dir: Path) -> None:
    """``results`` as ``output_dir``/results.json (indented, a newline at the end)."""
    (output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")


def tables_text(results: dict[str, Any], bounds: dict[str, Any] | None, cpu_tier: bool) -> str:
    """The results table, the CPU table and (with ``bounds``) the simulated bounds, each after a
    blank line."""
    lines = ["", format_table(results["policies"], cpu_tier=cpu_tier), "",
             "CPU seconds per component during each replay:",
             format_cpu_table(results["policies"])]
    if bounds:
        lines += ["", format_bounds(bounds, results["policies"])]
    return "\n".join(lines)


def closing_text(results: dict[str, Any], skipped: dict[str, str], output_dir: Path) -> str:
    """The notes, the verdict's lines, the runs not measured and where the files are."""
    lines = [f"\nnote: {note}" for note in results["notes"]]
    lines += ["", *results["verdict"]]
    lines += [f"\n{label}: not measured: {reason.splitlines()[0] if reason else ''}"
              for label, reason in {**results["failed"], **skipped}.items()]
    lines += [f"\nresults: {output_dir / 'results.json'}",
              f"records: {output_dir}/records-<policy>.jsonl (one line per request)"]
    lines += [f"plot:    {plot}" for plot in results.get("plots", [])]
    return "\n".join(lines)
