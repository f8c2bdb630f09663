"""The Mooncake trace format: one request per line, and its hash-id -> token-id mapping. Pure.

The Mooncake FAST'25 traces (``kvcache-ai/Mooncake``, ``FAST25-release/traces``)
are JSON Lines, one request per line, sorted by arrival::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

``timestamp`` is milliseconds from the start of the trace (in coarse steps of
about 3 s), ``hash_ids`` holds one id per 512-token block of the prompt, and an
id names the whole prefix up to the end of its block (same id at position i =
same tokens from 0 to the end of block i). The last block is partial and holds
``input_length - 512 * (len(hash_ids) - 1)`` tokens.

Replaying the trace against a real engine needs token ids. ``TokenMapper``
turns every hash id into a fixed block of ``TRACE_BLOCK_TOKENS`` token ids drawn
from a PRNG (SHAKE-128) keyed by ``(seed, hash_id)``, so the same id always gives the
same tokens in every process and on every machine, two prompts that share
leading hash ids share exactly those leading tokens, and two different ids
share no block. Ids are drawn from ``[vocab_low, vocab_high)`` so no special
token of a real tokenizer (Qwen3's start at 151643) can appear.

Here, not in ``loadtest``, because the product reads it too: ``prefix-router audit`` takes trace
files and maps them as the replay does (``loadtest.replay.trace`` reads and schedules them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from cachetools import LRUCache

TRACE_BLOCK_TOKENS = 512  # tokens per hash id; Mooncake trace format
DEFAULT_TOKEN_SEED = 0  # global seed of the hash-id -> tokens mapping
DEFAULT_VOCAB_LOW = 1000  # token ids; below it sit the control tokens of most vocabularies
DEFAULT_VOCAB_HIGH = 100_000  # token ids, exclusive; Qwen3 special tokens start at 151643
BLOCK_CACHE_SIZE = 8192  # hash-id blocks kept in memory (8192 * 512 ints, about 150 MB)


class TraceFormatError(ValueError):
    """A trace line is not a valid Mooncake request."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a Mooncake trace.

    ``index`` is the 0-based line number in the file, ``timestamp_ms`` the
    arrival time in ms from the trace start, ``input_length``/``output_length``
    token counts, ``hash_ids`` one id per 512-token prompt block.
    """

    index: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def last_block_tokens(self) -> int:
        """Tokens in the last (partial) block: ``input_length - 512 * (len(hash_ids) - 1)``."""
        return self.input_length - TRACE_BLOCK_TOKENS * (len(self.hash_ids) - 1)


def parse_trace_line(line: str, index: int) -> TraceRequest:
    """Parse one JSONL line. Raises ``TraceFormatError`` when fields are missing or inconsistent
    (``len(hash_ids)`` must equal ``ceil(input_length / 512)``)."""
    try:
        obj = json.loads(line)
        hash_ids = tuple(int(h) for h in obj["hash_ids"])
        req = TraceRequest(
            index=index,
            timestamp_ms=int(obj["timestamp"]),
            input_length=int(obj["input_length"]),
            output_length=int(obj["output_length"]),
            hash_ids=hash_ids,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceFormatError(f"trace line {index}: {exc}") from exc
    if req.input_length <= 0 or not hash_ids:
        raise TraceFormatError(f"trace line {index}: empty prompt")
    if not 1 <= req.last_block_tokens <= TRACE_BLOCK_TOKENS:
        raise TraceFormatError(
            f"trace line {index}: {len(hash_ids)} hash ids do not fit input_length {req.input_length}")
    return req


class TokenMapper:
    """Deterministic hash id -> block of ``TRACE_BLOCK_TOKENS`` token ids.

    The generator is SHAKE-128 (an extendable-output function, used as a PRNG) over the key
    ``b"{seed}:{h}"``: its 2048-byte output read as 512 little-endian uint32 ``x`` gives the tokens
    ``vocab_low + x % (vocab_high - vocab_low)``. The mapping therefore never changes across
    processes, platforms or library versions (the modulo bias is below 1e-4 and harmless here).
    Raises ``ValueError`` for a negative hash id or an empty vocabulary range.
    """

    def __init__(self, seed: int = DEFAULT_TOKEN_SEED, vocab_low: int = DEFAULT_VOCAB_LOW,
                 vocab_high: int = DEFAULT_VOCAB_HIGH) -> None:
        if not 0 <= vocab_low < vocab_high:
            raise ValueError(f"bad vocabulary range [{vocab_low}, {vocab_high})")
        if seed < 0:
            raise ValueError("seed must not be negative")
        self.seed = seed
        self.vocab_low = vocab_low
        self.vocab_high = vocab_high
        # A cache that holds no reference back to the mapper, so the mapper and its millions of
        # int objects are freed as soon as the replay drops it. The cache used to be a
        # bound-method lru_cache: a reference cycle, freed only by a full garbage collection. In
        # `prefix-loadtest demo` that collection came about every sixth run, mid-replay, and freed
        # six runs' caches at once: the replayer stood still for 0.4 s and the run was untrusted.
        # Not cachetools.cachedmethod either: its per-instance wrapper (cachetools 8) holds the
        # instance too, the same cycle (the garbage test in tests/unit/test_trace.py fails).
        self._blocks: LRUCache[int, tuple[int, ...]] = LRUCache(BLOCK_CACHE_SIZE)

    def _make_block(self, hash_id: int) -> tuple[int, ...]:
        if hash_id < 0:
            raise ValueError(f"negative hash id {hash_id}")
        stream = hashlib.shake_128(f"{self.seed}:{hash_id}".encode()).digest(4 * TRACE_BLOCK_TOKENS)
        words = np.frombuffer(stream, dtype="<u4").astype(np.int64)
        return tuple((self.vocab_low + words % (self.vocab_high - self.vocab_low)).tolist())

    def block(self, hash_id: int) -> tuple[int, ...]:
        """The 512 token ids of ``hash_id``."""
        block = self._blocks.get(hash_id)
        if block is None:
            block = self._blocks[hash_id] = self._make_block(hash_id)
        return block

    def prompt(self, hash_ids: Sequence[int], input_length: int) -> list[int]:
        """Concatenated blocks of ``hash_ids``, the last one cut to its first
        ``input_length - 512 * (len(hash_ids) - 1)`` tokens. Raises ``ValueError`` if that is not in
        ``[1, 512]``."""
        last = input_length - TRACE_BLOCK_TOKENS * (len(hash_ids) - 1)
        if not hash_ids or not 1 <= last <= TRACE_BLOCK_TOKENS:
            raise ValueError(f"{len(hash_ids)} hash ids do not fit input_length {input_length}")
        tokens: list[int] = []
        for hash_id in hash_ids[:-1]:
            tokens.extend(self.block(hash_id))
        tokens.extend(self.block(hash_ids[-1])[:last])
        return tokens

    def request_prompt(self, req: TraceRequest) -> list[int]:
        """Token ids of a trace request's prompt (``len == req.input_length``)."""
        return self.prompt(req.hash_ids, req.input_length)
