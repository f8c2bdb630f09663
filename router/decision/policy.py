"""Routing policy: which replica gets a request, and why. Pure: no I/O, deterministic.

``decide`` takes the request's block chain, per-replica hit depths (from
``router.decision.index``), per-replica load and the ring, and returns a ``Decision``
with the chosen replica, an ordered list of fallbacks (for a retry before the
first byte) and a ``reason`` label:

* ``prefix_hit``: the replica holding the deepest engine-confirmed prefix (also where every
  replica holds as much, a shared system prompt or a fleet of one: a reason means the same
  whatever the fleet's size);
* ``speculative_hit``: the deepest prefix counts keys this router placed there
  in the last few seconds (the engine's events have not confirmed them yet);
* ``cold_ring``: the chosen replica holds none of the chain (or less than another whose
  lead is too short to pull, see step 2); of the
  replicas whose queued prefill is within ``cold_queue_slack_tokens``
  of the shortest, the request goes to the one that wrote the fewest KV blocks lately,
  ties to the first in ring order of the chain's first un-held block;
  ``cold_candidates`` limits the choice to the first few ring replicas (1: the
  ring home only, so every router instance agrees without coordination);
* ``load_spill``: the preferred replica is above the bounded-load cap
  (``load_factor`` x mean load); the next best under the cap, in ring order;
* ``load_balance``: the preferred replica's queued prefill exceeds another's
  by more than the prefill its hit saves (plus ``queue_slack_tokens``);
* ``no_tokenizer_ring``: the prompt could not be tokenized; ring on the text;
* ``ttft_wait``, ``ttft_prefill``, ``ttft_evict``: the ``ttft`` policy chose the replica with
  the lowest predicted cost in seconds, and this term (queue wait, own prefill, or the
  recompute its KV writes cause others) made the difference to the runner-up;
* ``round_robin``, ``least_loaded``, ``consistent_hash``: the baselines;
* ``session_affinity``: the request names a session (``router.traffic.sessions``) and its
  replica kept it over the policy's choice (``keep_session``).

The prefix policy, step by step:

1. hit depth per replica (engine-confirmed plus speculative, capped at vLLM's
   ``floor((N-1)/B)``); the ring home is the ring owner of the chain's first
   block beyond the deepest hit;
2. affinity credit: a replica's depth beyond the home's, counted only when it
   is at least ``min_hit_fraction`` of the prompt's blocks (and
   ``min_affinity_blocks``), so a short shared header held by a few replicas
   does not herd new prefixes onto them; the most credit wins, else the home;
   among the replicas holding at least as much as that winner (all of them for
   a cold prefix; the first ``cold_candidates`` in ring order unless that is
   0) whose queued prefill is within ``cold_queue_slack_tokens`` of the
   shortest, the fewest recent KV block writes (``recent_write_blocks``) wins: an LRU cache forgets at the rate it writes, so
   this keeps every replica's cache memory about as long as the others' (the
   fleet then behaves like one cache of the summed capacity) and evens out
   prefill work;
3. bounded load: a replica whose in-flight requests would exceed
   ``ceil(load_factor * mean) + load_headroom`` is skipped for the next one in
   preference order (``load_spill``);
4. queue versus hit: another replica wins (``load_balance``) only if its
   queued prefill is shorter than the anchor's by more than the prefix the move
   recomputes, weighted ``1 + recompute_penalty``, plus ``queue_slack_tokens``.

The ttft policy (``_ttft``) replaces steps 2-4 with one cost in seconds per replica, the
lowest wins (ties: ring order of the chain's first un-held block):

* wait: the prefill tokens queued ahead there (``queued_prefill_tokens``) times that
  replica's learned seconds per work token (``Candidate.s_per_token``; ``router.decision.ttft``);
* prefill: its fitted overhead plus the request's own work there, the tokens beyond that
  replica's hit with the attention they do against the cached context
  (``router.decision.ttft.prefill_work_tokens``);
* delay (a cost to others): the request's own prefill there delays the requests that arrive
  behind it before the queue drains: in expectation ``L`` of them per second of work, ``L`` the
  fleet's mean number of requests waiting for a first token (an M/M/1 queue holds
  ``rho / (1 - rho)`` on average, the busy period each added second of work stretches). So
  ``prefill_s x L``: an idle fleet routes on this request's TTFT alone, a busy one keeps
  requests where their prefix is, since recomputing it elsewhere makes everyone wait;
* evict (a cost to others): the request's new KV blocks evict as many from the replica's LRU
  tail; the chance that a tail block is hit again grows with how fast that replica's cache turns
  over, i.e. its share of the router's recent KV writes (``recent_write_blocks``). So
  ``evicted_reuse x new blocks x block_size x s_per_token x (write share x replicas)``: the
  expected seconds of recompute the placement causes, ``evicted_reuse`` at a fair write share.
  This is the prefix policy's write balance, in the same unit as the rest;
* decode (a cost to others and to itself): every decode step reads the KV of all the requests
  running on the replica (memory bound), so while the request generates, its prompt's KV
  lengthens the steps of the ``R`` requests running there and their ``K`` KV tokens lengthen its
  own: ``decode_weight x s_per_token x router.decision.ttft.decode_work_tokens(K, R, prompt, mean
  output)``, with ``K`` and ``R`` this router's in-flight prompts and requests there plus other
  routers' (heartbeat). ``decode_weight`` converts decode seconds, summed over hundreds of steps
  and many requests, into TTFT seconds; it spreads long-running conversations, as vLLM-router
  ``kv_aware``'s active-blocks term does, which the prefill terms alone leave piled up;
* bounded load (the same cap as step 3, ``load_factor`` with a fixed headroom of
  ``TTFT_LOAD_HEADROOM`` requests) stays as a safety cap: a replica over it is skipped
  (``load_spill``).

A replica's load for the bound is its in-flight requests: this router's own
count plus the requests other routers have there (the engine's running +
waiting at heartbeat time minus this router's count at that same time).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from router.decision.details import (
    TTFT_COST_TERMS,
    CandidateDetails,
    CandidateView,
    TtftTerms,
)
from router.decision.ring import HashRing
from router.decision.ttft import (
    DEFAULT_CPU_LOAD_TOKENS_PER_S,
    DEFAULT_OUTPUT_TOKENS,
    DEFAULT_PRIOR_TOKENS_PER_S,
    cpu_hit_value,
    decode_work_tokens,
    prefill_work_tokens,
)
from router.shared.contract import BlockKey
from router.shared.hashing import max_hit_blocks

REASON_PREFIX_HIT: Final = "prefix_hit"
REASON_SPECULATIVE_HIT: Final = "speculative_hit"
REASON_COLD_RING: Final = "cold_ring"
REASON_LOAD_SPILL: Final = "load_spill"
REASON_LOAD_BALANCE: Final = "load_balance"
REASON_NO_TOKENIZER_RING: Final = "no_tokenizer_ring"
REASON_ROUND_ROBIN: Final = "round_robin"
REASON_LEAST_LOADED: Final = "least_loaded"
REASON_CONSISTENT_HASH: Final = "consistent_hash"
REASON_TTFT_WAIT: Final = "ttft_wait"
REASON_TTFT_PREFILL: Final = "ttft_prefill"
REASON_TTFT_EVICT: Final = "ttft_evict"
REASON_TTFT_DECODE: Final = "ttft_decode"
REASON_SESSION_AFFINITY: Final = "session_affinity"
REASONS: Final = (REASON_PREFIX_HIT, REASON_SPECULATIVE_HIT, REASON_COLD_RING, REASON_LOAD_SPILL,
                  REASON_LOAD_BALANCE, REASON_NO_TOKENIZER_RING, REASON_ROUND_ROBIN,
                  REASON_LEAST_LOADED, REASON_CONSISTENT_HASH, REASON_TTFT_WAIT,
                  REASON_TTFT_PREFILL, REASON_TTFT_EVICT, REASON_TTFT_DECODE,
                  REASON_SESSION_AFFINITY)
TTFT_LOAD_HEADROOM: Final = 4  # requests above ceil(load_factor * mean) for the ttft policy's cap:
# a safety cap, not a knob (the prefix policy's default headroom)
DEFAULT_EVICTED_REUSE: Final = 0.5  # chance that a block evicted from a replica writing its fair
# share of KV would have been hit again (dimensionless)
DEFAULT_DECODE_WEIGHT: Final = 0.02  # seconds of TTFT one second of decode-step time is worth:
# the decode term sums decode seconds over every request sharing the replica's steps (hundreds of
# steps each) while a TTFT is paid once; in loadtest.lab.policy_lab 0.02 cut e2e latency and work
# imbalance at about the same TTFT (docs/benchmarks.md, "The policy lab")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One eligible replica's state at decision time.

    ``affinity`` is False when its reported hashes cannot be trusted
    (``hash_verified`` is ``HashVerified.MISMATCH`` or another block size): it then gets no hit credit.
    ``inflight_*`` are this router's own counts (dispatch to completion /
    dispatch to first token); ``engine_*`` come from the worker heartbeat.
    ``recent_write_blocks`` is ``LoadTracker.recent_writes``: the prefill
    blocks this router recently sent there (new KV the engine had to write).
    ``ours_at_heartbeat`` is how many of this router's requests were in flight
    on the replica when the heartbeat's load was read (``LoadTracker.requests_at``),
    or None when unknown (then the current count stands in for it).
    """

    replica_id: str
    affinity: bool = True
    inflight_requests: int = 0
    inflight_prefill_tokens: int = 0  # tokens of this router's requests not yet at first token
    engine_running: int = 0
    engine_waiting: int = 0
    ours_at_heartbeat: int | None = None
    recent_write_blocks: float = 0.0  # KV blocks this router sent to be written, decayed
    prefilling_requests: int = 0  # this router's requests there not yet at first token
    s_per_token: float = 0.0  # learned seconds per prefill work token (0: the prior; ttft policy)
    overhead_s: float = 0.0  # learned TTFT seconds that do not grow with work (ttft policy)
    inflight_context_tokens: int = 0  # prompt tokens of this router's requests in flight there

    @property
    def foreign_requests(self) -> int:
        """Requests other routers (or clients going around us) have on the replica.

        The engine's running + waiting at heartbeat time, minus this router's
        requests in flight at that same moment: a heartbeat a second old still
        lists requests we have since finished, and comparing it with our
        current count would invent phantom load.
        """
        ours = self.inflight_requests if self.ours_at_heartbeat is None else self.ours_at_heartbeat
        return max(0, self.engine_running + self.engine_waiting - ours)

    @property
    def load(self) -> int:
        """In-flight requests: this router's own, plus other routers' from the heartbeat."""
        return self.inflight_requests + self.foreign_requests

    def queued_prefill_tokens(self, avg_prompt_tokens: float) -> float:
        """Prefill tokens ahead of a new request: ours, plus other routers' waiting requests."""
        waiting = min(self.foreign_requests, self.engine_waiting)
        return self.inflight_prefill_tokens + waiting * avg_prompt_tokens

    def context_tokens(self, avg_prompt_tokens: float) -> float:
        """KV tokens of the requests running there: ours, plus other routers' (estimated)."""
        return self.inflight_context_tokens + self.foreign_requests * avg_prompt_tokens

    @property
    def queued_requests(self) -> int:
        """Requests waiting for their first token there: ours, plus other routers' waiting ones."""
        return self.prefilling_requests + min(self.foreign_requests, self.engine_waiting)


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """Tunables of ``decide`` (from ``RouterConfig``)."""

    block_size: int = 16  # tokens
    load_factor: float = 2.0  # bounded load: cap = ceil(load_factor * mean) + load_headroom
    load_headroom: int = 4  # requests above the multiplicative cap, for small counts
    queue_slack_tokens: int = 8192  # queue advantage (tokens) a move must exceed beyond the recompute
    recompute_penalty: float = 50.0  # extra weight on recomputed prefix tokens in a load move
    min_hit_fraction: float = 0.2  # affinity needs this share of the prompt's blocks beyond the home's
    min_affinity_blocks: int = 2  # and at least this many blocks
    consistent_hash_blocks: int = 64  # blocks keyed by the consistent_hash baseline
    cold_candidates: int = 0  # first ring replicas (holding as much) that compete on recent writes; 0 = all
    cold_queue_slack_tokens: int = 1024  # queued prefill within this of the shortest counts as short
    ttft_prior_tokens_per_s: float = DEFAULT_PRIOR_TOKENS_PER_S  # ttft: prefill rate before learning
    evicted_reuse: float = DEFAULT_EVICTED_REUSE  # ttft: hit chance of an evicted block, fair share
    decode_weight: float = DEFAULT_DECODE_WEIGHT  # ttft: TTFT seconds per second of decode steps
    cpu_load_tokens_per_s: float = DEFAULT_CPU_LOAD_TOKENS_PER_S  # CPU tier -> GPU load rate


@dataclass(frozen=True, slots=True)
class RouteInput:
    """What the policy knows about the request.

    ``chain`` is the prompt's block keys (empty when untokenized or shorter than
    a block); ``num_tokens`` the prompt length (0 if unknown); ``ring_key`` a
    64-bit key used when ``chain`` is empty (hash of the text or tokens);
    ``tokenized`` False when the prompt could not be tokenized.
    """

    chain: Sequence[BlockKey]
    num_tokens: int
    ring_key: BlockKey | int  # a block key, or a text hash when there is no chain
    tokenized: bool = True


@dataclass(frozen=True, slots=True)
class HitDepth:
    """A replica's predicted prefix hit in blocks, capped at vLLM's max hit: ``blocks`` (GPU
    tier) counts the router's own speculative placements too, ``confirmed`` only what its worker
    reported; ``cpu_blocks`` the blocks past ``blocks`` its CPU tier holds (loaded from host
    memory, not recomputed)."""

    blocks: int = 0
    confirmed: int = 0
    cpu_blocks: int = 0

    @property
    def total_blocks(self) -> int:
        """Blocks the engine will not prefill: the GPU hit plus the CPU-tier hit."""
        return self.blocks + self.cpu_blocks


NO_HIT: Final = HitDepth()


@dataclass(frozen=True, slots=True)
class TtftPrediction:
    """The ttft policy's prediction for one replica: ``work_tokens`` of prefill (queued ahead
    plus its own) it expects to take ``ttft_s`` seconds there (what the learner checks)."""

    work_tokens: float
    ttft_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen replica, retry order, every candidate's hit depth and the explanation.

    ``hits`` is what dispatch reads (placement, KV-write accounting, the TTFT prediction);
    ``details`` is the explanation ``/debug/route`` shows (loads, ranks, seconds), for people.
    """

    replica_id: str
    reason: str
    fallbacks: tuple[str, ...]  # other eligible replicas, best first
    hit_blocks: int  # predicted hit on the chosen replica (capped at vLLM's max hit)
    chain_blocks: int
    details: Mapping[str, CandidateDetails] = field(default_factory=dict)  # {replica_id: view}
    hits: Mapping[str, HitDepth] = field(default_factory=dict)  # {replica_id: hit depth}
    predictions: Mapping[str, TtftPrediction] = field(default_factory=dict)  # ttft policy only

    def hit(self, replica_id: str) -> HitDepth:
        """``replica_id``'s hit depth (``NO_HIT`` for a replica the policy did not score)."""
        return self.hits.get(replica_id, NO_HIT)

    @property
    def predicted_hit(self) -> bool:
        """A hit on the chosen replica in either tier (vLLM's ``cached_tokens`` counts both)."""
        return self.hit_blocks > 0 or self.hit(self.replica_id).cpu_blocks > 0


def decide(
    policy: str,
    request: RouteInput,
    replicas: Sequence[Candidate],
    ring: HashRing,
    *,
    confirmed: Mapping[str, int] | None = None,
    combined: Mapping[str, int] | None = None,
    params: PolicyParams | None = None,
    rr_counter: int = 0,
    avg_prompt_tokens: float = 0.0,
    tiered: Mapping[str, int] | None = None,
    avg_output_tokens: float = DEFAULT_OUTPUT_TOKENS,
) -> Decision:
    """Route one request among ``replicas`` (already filtered for health and model).

    ``confirmed``/``combined`` are GPU-tier hit depths in blocks per replica id
    (``BlockIndex.hit_depths``); missing ids count as 0. ``tiered``: the depth with the CPU
    tier continuing ``combined`` (``BlockIndex.tier_depths``; missing: no CPU-tier hit). ``ring`` may contain
    more replicas than are eligible. ``rr_counter`` rotates the round_robin
    baseline and least_loaded's ties. ``avg_prompt_tokens`` / ``avg_output_tokens``: the
    mean prompt and generated lengths (tokens) this router has seen, for load it cannot count
    itself. Raises ``ValueError`` if ``replicas`` is empty or ``policy`` unknown.
    """
    if not replicas:
        raise ValueError("no eligible replica")
    params = params or PolicyParams()
    confirmed = confirmed or {}
    combined = combined or {}
    tiered = tiered or {}
    chosen = POLICIES.get(policy)
    if chosen is None:
        raise ValueError(f"unknown policy {policy!r}")
    return chosen.run(request, replicas, ring, PolicyContext(
        params, confirmed, combined, tiered, rr_counter, avg_prompt_tokens, avg_output_tokens))


def session_replica(ring: HashRing, session_key: int, replicas: Sequence[Candidate],
                    remembered: str | None) -> str:
    """The replica a session belongs on: ``remembered`` (the last one that served it) when it is
    among ``replicas``, else the ring owner of ``session_key`` among them (a session's first
    request: every router instance picks the same replica without sharing anything)."""
    if remembered is not None and any(r.replica_id == remembered for r in replicas):
        return remembered
    return _ring_order(ring, session_key, replicas)[0]


def keep_session(decision: Decision, replicas: Sequence[Candidate], home: str,
                 params: PolicyParams, policy: str) -> Decision:
    """``decision`` moved to the session's replica ``home`` (reason ``session_affinity``, the
    policy's choice first among the fallbacks) while ``home`` holds the session's prefix and is
    not overloaded; else ``decision`` unchanged.

    * Not overloaded: one more request keeps ``home`` within the bounded load cap the policies
      use (``ceil(load_factor * mean) + headroom`` in-flight requests; the ttft policy's fixed
      headroom for it), so a session moves off a replica the policy would spill from.
    * Holds the prefix: no other candidate's predicted hit (GPU plus CPU tier, with this router's
      speculative placements) exceeds ``home``'s by ``min_affinity_blocks`` (at least 1) or more. A prefix
      no replica is known to hold (its KV events not indexed yet, or a baseline policy, which
      scores no hits) keeps the session where it is; one the index shows elsewhere, deeper
      (``home`` evicted it, or another replica served the session since), lets it follow.

    ``home`` must be among ``replicas`` (``session_replica``)."""
    if home == decision.replica_id:
        return decision
    headroom = TTFT_LOAD_HEADROOM if policy == "ttft" else params.load_headroom
    if _over_load_cap(replicas, params.load_factor, headroom)[home]:
        return decision
    held, margin = decision.hit(home).total_blocks, max(1, params.min_affinity_blocks)
    if any(decision.hit(r.replica_id).total_blocks - held >= margin for r in replicas):
        return decision
    fallbacks = (decision.replica_id, *(rid for rid in decision.fallbacks if rid != home))
    return dataclasses.replace(decision, replica_id=home, reason=REASON_SESSION_AFFINITY,
                               fallbacks=fallbacks, hit_blocks=decision.hit(home).blocks)


def _ring_order(ring: HashRing, key: int, replicas: Sequence[Candidate]) -> list[str]:
    """Eligible replicas in ring order for ``key``; ones missing from the ring go last, by id."""
    eligible = {r.replica_id for r in replicas}
    order = [rid for rid in ring.order(key) if rid in eligible]
    if len(order) < len(eligible):
        seen = set(order)
        order.extend(sorted(eligible - seen))
    return order


def _round_robin(request: RouteInput, replicas: Sequence[Candidate], counter: int) -> Decision:
    ids = sorted(r.replica_id for r in replicas)
    start = counter % len(ids)
    order = ids[start:] + ids[:start]
    return Decision(order[0], REASON_ROUND_ROBIN, tuple(order[1:]), 0, len(request.chain))


def _least_loaded(request: RouteInput, replicas: Sequence[Candidate], counter: int) -> Decision:
    ranked = sorted(replicas, key=lambda r: (r.load, r.inflight_prefill_tokens, r.replica_id))
    best = ranked[0]
    ties = [r for r in ranked if (r.load, r.inflight_prefill_tokens)
            == (best.load, best.inflight_prefill_tokens)]
    chosen = ties[counter % len(ties)].replica_id
    rest = tuple(r.replica_id for r in ranked if r.replica_id != chosen)
    return Decision(chosen, REASON_LEAST_LOADED, rest, 0, len(request.chain))


def _consistent_hash(request: RouteInput, replicas: Sequence[Candidate], ring: HashRing,
                     params: PolicyParams) -> Decision:
    chain = request.chain
    key = chain[min(len(chain), params.consistent_hash_blocks) - 1] if chain else request.ring_key
    order = _ring_order(ring, key, replicas)
    return Decision(order[0], REASON_CONSISTENT_HASH, tuple(order[1:]), 0, len(chain))


@dataclass(frozen=True, slots=True)
class _Hits:
    """Per replica id: GPU hit depth (confirmed + speculative), its confirmed part and the
    CPU-tier blocks past it, in blocks; and the eligible replicas in ring order."""

    depth: dict[str, int]
    conf: dict[str, int]
    cpu: dict[str, int]
    order: list[str]
    rank: dict[str, int] = field(default_factory=dict)  # {replica_id: position in ``order``}

    def __post_init__(self) -> None:
        self.rank.update((rid, i) for i, rid in enumerate(self.order))

    def hit_depths(self) -> dict[str, HitDepth]:
        return {rid: HitDepth(d, self.conf[rid], self.cpu[rid]) for rid, d in self.depth.items()}


def _hit_reason(chosen: str, hits: _Hits) -> str:
    """``prefix_hit`` when the engine confirmed all of ``chosen``'s hit depth, else
    ``speculative_hit`` (part of it is blocks this router placed there lately)."""
    return (REASON_PREFIX_HIT if hits.conf[chosen] >= hits.depth[chosen]
            else REASON_SPECULATIVE_HIT)


def _hit_depths(request: RouteInput, replicas: Sequence[Candidate], ring: HashRing,
                confirmed: Mapping[str, int], combined: Mapping[str, int],
                tiered: Mapping[str, int], block_size: int) -> _Hits:
    """Per replica: hit depth (confirmed + speculative), confirmed depth and the CPU-tier blocks
    past the hit, in blocks, all capped at vLLM's ``floor((N-1)/B)`` in total and 0 without
    affinity; and the eligible replicas in ring order of the chain's first block beyond the
    deepest GPU hit (of ``request.ring_key`` without a chain)."""
    cap_blocks = max_hit_blocks(request.num_tokens, block_size)
    depth: dict[str, int] = {}
    conf: dict[str, int] = {}
    cpu: dict[str, int] = {}
    for r in replicas:
        d = combined.get(r.replica_id, 0) if r.affinity else 0
        depth[r.replica_id] = min(d, cap_blocks)
        conf[r.replica_id] = min(confirmed.get(r.replica_id, 0) if r.affinity else 0, cap_blocks)
        total = min(tiered.get(r.replica_id, 0), cap_blocks) if r.affinity else 0
        cpu[r.replica_id] = max(total - depth[r.replica_id], 0)
    raw_best = max((combined.get(r.replica_id, 0) if r.affinity else 0) for r in replicas)
    chain = request.chain
    ring_key: BlockKey | int
    if chain:
        ring_key = chain[raw_best] if raw_best < len(chain) else chain[-1]
    else:
        ring_key = request.ring_key
    return _Hits(depth, conf, cpu, _ring_order(ring, ring_key, replicas))


def _over_load_cap(replicas: Sequence[Candidate], load_factor: float,
                   headroom: int) -> dict[str, bool]:
    """Bounded load on in-flight requests: ``{replica_id: one more request would exceed
    ceil(load_factor * mean) + headroom}``, the mean counting the new request. The additive
    headroom keeps small counts (2-3 requests per replica) from spilling on every arrival."""
    total_load = sum(r.load for r in replicas) + 1
    cap_load = math.ceil(load_factor * total_load / len(replicas)) + headroom
    return {r.replica_id: r.load + 1 > cap_load for r in replicas}


def _view_details(r: Candidate, hits: _Hits, rid: str, over: bool) -> CandidateView:
    """What ``Decision.details`` shows of every candidate, whatever the index policy."""
    return {
        "confirmed_hit_blocks": hits.conf[rid],
        "hit_blocks": hits.depth[rid],
        "cpu_hit_blocks": hits.cpu[rid],
        "affinity": r.affinity,
        "load": r.load,
        "over_load_cap": over,
        "inflight_requests": r.inflight_requests,
        "inflight_prefill_tokens": r.inflight_prefill_tokens,
        "engine_running": r.engine_running,
        "engine_waiting": r.engine_waiting,
        "ring_rank": hits.rank[rid],
        "recent_write_blocks": round(r.recent_write_blocks, 1),
    }


def _prefix(
    request: RouteInput,
    replicas: Sequence[Candidate],
    ring: HashRing,
    hits: _Hits,
    params: PolicyParams,
    avg_prompt_tokens: float,
) -> Decision:
    chain = request.chain
    size = params.block_size
    cap_blocks = max_hit_blocks(request.num_tokens, size)
    order = hits.order
    # A CPU-tier block counts as the share of a GPU hit it saves: its transfer replaces its
    # prefill (``router.decision.ttft.cpu_hit_value``; ~0.93 for an 8B model over a 50 GB/s host link).
    # Every step below weighs hits in these GPU-equivalent blocks.
    cpu_value = cpu_hit_value(params.ttft_prior_tokens_per_s, params.cpu_load_tokens_per_s)
    depth = {rid: d + hits.cpu[rid] * cpu_value for rid, d in hits.depth.items()}
    rank = {rid: i for i, rid in enumerate(order)}
    by_id = {r.replica_id: r for r in replicas}

    # Affinity credit is measured against the ring home, and only a meaningful
    # advantage counts: a prefix that the home lacks but that is small next to
    # the prompt (a shared system prompt still spreading through the fleet) must
    # not pull every new conversation onto the few replicas that cached it first.
    home_depth = depth[order[0]]
    min_credit = max(params.min_affinity_blocks,
                     math.ceil(params.min_hit_fraction * max(cap_blocks, 1)))
    credit = {rid: (d - home_depth if d - home_depth >= min_credit else 0.0)
              for rid, d in depth.items()}

    over = _over_load_cap(replicas, params.load_factor, params.load_headroom)
    queued = {r.replica_id: r.queued_prefill_tokens(avg_prompt_tokens) for r in replicas}
    cost = {rid: queued[rid] + max(request.num_tokens - depth[rid] * size, 0) for rid in order}

    def preference(rid: str) -> tuple[float, int]:
        return (-credit[rid], rank[rid])

    # Where several replicas hold as much of the chain as the preferred one (every replica, for a
    # cold prefix), they compete (the first ``cold_candidates`` in ring order, 0: all): of those
    # whose queued prefill is within ``cold_queue_slack_tokens`` of the shortest, the one that wrote
    # the fewest new KV blocks recently, which keeps its cached prefixes longest (LRU evicts at
    # the write rate). Each holds at least as much as the preferred one, so each has its credit.
    preferred = min(order, key=preference)
    if params.cold_candidates != 1:
        equals = [rid for rid in order if depth[rid] >= depth[preferred]]
        if params.cold_candidates > 1:
            del equals[params.cold_candidates:]
        shortest = min(queued[rid] for rid in equals)
        near = [rid for rid in equals if queued[rid] <= shortest + params.cold_queue_slack_tokens]
        preferred = min(near, key=lambda rid: (by_id[rid].recent_write_blocks, rank[rid]))
    allowed = [rid for rid in order if not over[rid]] or list(order)
    spilled = preferred not in allowed
    anchor = min(allowed, key=preference) if spilled else preferred

    # Leave the anchor only when the queue saved outweighs the prefill the move
    # recomputes, counted with a penalty: recomputing a held prefix costs the
    # fleet GPU time and a second copy of the blocks, not only this request.
    def move_gain(rid: str) -> float:
        recomputed = max(depth[anchor] - depth[rid], 0) * size
        return (queued[anchor] - queued[rid]
                - recomputed * (1.0 + params.recompute_penalty) - params.queue_slack_tokens)

    cheapest = max(allowed, key=lambda rid: (move_gain(rid), -rank[rid]))
    balanced = cheapest != anchor and move_gain(cheapest) > 0
    chosen = cheapest if balanced else anchor

    if not request.tokenized:
        reason = REASON_LOAD_SPILL if spilled else REASON_NO_TOKENIZER_RING
        if balanced:
            reason = REASON_LOAD_BALANCE
    elif spilled:
        reason = REASON_LOAD_SPILL
    elif balanced:
        reason = REASON_LOAD_BALANCE
    elif credit[chosen] > 0 or (depth[chosen] > 0 and depth[chosen] == max(depth.values())):
        # holding the deepest prefix is a hit also where every replica holds as much (a shared
        # system prompt, a fleet of one): a reason means the same whatever the fleet's size
        reason = _hit_reason(chosen, hits)
    else:
        reason = REASON_COLD_RING

    rest = sorted((rid for rid in order if rid != chosen),
                  key=lambda rid: (over[rid], cost[rid], preference(rid)))
    details: dict[str, CandidateDetails] = {
        rid: {
            **_view_details(by_id[rid], hits, rid, over[rid]),
            "effective_hit_blocks": round(depth[rid], 2),
            "affinity_credit_blocks": round(credit[rid], 2),
            "queued_prefill_tokens": queued[rid],
            "cost_tokens": cost[rid],
        }
        for rid in order
    }
    return Decision(chosen, reason, tuple(rest), hits.depth[chosen], len(chain), details,
                    hits.hit_depths())


def _ttft(
    request: RouteInput,
    replicas: Sequence[Candidate],
    ring: HashRing,
    hits: _Hits,
    params: PolicyParams,
    avg_prompt_tokens: float,
    avg_output_tokens: float = DEFAULT_OUTPUT_TOKENS,
) -> Decision:
    """The replica with the lowest predicted cost in seconds (see the module docstring).

    ``details[replica_id]`` holds, besides the hit depths and loads, ``wait_s``, ``prefill_s``,
    ``delay_s``, ``evict_s``, ``decode_s``, ``ttft_s`` (wait + prefill: the predicted TTFT),
    ``total_s`` (+ delay + evict + decode: what is minimised) and ``work_tokens`` (queued + own prefill work, what the
    rate learner fits). A CPU-tier hit is not prefilled: the request's own work is the tokens
    past the GPU and CPU hits, and ``load_s``, the CPU-tier blocks' transfer at
    ``cpu_load_tokens_per_s``, is part of its prefill (and TTFT); ``evict_s`` counts only the
    new KV blocks (past both hits).
    """
    depth, order = hits.depth, hits.order
    rank = {rid: i for i, rid in enumerate(order)}
    by_id = {r.replica_id: r for r in replicas}
    over = _over_load_cap(replicas, params.load_factor, TTFT_LOAD_HEADROOM)
    terms = _ttft_terms(request, replicas, hits, params, avg_prompt_tokens, avg_output_tokens)

    def cost(rid: str) -> tuple[float, int]:
        return (terms[rid]["total_s"], rank[rid])

    allowed = [rid for rid in order if not over[rid]] or list(order)
    if not request.tokenized:
        # no chain, so no hit to weigh: the ring on the text is the only affinity there is
        chosen = allowed[0]
        reason = REASON_NO_TOKENIZER_RING if chosen == order[0] else REASON_LOAD_SPILL
    else:
        chosen = min(allowed, key=cost)
        reason = _ttft_reason(chosen, order, terms, hits, cost)

    rest = sorted((rid for rid in order if rid != chosen), key=lambda rid: (over[rid], cost(rid)))
    details: dict[str, CandidateDetails] = {
        rid: {**_view_details(by_id[rid], hits, rid, over[rid]), **terms[rid]}
        for rid in order
    }
    predictions = {rid: TtftPrediction(terms[rid]["work_tokens"], terms[rid]["ttft_s"])
                   for rid in order}
    return Decision(chosen, reason, tuple(rest), depth[chosen], len(request.chain), details,
                    hits.hit_depths(), predictions)


def _ttft_terms(
    request: RouteInput,
    replicas: Sequence[Candidate],
    hits: _Hits,
    params: PolicyParams,
    avg_prompt_tokens: float,
    avg_output_tokens: float,
) -> dict[str, TtftTerms]:
    """{replica_id: its cost terms in seconds} for ``_ttft``, in ``hits.order`` (the terms are
    listed in ``_ttft``'s docstring)."""
    size = params.block_size
    depth, order = hits.depth, hits.order
    by_id = {r.replica_id: r for r in replicas}
    prior_s_per_token = 1.0 / params.ttft_prior_tokens_per_s
    total_writes = sum(r.recent_write_blocks for r in replicas)
    waiting_behind = sum(r.queued_requests for r in replicas) / len(replicas)  # L
    prompt_blocks = request.num_tokens // size
    terms: dict[str, TtftTerms] = {}
    for rid in order:
        r = by_id[rid]
        s_per_token = r.s_per_token or prior_s_per_token
        cpu_tokens = hits.cpu[rid] * size
        hit_tokens = depth[rid] * size + cpu_tokens
        queued = r.queued_prefill_tokens(avg_prompt_tokens)
        own = prefill_work_tokens(request.num_tokens - hit_tokens, hit_tokens)
        load_s = cpu_tokens / params.cpu_load_tokens_per_s
        share = (r.recent_write_blocks * len(replicas) / total_writes if total_writes > 0
                 else 1.0)
        # new KV only: blocks loaded from the host tier move between the replica's tiers (a GPU
        # block they displace stays on the host, write-through), they add nothing to evict
        new_blocks = max(prompt_blocks - depth[rid] - hits.cpu[rid], 0)
        wait_s = queued * s_per_token
        prefill_s = r.overhead_s + own * s_per_token + load_s
        evict_s = params.evicted_reuse * new_blocks * size * s_per_token * share
        delay_s = own * s_per_token * waiting_behind
        decode_s = params.decode_weight * s_per_token * decode_work_tokens(
            r.context_tokens(avg_prompt_tokens), r.inflight_requests + r.foreign_requests,
            request.num_tokens, avg_output_tokens)
        terms[rid] = {"wait_s": wait_s, "prefill_s": prefill_s, "delay_s": delay_s,
                      "evict_s": evict_s, "decode_s": decode_s, "ttft_s": wait_s + prefill_s,
                      "total_s": wait_s + prefill_s + delay_s + evict_s + decode_s,
                      "work_tokens": queued + own, "queued_prefill_tokens": queued,
                      "write_share": share, "tokens_per_s": 1.0 / s_per_token,
                      "load_s": load_s}
    return terms


def _ttft_reason(chosen: str, order: Sequence[str], terms: dict[str, TtftTerms], hits: _Hits,
                 cost: Callable[[str], tuple[float, int]]) -> str:
    """Why ``_ttft`` chose ``chosen``, the cheapest of the replicas under the load cap: the cost
    term that gains most against the runner-up, a load spill, or ring order."""
    # the runner-up is the best replica that costs more (replicas costing the same differ
    # only in ring order, which broke the tie)
    others = [rid for rid in order if terms[rid]["total_s"] != terms[chosen]["total_s"]]
    if chosen != min(order, key=cost):
        return REASON_LOAD_SPILL
    if not others:
        # nothing tells them apart: ring order decided; a hit there is still a hit (a
        # fleet of one, a prefix every replica holds), so the reason reads as in a bigger fleet
        return _hit_reason(chosen, hits) if hits.depth[chosen] > 0 else REASON_COLD_RING
    runner_up = terms[min(others, key=cost)]
    gains = {term: runner_up[term] - terms[chosen][term] for term in TTFT_COST_TERMS}
    # the delay others suffer is the same work as the own prefill, weighted by the queue
    gains["prefill_s"] += gains.pop("delay_s")
    return {"wait_s": REASON_TTFT_WAIT, "prefill_s": REASON_TTFT_PREFILL,
            "evict_s": REASON_TTFT_EVICT, "decode_s": REASON_TTFT_DECODE}[
        max(gains, key=lambda t: gains[t])]


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What ``decide`` hands every policy beside the request, the candidates and the ring (its
    arguments of the same names)."""

    params: PolicyParams
    confirmed: Mapping[str, int]
    combined: Mapping[str, int]
    tiered: Mapping[str, int]
    rr_counter: int
    avg_prompt_tokens: float
    avg_output_tokens: float

    def hits(self, request: RouteInput, replicas: Sequence[Candidate], ring: HashRing) -> _Hits:
        return _hit_depths(request, replicas, ring, self.confirmed, self.combined, self.tiered,
                           self.params.block_size)


@dataclass(frozen=True, slots=True)
class Policy:
    """One routing policy: its name (the ``policy`` setting's value), its decision function and
    whether it reads the block index (hit depths, speculative placements: the router keeps them
    only for such a policy)."""

    name: str
    run: Callable[[RouteInput, Sequence[Candidate], HashRing, PolicyContext], Decision]
    uses_index: bool


# The one registry of policies (name -> implementation): the settings' allowed values and help,
# the router's dispatch in ``decide`` and the chart's schema test all read it.
POLICIES: Final[Mapping[str, Policy]] = MappingProxyType({p.name: p for p in (
    Policy("prefix", lambda request, replicas, ring, ctx: _prefix(
        request, replicas, ring, ctx.hits(request, replicas, ring), ctx.params,
        ctx.avg_prompt_tokens), uses_index=True),
    Policy("ttft", lambda request, replicas, ring, ctx: _ttft(
        request, replicas, ring, ctx.hits(request, replicas, ring), ctx.params,
        ctx.avg_prompt_tokens, ctx.avg_output_tokens), uses_index=True),
    Policy("round_robin", lambda request, replicas, ring, ctx: _round_robin(
        request, replicas, ctx.rr_counter), uses_index=False),
    Policy("least_loaded", lambda request, replicas, ring, ctx: _least_loaded(
        request, replicas, ctx.rr_counter), uses_index=False),
    Policy("consistent_hash", lambda request, replicas, ring, ctx: _consistent_hash(
        request, replicas, ring, ctx.params), uses_index=False),
)})
INDEX_POLICIES: Final = frozenset(name for name, p in POLICIES.items() if p.uses_index)
