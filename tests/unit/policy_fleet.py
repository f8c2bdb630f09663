"""The fleet the policy tests decide among: four replica ids, their hash ring (64 vnodes) and a
cold 64-block prompt chain (1,024 tokens at block size 16). Pure."""

from __future__ import annotations

from router.decision.ring import HashRing

IDS = ("replica-0", "replica-1", "replica-2", "replica-3")
RING = HashRing(IDS, vnodes=64)
CHAIN = list(range(1000, 1064))  # 64 blocks = 1024 tokens at block size 16


def home_of(key: int) -> str:
    """The replica ``RING`` places ``key`` on."""
    return RING.order(key)[0]
