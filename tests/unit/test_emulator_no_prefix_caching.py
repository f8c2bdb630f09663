"""The emulator's ``--no-enable-prefix-caching`` (vLLM semantics): no hits, nothing cached, no KV
events, no prefix-cache queries counted; ``--enable-prefix-caching`` is the default."""

from __future__ import annotations

from tests.unit.test_emulator_kv_cache import admit, make_request
from worker.emulator.config import from_args
from worker.emulator.kv_cache import BlockPool, KVCacheManager


def test_caching_off_never_hits_and_emits_nothing() -> None:
    pool = BlockPool(200)
    kv = KVCacheManager(pool, 16, enable_caching=False)
    for rid in ("a", "b"):
        req = make_request(list(range(1000, 1100)), rid)
        assert admit(kv, req) == 0
        kv.record_lookup(req.num_tokens, 0, preempted=False)
        kv.free(req)
    assert pool.take_events() == [] and pool.num_cached_hashes == 0
    assert (kv.stats.queries, kv.stats.hits) == (0, 0)
    # the same requests with caching on: the repeat hits and blocks are stored
    pool_on = BlockPool(200)
    kv_on = KVCacheManager(pool_on, 16)
    hits = []
    for rid in ("a", "b"):
        req = make_request(list(range(1000, 1100)), rid)
        hits.append(admit(kv_on, req))
        kv_on.free(req)
    assert hits == [0, 96] and pool_on.take_events()


def test_flags() -> None:
    assert from_args([], env={}).enable_prefix_caching is True
    assert from_args(["--enable-prefix-caching"], env={}).enable_prefix_caching is True
    assert from_args(["--no-enable-prefix-caching"], env={}).enable_prefix_caching is False
