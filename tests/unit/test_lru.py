"""The prompt caches' LRU: bounded by entries and by bytes, so multi-MB prompts cannot pile up."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from router.request.chain_cache import ChainCache
from router.request.lru import SizedLRU
from router.request.prompts import PromptSpec, PromptTokenizer, default_tokenizer_dir
from router.shared.hashing import BlockHasher


def test_entries_and_bytes_are_both_bounds_and_the_least_recent_goes_first() -> None:
    cache: SizedLRU[str] = SizedLRU(4, 1000, lambda key, value: len(value))
    for i in range(4):
        cache.put(i, "x" * 10)  # charged the floor: 1000 / 4 = 250 bytes each
    assert len(cache) == 4 and cache.num_bytes == 1000
    assert cache.get(0) == "x" * 10  # 0 is now the most recent
    cache.put(4, "y" * 10)
    assert cache.get(1) is None and cache.get(0) is not None and len(cache) == 4
    cache.put(5, "z" * 600)  # 600 bytes: three 250-byte entries must go
    assert cache.num_bytes <= 1000 and cache.get(5) == "z" * 600
    assert cache.get(2) is None and cache.get(3) is None and cache.get(4) is None
    cache.put(6, "w" * 1001)  # larger than the whole budget: not kept
    assert cache.get(6) is None and cache.get(5) is not None
    assert (cache.hits, cache.misses) == (4, 5)


def test_zero_disables_and_negative_bounds_raise() -> None:
    off: SizedLRU[str] = SizedLRU(0, 1 << 20, lambda k, v: 1)
    off.put("a", "b")
    assert off.get("a") is None and len(off) == 0 and off.num_bytes == 0
    with pytest.raises(ValueError):
        SizedLRU(-1, 10, lambda k, v: 1)


def test_chain_cache_of_long_text_pieces_stays_within_its_bytes() -> None:
    hasher = BlockHasher(16)
    cache = ChainCache(hasher, capacity=65536, max_bytes=1 << 20)
    rng = random.Random(1)
    root = cache.root(None, None)
    for _doc in range(20):  # 20 documents of 100 pieces of 1,000 characters
        pieces = ["".join(rng.choice("abcdefgh ") for _ in range(1000)) for _ in range(100)]
        chain = cache.chain(root, pieces, lambda idx: [[rng.randrange(1000)] * 250 for _ in idx],
                            None, None)
        assert chain is not None
    assert cache.num_bytes <= 1 << 20
    assert len(cache) < 20 * 100  # the byte bound, not the count, decided


def test_node_estimate_is_within_a_factor_of_two_of_traced_memory() -> None:
    hasher = BlockHasher(16)
    cache = ChainCache(hasher, capacity=10_000_000, max_bytes=1 << 30)  # floor 107 B
    rng = random.Random(2)
    root = cache.root(None, None)
    pieces = [" ".join(str(rng.randrange(10**6)) for _ in range(120)) for _ in range(2000)]
    tokens = [[rng.randrange(150_000) for _ in range(250)] for _ in range(2000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        chain = cache.chain(root, pieces, lambda idx: [tokens[i] for i in idx], None, None)
        assert chain is not None
        del chain
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # the pieces themselves were allocated before tracing: add their size to what was traced
    actual = traced + sum(len(p) + 49 for p in pieces)
    assert 0.5 <= cache.num_bytes / actual <= 2.0, (cache.num_bytes, actual)


TOKENIZER = default_tokenizer_dir()


@pytest.mark.skipif(TOKENIZER is None, reason="the bundled Qwen3 tokenizer is not installed")
def test_rendered_chats_are_bounded_by_bytes_and_keyed_by_a_digest() -> None:
    tok = PromptTokenizer(str(TOKENIZER), cache_chunks=64, render_cache_bytes=3 << 20)
    texts = []
    for i in range(4):  # four conversations of 1 MB each; the budget holds at most two
        spec = PromptSpec(kind="chat", model=None, messages=[{"role": "user", "content": f"{i} " + "word " * 250_000}])
        texts.append(tok.rendered_chat(spec))
    assert tok.rendered.num_bytes <= 3 << 20 and len(tok.rendered) == 2
    again = PromptSpec(kind="chat", model=None, messages=[{"role": "user", "content": "3 " + "word " * 250_000}])
    assert tok.rendered_chat(again, cached_only=True) == texts[3]
