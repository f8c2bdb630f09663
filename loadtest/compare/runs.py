"""Which runs a comparison makes: prefix-router's own policies, the peer routers' (``PEER_SPECS``,
when installed) and the fleet settings a peer needs. Pure but for asking whether a peer is
installed."""

from __future__ import annotations

from dataclasses import replace

from loadtest.harness.fleet import (
    OURS,
    SGLANG,
    SMG,
    VLLM_ROUTER,
    FleetConfig,
    RouterSpec,
    peer_available,
)
from router.decision.policy import POLICIES

# the router's own registry, in its order (the default, prefix, first): a new policy is compared too
OWN_POLICIES = tuple(POLICIES)
PEER_SPECS = (RouterSpec(SMG, "cache_aware"), RouterSpec(SMG, "prefix_hash"),
              RouterSpec(VLLM_ROUTER, "cache_aware"), RouterSpec(VLLM_ROUTER, "kv_aware"))
PEER_KINDS = (SMG, VLLM_ROUTER, SGLANG)
# Peers whose OpenAI endpoints take only text prompts (a token-id array is a 400 for them).
TEXT_ONLY_PEERS = (SGLANG, SMG)

# vllm-router's kv_aware documents this as its tested setup (PEERS.md); the fleet for that peer
# runs with it so its hashes can match the engine's events.
KV_AWARE_HASH_ALGO = "sha256_cbor"
KV_AWARE_PYTHONHASHSEED = "0"


def resolve_runs(policies: str, peers: str) -> tuple[tuple[RouterSpec, ...], dict[str, str]]:
    """Runs from a comma-separated policy list (own policy names, or ``smg:POLICY`` /
    ``vllm-router:POLICY`` / ``sglang:POLICY``) and the peers mode (``auto``: add the peer runs
    of ``PEER_SPECS`` when installed,
    ``yes``: add them and fail if missing, ``no``). Returns (runs, skipped label -> reason).
    Raises ``ValueError`` for an unknown name or a named peer that is not installed."""
    runs: list[RouterSpec] = []
    for name in (p.strip() for p in policies.split(",") if p.strip()):
        if ":" in name:
            kind, policy = name.split(":", 1)
            if kind not in PEER_KINDS:
                raise ValueError(f"unknown router {kind!r} in {name!r}")
            if not peer_available(kind):
                raise ValueError(f"{kind} is not installed, so {name} cannot run "
                                 "(pip install 'prefix-router[peers]')")
            runs.append(RouterSpec(kind, policy))
        elif name in OWN_POLICIES:
            runs.append(RouterSpec(OURS, name))
        else:
            raise ValueError(f"unknown policy {name!r}; own policies: {', '.join(OWN_POLICIES)}")
    skipped: dict[str, str] = {}
    if peers not in ("auto", "yes", "no"):
        raise ValueError("--peers must be auto, yes or no")
    if peers != "no":
        for spec in PEER_SPECS:
            if spec in runs:
                continue
            if peer_available(spec.kind):
                runs.append(spec)
            elif peers == "yes":
                raise ValueError(f"{spec.kind} is not installed (pip install 'prefix-router[peers]')")
            else:
                skipped[spec.label] = "not installed (pip install 'prefix-router[peers]')"
    return tuple(runs), skipped


def fleet_for(spec: RouterSpec, fleet: FleetConfig) -> FleetConfig:
    """``fleet`` with ``spec`` as its router, and the settings that router needs: vllm-router's
    kv_aware its tested hashing (``KV_AWARE_HASH_ALGO``, ``KV_AWARE_PYTHONHASHSEED``, byte-form
    event hashes)."""
    fleet = replace(fleet, router=spec)
    if spec.kind == VLLM_ROUTER and spec.policy == "kv_aware":
        fleet = replace(fleet, hash_algo=KV_AWARE_HASH_ALGO,
                        python_hash_seed=KV_AWARE_PYTHONHASHSEED, int_block_hashes=False)
    return fleet
