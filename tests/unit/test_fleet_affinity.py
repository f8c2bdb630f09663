"""Which worker-reported replicas get prefix-hit credit (``Fleet.affinity_problem``)."""

from __future__ import annotations

import time

from router.decision.fleet import Fleet
from router.service.config import RouterConfig
from router.shared import contract as c
from router.shared.hashing import BlockHasher


def test_recomputed_keys_are_trusted_even_when_the_engine_hashes_differ() -> None:
    config = RouterConfig(redis_url="redis://127.0.0.1:1")
    fleet = Fleet(config, BlockHasher(config.block_size, config.hash_algo, config.hash_seed))
    now = time.time()
    base = {c.F_URL: "http://127.0.0.1:9", c.F_HASH_VERIFIED: "0", c.F_HEARTBEAT_TS: str(now),
            c.F_CONTRACT: str(c.CONTRACT_VERSION), c.F_INDEX_STRIDE: str(config.index_stride)}
    fleet.apply_heartbeat("engine-keys", {**base, c.F_KEY_MODE: "engine"}, now)
    fleet.apply_heartbeat("recomputed", {**base, c.F_KEY_MODE: c.KEY_MODE_RECOMPUTED}, now)
    assert "hash_verified=0" in (fleet.affinity_problem(fleet.replicas["engine-keys"]) or "")
    assert fleet.affinity_problem(fleet.replicas["recomputed"]) is None
