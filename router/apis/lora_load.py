"""LoRA affinity by what is loaded: which replicas a LoRA request should prefer. Pure.

vLLM exports ``vllm:lora_requests_info`` when LoRA is on (vLLM 0.32
``v1/metrics/loggers.py``): a gauge with the labels ``running_lora_adapters`` and
``waiting_lora_adapters`` (adapter names of the requests running and waiting now,
comma-separated) and ``max_lora`` (``--max-loras``: adapters one batch can use, default 1),
set to the current time at every stats update. The worker reads its current series with the rest
of the engine's load (``router.shared.lora_state``, ``worker.heartbeat``) and reports it in the
heartbeat; the router ranks the replicas serving an adapter:

1. ``running`` / ``waiting``: the adapter is in use there now (its weights are loaded, or being
   loaded for a waiting request): no adapter load, no slot taken from another adapter;
2. ``free_slot``: fewer adapters in use than ``max_lora``: the adapter can join the batch;
   ``unknown`` (the replica reports no LoRA state: an older worker, a static replica) ranks
   here too, as it may well have a slot;
3. ``full``: ``max_lora`` adapters in use, none of them this one: the request waits for a slot
   (vLLM's scheduler keeps it waiting until one frees).

A LoRA request is routed among the best rank present (the policy then picks by prefix hit and
load within it, bounded load included); the ranks are in ``/debug/route``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from router.shared.lora_state import LoraLoad

RUNNING: Final = "running"
WAITING: Final = "waiting"
FREE_SLOT: Final = "free_slot"
UNKNOWN: Final = "unknown"
FULL: Final = "full"
# {tier: preference rank, lower is better}
TIER_RANK: Final = {RUNNING: 0, WAITING: 0, FREE_SLOT: 1, UNKNOWN: 1, FULL: 2}


def lora_tier(load: LoraLoad | None, adapter: str) -> str:
    """Where ``adapter`` stands on a replica with LoRA state ``load`` (``None``: not reported):
    ``RUNNING``, ``WAITING``, ``FREE_SLOT``, ``UNKNOWN`` or ``FULL`` (module docstring)."""
    if load is None:
        return UNKNOWN
    if adapter in load.running:
        return RUNNING
    if adapter in load.waiting:
        return WAITING
    if load.max_lora is None:
        return UNKNOWN
    return FREE_SLOT if load.num_in_use < load.max_lora else FULL


@dataclass(frozen=True, slots=True)
class LoraPreference:
    """The replicas a request for ``adapter`` is routed among (``preferred``, the best rank
    present, in the input order) and every candidate's tier ``{replica_id: tier}``."""

    adapter: str
    preferred: tuple[str, ...]
    tiers: Mapping[str, str]

    @property
    def tier(self) -> str:
        """The best tier present (what ``/debug/route`` reports as the reason)."""
        return min((self.tiers[rid] for rid in self.preferred), key=TIER_RANK.__getitem__)


def prefer_loaded(adapter: str, loads: Mapping[str, LoraLoad | None]) -> LoraPreference:
    """Rank the replicas ``loads`` (``{replica_id: LoraLoad or None}``, in candidate order) for
    a request of ``adapter``: the preferred ones are those of the best rank present. Raises
    ``ValueError`` when ``loads`` is empty."""
    if not loads:
        raise ValueError("no replica to rank")
    tiers = {rid: lora_tier(load, adapter) for rid, load in loads.items()}
    best = min(TIER_RANK[t] for t in tiers.values())
    preferred = tuple(rid for rid, t in tiers.items() if TIER_RANK[t] == best)
    return LoraPreference(adapter, preferred, tiers)
