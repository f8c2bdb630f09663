"""Hash agreement probe: does the engine name blocks the way the routers do? Pure, except ``run_probe``.

The worker sends the engine a completion of random token ids (two full blocks
plus one token, ``max_tokens`` 1), catches the ``BlockStored`` events of those
blocks in the KV event stream, and compares their hashes with
``router.shared.hashing.BlockHasher`` under the engine's declared block size and hash
algorithm and the routers' configured seed (vLLM 0.33 ``hash_block_tokens``;
the engine seeds NONE_HASH from ``PYTHONHASHSEED``). On a mismatch it names the
likely cause by re-hashing under the alternatives.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Final

from router.shared.contract import TIER_GPU
from router.shared.hashing import HASH_ALGOS, BlockHasher, HashConfigError
from router.shared.kv_events import (
    BlockStored,
    KVEventDecodeError,
    event_hash_key,
    stored_token_ids,
)

PROBE_FULL_BLOCKS: Final = 2
PROBE_TOKEN_LOW: Final = 1_000  # token ids drawn from [LOW, HIGH): inside any real vocabulary
PROBE_TOKEN_HIGH: Final = 30_000
PROBE_TIMEOUT_S: Final = 15.0
COMMON_SEEDS: Final = ("0", "42")  # PYTHONHASHSEED values tried when diagnosing a mismatch


def probe_tokens(block_size: int, rng: random.Random | None = None) -> list[int]:
    """Random prompt of ``2 * block_size + 1`` token ids."""
    rng = rng or random.Random()
    return [rng.randrange(PROBE_TOKEN_LOW, PROBE_TOKEN_HIGH)
            for _ in range(PROBE_FULL_BLOCKS * block_size + 1)]


class ProbeCatcher:
    """Collects the engine's keys of the probe prompt's full blocks from ``BlockStored`` events.

    Matches events by content: a run of blocks whose ``token_ids`` equal the
    probe's tokens at that position and whose parent is the previous probe block
    (or None at block 0). ``done`` is set once every full block is seen.
    """

    def __init__(self, tokens: list[int], block_size: int) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.num_blocks = len(tokens) // block_size
        self.engine_keys: list[int | None] = [None] * self.num_blocks
        self.event_block_size: int | None = None
        self.done = asyncio.Event()

    def observe(self, event: BlockStored) -> None:
        """Look at one ``BlockStored``; ignores events of other prompts, and any store but the
        GPU's own of KV-cache group 0: an offload tier's store (vLLM's offloading connector)
        carries no tokens to match, so it would match any prompt at block 0, and its block
        size may be a multiple of the GPU's; another group's blocks are not the routers'."""
        size = event.block_size
        if (size <= 0 or not event.block_hashes or event.group_idx
                or (event.medium or TIER_GPU) != TIER_GPU):
            return
        try:
            token_ids = stored_token_ids(event)
        except KVEventDecodeError:
            return  # not the probe's (the view counts the bad event if it needs the tokens)
        if not token_ids:
            return
        if event.parent_block_hash is None:
            start = 0
        else:
            parent = event_hash_key(event.parent_block_hash)
            if parent not in self.engine_keys:
                return
            start = self.engine_keys.index(parent) + 1
        if token_ids != self.tokens[start * size : start * size + len(token_ids)]:
            return
        if size != self.block_size:  # the engine's blocks are not the declared size
            self.event_block_size = size
            self.done.set()
            return
        for i, block_hash in enumerate(event.block_hashes):
            if start + i < self.num_blocks:
                self.engine_keys[start + i] = event_hash_key(block_hash)
        self.event_block_size = size
        if all(k is not None for k in self.engine_keys):
            self.done.set()


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """``verified``: the engine's keys equal ours; ``cause``: why not (empty when verified)."""

    verified: bool
    cause: str
    engine_keys: tuple[int | None, ...]
    expected_keys: tuple[int, ...]


def judge(catcher: ProbeCatcher, hasher: BlockHasher) -> ProbeVerdict:
    """Compare the caught keys with ``hasher``'s; diagnose a mismatch."""
    expected = tuple(hasher.keys(catcher.tokens))
    engine = tuple(catcher.engine_keys)
    if catcher.event_block_size is not None and catcher.event_block_size != hasher.block_size:
        return ProbeVerdict(False, f"block size: engine events use {catcher.event_block_size}-token "
                            f"blocks, routers hash {hasher.block_size}", engine, expected)
    if engine == expected:
        return ProbeVerdict(True, "", engine, expected)
    return ProbeVerdict(False, diagnose(catcher.tokens, list(engine), hasher), engine, expected)


def diagnose(tokens: list[int], engine_keys: list[int | None], hasher: BlockHasher) -> str:
    """Name the likely cause of a key mismatch by trying the usual alternatives."""
    configured_seed = hasher.seed
    for algo in HASH_ALGOS:
        for seed in (configured_seed, None, *COMMON_SEEDS):
            if algo == hasher.hash_algo and seed == configured_seed:
                continue
            try:
                alt = BlockHasher(hasher.block_size, algo, seed)
            except HashConfigError:
                continue
            if alt.keys(tokens) == engine_keys:
                if algo != hasher.hash_algo:
                    return (f"hash algorithm: the engine hashes with {algo} (seed {seed!r}), "
                            f"routers use {hasher.hash_algo}")
                return (f"PYTHONHASHSEED: the engine's seed is {seed!r} "
                        f"({'unset' if seed is None else 'set'}), routers use {configured_seed!r}; "
                        "set the same PYTHONHASHSEED on engines and --hash-seed on routers/workers")
    return ("PYTHONHASHSEED (most likely: the engine's seed differs from --hash-seed), hash "
            "algorithm or block size differ between engine and routers")
