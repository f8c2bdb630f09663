"""The arithmetic of the admission benchmark (``loadtest.bench.admission``): which replayed
requests met their class's TTFT target, goodput, answers by status, each tenant's share of the
served prefill, the capacity a saturated run shows, the replay speed that offers a given
multiple of it, and the most a rate limit let through in any window. Pure: no I/O; most
functions take ``loadtest.replay.RequestRecord`` lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loadtest.replay.replayer import RequestRecord, percentile

NO_ANSWER = "no answer"  # status 0: the client gave up (the phase's drain ran out) or failed


def sent(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The records of requests that were sent (a replay cut at its duration leaves the rest)."""
    return [r for r in records if r.send_s is not None]


def met_target(record: RequestRecord, target_s: float) -> bool:
    """Answered 200 with its first token within ``target_s`` seconds of being sent."""
    return record.ok and record.ttft_s is not None and record.ttft_s <= target_s


def goodput_rps(by_class: Mapping[str, Sequence[RequestRecord]], targets_s: Mapping[str, float],
                window_s: float) -> float:
    """Requests per second that met their class's TTFT target: the count over every class in
    ``by_class`` (``{class: records}``; a class must have a target in ``targets_s``) divided by
    ``window_s``, the seconds over which the load was offered. Raises ``ValueError`` for a
    non-positive window or a class without a target."""
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    good = 0
    for name, records in by_class.items():
        if name not in targets_s:
            raise ValueError(f"class {name!r} has no TTFT target")
        good += sum(met_target(r, targets_s[name]) for r in records)
    return good / window_s


def statuses(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Sent requests by answer: ``"200"``, each other status, ``"<status> with Retry-After"``
    for refusals (429, 503) that carried one, and ``NO_ANSWER``; sorted by key."""
    out: dict[str, int] = {}
    for r in sent(records):
        key = str(r.status) if r.status else NO_ANSWER
        out[key] = out.get(key, 0) + 1
        if r.status in (429, 503) and r.retry_after is not None:
            with_header = f"{r.status} with Retry-After"
            out[with_header] = out.get(with_header, 0) + 1
    return dict(sorted(out.items()))


def statuses_of(codes: Sequence[int]) -> dict[str, int]:
    """HTTP statuses counted, by their text (0: ``NO_ANSWER``), sorted."""
    out: dict[str, int] = {}
    for code in codes:
        key = str(code) if code else NO_ANSWER
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def nothing_lost(counts: Mapping[str, int]) -> bool:
    """Every request answered 200, or 429/503 with Retry-After (``statuses``' counts)."""
    refused = {"429", "503"}
    for key, n in counts.items():
        if key == "200" or key.endswith("with Retry-After"):
            continue
        if key not in refused or counts.get(f"{key} with Retry-After", 0) != n:
            return False
    return True


def prefill_tokens(record: RequestRecord) -> int:
    """Prompt tokens the engine computed for a served request: prompt minus cached (0 when it
    was not served or reported no usage)."""
    if not record.ok or record.prompt_tokens is None:
        return 0
    return max(0, record.prompt_tokens - (record.cached_tokens or 0))


def prefill_shares(by_tenant: Mapping[str, Sequence[RequestRecord]]) -> dict[str, float | None]:
    """Each tenant's share (0-1) of the prefill tokens served to all of them; None each when
    nothing was served."""
    tokens = {t: sum(prefill_tokens(r) for r in rs) for t, rs in by_tenant.items()}
    total = sum(tokens.values())
    return {t: (n / total if total else None) for t, n in tokens.items()}


def served_rps(records: Sequence[RequestRecord], start_s: float, end_s: float) -> float:
    """Requests answered 200 whose stream ended between ``start_s`` and ``end_s`` (seconds from
    the replay's start), per second: the fleet's capacity when it was saturated throughout."""
    if end_s <= start_s:
        raise ValueError("end_s must be after start_s")
    done = [r for r in records if r.ok and r.send_s is not None and r.e2e_s is not None
            and start_s <= r.send_s + r.e2e_s < end_s]
    return len(done) / (end_s - start_s)


def speedup_for(load: float, capacity_rps: float, native_rps: float) -> float:
    """The replay speedup that offers ``load`` times ``capacity_rps`` from a trace that arrives
    at ``native_rps`` at speed 1. Raises ``ValueError`` for non-positive inputs."""
    if min(load, capacity_rps, native_rps) <= 0:
        raise ValueError("load, capacity_rps and native_rps must be positive")
    return load * capacity_rps / native_rps


def class_figures(records: Sequence[RequestRecord], target_s: float | None) -> dict[str, Any]:
    """One class's figures: requests sent and served, TTFT p50/p90 over the served ones (s),
    how many met ``target_s`` (None: no target), and whether the p90 is within it."""
    done = sent(records)
    ttfts = [r.ttft_s for r in done if r.ok and r.ttft_s is not None]
    p90 = percentile(ttfts, 90)
    return {"sent": len(done), "served": sum(r.ok for r in done),
            "ttft_p50_s": _round(percentile(ttfts, 50)), "ttft_p90_s": _round(p90),
            "target_s": target_s,
            "met_target": (sum(met_target(r, target_s) for r in done)
                           if target_s is not None else None),
            "p90_within_target": (p90 <= target_s if p90 is not None and target_s is not None
                                  else None)}


def longest_refusal_s(records: Sequence[RequestRecord]) -> float | None:
    """The longest a refused (429/503) request waited for its answer, s; None without one."""
    waits = [r.e2e_s for r in sent(records) if r.status in (429, 503) and r.e2e_s is not None]
    return _round(max(waits)) if waits else None


def tenant_figures(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """One tenant's requests in a fairness phase: sent, served, prompt tokens sent and served
    (from the trace), the served ones' cached share (usage), and when (s from the phase's
    start) the refused ones were sent."""
    done = sent(records)
    served = [r for r in done if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in served)
    return {"sent": len(done), "served": len(served),
            "prompt_tokens_sent": sum(r.input_length for r in done),
            "prompt_tokens_served": sum(r.input_length for r in served),
            "cached_share": _round(sum(r.cached_tokens or 0 for r in served) / prompt
                                   if prompt else None),
            "refused_sent_at_s": sorted(round(r.send_s or 0.0, 1) for r in done if not r.ok)}


Span = tuple[float, float, int]  # (sent at, answered at, amount): one request let through; s


def most_in_any_window(spans: Sequence[Span], window_s: float) -> int:
    """The most ``amount`` let through within any ``window_s`` seconds, as a client can tell it
    (a rate limit's check against its configured rate): a request was let through somewhere
    between being sent and being answered, so the ones sent at or after a moment and answered
    before ``window_s`` later were let through within one window. Raises ``ValueError`` for a
    non-positive window."""
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    return max((sum(n for sent_s, done_s, n in spans
                     if start <= sent_s and done_s < start + window_s)
                for start, _, _ in spans), default=0)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
