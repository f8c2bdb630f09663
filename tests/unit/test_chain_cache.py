"""Chain cache: cached and incremental chains are bit-exact with ``BlockHasher.keys``."""

from __future__ import annotations

import random

import pytest

from router.request.chain_cache import SPAN_BLOCKS, ChainCache
from router.shared.hashing import BlockHasher


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash"])
def test_id_chains_equal_block_hasher_keys(algo: str) -> None:
    hasher = BlockHasher(16, algo, "0" if algo.startswith("xxhash") else None)
    cache = ChainCache(hasher, capacity=10_000)
    rng = random.Random(3)
    shared = [rng.randrange(150_000) for _ in range(3000)]
    for trial in range(40):
        cut = rng.randrange(0, len(shared))
        tokens = shared[:cut] + [rng.randrange(150_000) for _ in range(rng.randrange(0, 700))]
        lora = ("ad", "/p") if trial % 3 == 0 else None
        salt = "s" if trial % 4 == 0 else None
        got = cache.chain_of_ids(tokens, lora, salt)
        assert got.keys == hasher.keys(tokens, lora=lora, cache_salt=salt), trial
        assert got.num_tokens == len(tokens)
        assert got.head == tuple(tokens[:16])
        again = cache.chain_of_ids(tokens, lora, salt)
        assert again.keys == got.keys and again.computed_pieces == 0
    assert cache.hits > 0


def test_shared_prefix_reuses_pieces_and_lru_is_bounded() -> None:
    hasher = BlockHasher(16)
    cache = ChainCache(hasher, capacity=50)
    span = SPAN_BLOCKS * 16
    base = list(range(10 * span))
    first = cache.chain_of_ids(base)
    assert first.computed_pieces == 10 and first.cached_pieces == 0
    longer = cache.chain_of_ids(base + [7] * 100)
    assert longer.cached_pieces == 10 and longer.computed_pieces == 1
    assert longer.keys[: len(first.keys)] == first.keys
    uncached, path, _ = cache.uncached_id_blocks(base + [8] * 100)
    assert len(path) == 10 and uncached == 100 // 16
    for i in range(100):
        cache.chain_of_ids([i] * 40)
    assert len(cache) == 50
    huge = [2**70, 1, 2] * 10  # beyond 64 bits: spans keyed by their tuple
    assert cache.chain_of_ids(huge).keys == hasher.keys(huge)


def test_suffix_and_prefix_tokens_continue_the_chain() -> None:
    hasher = BlockHasher(4)
    cache = ChainCache(hasher)
    root = cache.root(None, "salt", prefix_tokens=[1, 2])
    pieces = [(3, 4, 5), (6, 7, 8, 9, 10)]
    chain = cache.chain(root, pieces, lambda idx: [pieces[i] for i in idx], None, "salt",
                        suffix_tokens=[11, 12, 13])
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert chain.keys == hasher.keys(tokens, cache_salt="salt")
    assert chain.num_tokens == 13 and chain.head == (1, 2, 3, 4)


def test_lazy_chain_stops_after_the_first_unheld_piece_and_finishes_later() -> None:
    hasher = BlockHasher(16)
    cache = ChainCache(hasher)
    rng = random.Random(8)
    span = SPAN_BLOCKS * 16
    tokens = [rng.randrange(150_000) for _ in range(10 * span + 50)]
    full = hasher.keys(tokens)
    held = set(full[: 3 * SPAN_BLOCKS + 5])  # replicas hold 3 pieces and a bit of the 4th
    pieces = cache.id_pieces(tokens)
    root = cache.root(None, None)
    lazy = cache.chain(root, pieces, cache.id_spans(tokens), None, None,
                       held=held.__contains__, num_tokens=len(tokens))
    assert lazy is not None and not lazy.complete and lazy.num_tokens == len(tokens)
    assert lazy.keys == full[: 4 * SPAN_BLOCKS]  # up to and including the first un-held block
    assert lazy.head == tuple(tokens[:16])
    rest = cache.chain_of_ids(tokens)
    assert rest.complete and rest.keys == full and rest.cached_pieces == 4
    # everything held: the lazy walk computes the whole chain
    other = [rng.randrange(150_000) for _ in range(3 * span)]
    whole = cache.chain(root, cache.id_pieces(other), cache.id_spans(other), None, None,
                        held=lambda key: True, num_tokens=len(other))
    assert whole is not None and whole.complete and whole.keys == hasher.keys(other)


def test_lazy_chain_gives_up_after_max_pieces_and_resumes_from_them() -> None:
    """A long held prefix that is not in the cache is not hashed on the event loop: the lazy
    walk gives up after ``max_pieces`` (keeping them), and the next walk starts after them."""
    hasher = BlockHasher(16)
    cache = ChainCache(hasher)
    rng = random.Random(9)
    tokens = [rng.randrange(150_000) for _ in range(6 * SPAN_BLOCKS * 16 + 7)]
    full = hasher.keys(tokens)
    held = set(full[: 5 * SPAN_BLOCKS])
    root = cache.root(None, None)
    pieces = cache.id_pieces(tokens)
    assert cache.chain(root, pieces, cache.id_spans(tokens), None, None, held=held.__contains__,
                       num_tokens=len(tokens), max_pieces=2) is None
    assert len(cache.walk(root, pieces)) == 2
    lazy = cache.chain(root, pieces, cache.id_spans(tokens), None, None, held=held.__contains__,
                       num_tokens=len(tokens), max_pieces=4)
    assert lazy is not None and lazy.cached_pieces == 2
    assert not lazy.complete and lazy.keys == full[: 6 * SPAN_BLOCKS]
