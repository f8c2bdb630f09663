"""The shapes of a routing decision's explanation (``Decision.details``: what ``/debug/route``
and the audit show of every candidate) and of the ttft policy's cost terms. Pure.

Typed dicts, not dataclasses: the explanation goes out as JSON as it is, key for key in the
order the policy builds it, and readers (tests, the debug endpoint, the audit) index it by
name; the types make the keys and their units checkable without changing a byte of the output.
"""

from __future__ import annotations

from typing import Final, Literal, TypedDict


class CandidateView(TypedDict):
    """What every index policy (prefix, ttft) shows of a candidate replica."""

    confirmed_hit_blocks: int  # blocks the replica's index confirms (GPU tier)
    hit_blocks: int  # predicted GPU-tier hit, blocks
    cpu_hit_blocks: int  # predicted CPU-tier hit, blocks
    affinity: bool  # False: the replica's hashes cannot be trusted (no hit credit)
    load: int  # in-flight requests the bounded load counts
    over_load_cap: bool  # one more request would exceed the bounded load cap
    inflight_requests: int  # this router's requests, dispatch to completion
    inflight_prefill_tokens: int  # this router's tokens not yet at first token
    engine_running: int  # from the worker heartbeat
    engine_waiting: int  # from the worker heartbeat
    ring_rank: int  # position in the ring order of the request's ring key
    recent_write_blocks: float  # KV blocks this router sent to be written, decayed (1 decimal)


class PrefixDetails(CandidateView):
    """The prefix policy's view of a candidate: its cost in prefill tokens."""

    effective_hit_blocks: float  # hit depth credited (2 decimals)
    affinity_credit_blocks: float  # depth beyond the home's credited (2 decimals)
    queued_prefill_tokens: float  # prefill tokens queued ahead
    cost_tokens: float  # what the prefix policy minimises


class TtftTerms(TypedDict):
    """The ttft policy's predicted cost of a candidate, in seconds unless named otherwise
    (``router.decision.policy._ttft`` states how each is computed)."""

    wait_s: float  # the prefill queued ahead
    prefill_s: float  # the request's own prefill, with its CPU-tier load
    delay_s: float  # the delay the own prefill puts on the requests waiting behind it
    evict_s: float  # the reuse lost to the blocks its new KV evicts
    decode_s: float  # the decode slowdown it adds
    ttft_s: float  # wait_s + prefill_s: the predicted time to first token
    total_s: float  # what is minimised: ttft_s + delay_s + evict_s + decode_s
    work_tokens: float  # queued + own prefill work (what the rate learner fits)
    queued_prefill_tokens: float
    write_share: float  # the replica's share of recent KV writes (1.0 = even)
    tokens_per_s: float  # prefill rate used (learned, else the prior)
    load_s: float  # the CPU-tier blocks' transfer, part of prefill_s


class TtftDetails(CandidateView, TtftTerms):
    """The ttft policy's view of a candidate: the common view and its cost terms."""


CandidateDetails = PrefixDetails | TtftDetails

# the terms a ttft decision's reason names: which one set the chosen replica apart
TtftCostTerm = Literal["wait_s", "prefill_s", "delay_s", "evict_s", "decode_s"]
TTFT_COST_TERMS: Final[tuple[TtftCostTerm, ...]] = (
    "wait_s", "prefill_s", "delay_s", "evict_s", "decode_s")
