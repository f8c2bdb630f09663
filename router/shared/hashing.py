"""vLLM-exact prefix-cache block hashing. Pure: no I/O.

This module reproduces, bit for bit, how vLLM 0.33 names the blocks of its paged
KV cache (``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens`` and
``generate_block_hash_extra_keys``, ``vllm/utils/hashing.py``):

* a block hash is ``digest(serialise((parent_hash, tuple(block_tokens), extra_keys)))``;
* ``serialise`` is pickle protocol 5 (``sha256``, ``xxhash``) or canonical CBOR
  (``sha256_cbor``, ``xxhash_cbor``); ``digest`` is SHA-256 (32 bytes) or
  xxh3-128 (16 bytes, canonical big-endian);
* the parent of block 0 is ``NONE_HASH = digest(serialise(seed_string))`` where the
  seed string is ``PYTHONHASHSEED`` when set, else ``"vllm-none-hash"`` for the
  sha256 variants; the xxhash variants use a random seed without
  ``PYTHONHASHSEED``, which no router can reproduce, so we refuse that setting;
* only full blocks are hashed; extra keys are LoRA ``("lora", name, path)`` on every
  block, then multimodal ``("mm", identifier, offset - block_start)`` for every item
  overlapping the block, then ``("cache_salt", salt)`` on block 0 only; an empty
  list of extra keys becomes ``None``.

The 64-bit *block key* used everywhere else in the project (index, Redis, KV
events) is what vLLM's KV events carry by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the last 8 bytes of the digest read
as a big-endian unsigned int.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import cbor2
import xxhash

from router.shared.contract import BlockKey

DEFAULT_BLOCK_SIZE: Final = 16  # tokens; vLLM CacheConfig.DEFAULT_BLOCK_SIZE
DEFAULT_HASH_ALGO: Final = "sha256"  # vLLM CacheConfig.prefix_caching_hash_algo default
DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"  # vLLM kv_cache_utils.DEFAULT_NONE_HASH_SEED
HASH_ALGOS: Final = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
KEY_MASK: Final = (1 << 64) - 1

_PICKLE_PROTOCOL: Final = 5  # pickle.HIGHEST_PROTOCOL on CPython 3.8-3.14, as vLLM uses


class HashConfigError(ValueError):
    """The hashing settings cannot reproduce the engine's hashes (bad algo, seed or size)."""


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """One multimodal placeholder range in the prompt.

    ``identifier`` is vLLM's mm hash (or the user's ``multi_modal_uuids`` entry);
    ``offset`` and ``length`` are in tokens, ``[offset, offset + length)``.
    """

    identifier: str
    offset: int
    length: int


def block_key(digest: bytes) -> BlockKey:
    """The 64-bit key of a raw block digest: low 8 bytes, big-endian unsigned.

    Source: vLLM 0.33 ``maybe_convert_block_hash`` (``int.from_bytes(d, "big") & (2**64-1)``).
    """
    return BlockKey(int.from_bytes(digest[-8:], "big"))


def block_keys(digests: Sequence[bytes]) -> list[BlockKey]:
    """``block_key`` of each digest, as one pass in C when they share one length that is a
    multiple of 8 bytes (one hasher's digests: 32 for SHA-256, 16 for xxh3-128): their bytes
    joined, read as 64-bit words, and every digest's last word taken, byte-swapped to
    big-endian. Several times faster than ``int.from_bytes`` per digest (512 digests: about
    35 against 260 us); other inputs take that path."""
    if not digests:
        return []
    width = len(digests[0])
    if width < 8 or width % 8 or len(set(map(len, digests))) != 1:
        return [block_key(d) for d in digests]
    words = array("Q", b"".join(digests))
    if sys.byteorder == "little":
        words.byteswap()
    step = width // 8
    return cast(list[BlockKey], words[step - 1::step].tolist())


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """Most full blocks a prompt of ``num_tokens`` can hit: ``floor((N-1)/B)``, never negative.

    Source: vLLM 0.33 ``KVCacheManager.get_computed_blocks`` caps the hit at
    ``num_tokens - 1`` because the last prompt token must be recomputed for logits.
    """
    if num_tokens <= 1:
        return 0
    return (num_tokens - 1) // block_size


def resolve_seed(hash_algo: str, pythonhashseed: str | None) -> str:
    """The seed string vLLM hashes into NONE_HASH (``resolve_none_hash_seed``).

    Raises ``HashConfigError`` for the xxhash variants without a seed: the engine
    would pick ``os.urandom(32).hex()``, which nobody can reproduce.
    """
    if hash_algo not in HASH_ALGOS:
        raise HashConfigError(
            f"unknown hash algorithm {hash_algo!r}; expected one of {', '.join(HASH_ALGOS)}"
        )
    if pythonhashseed is not None:
        return pythonhashseed
    if hash_algo.startswith("xxhash"):
        raise HashConfigError(
            f"hash algorithm {hash_algo!r} needs PYTHONHASHSEED: without it vLLM seeds "
            "NONE_HASH with a random string; set the same PYTHONHASHSEED on engines and router"
        )
    return DEFAULT_NONE_HASH_SEED


def _serialiser(hash_algo: str) -> Callable[[Any], bytes]:
    if hash_algo.endswith("_cbor"):
        return lambda obj: cbor2.dumps(obj, canonical=True)
    return lambda obj: pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)


def _digester(hash_algo: str) -> Callable[[bytes], bytes]:
    if hash_algo.startswith("xxhash"):
        return xxhash.xxh3_128_digest
    return lambda data: hashlib.sha256(data).digest()


def _object_hasher(hash_algo: str) -> Callable[[Any], bytes]:
    """serialise-then-digest as one call: the chain loop runs it once per block."""
    if hash_algo == "sha256":  # vLLM's default, so the one worth a call level less
        dumps, sha256 = pickle.dumps, hashlib.sha256
        return lambda obj: sha256(dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()
    serialise, digest = _serialiser(hash_algo), _digester(hash_algo)
    return lambda obj: digest(serialise(obj))


def block_extra_keys(
    block_start: int,
    block_end: int,
    *,
    lora: tuple[str, str] | None = None,
    mm_items: Sequence[MultiModalItem] = (),
    cache_salt: str | None = None,
) -> tuple[Any, ...] | None:
    """Extra keys of the block ``[block_start, block_end)`` in vLLM's order, or ``None``.

    Source: vLLM 0.33 ``generate_block_hash_extra_keys``: LoRA keys, then mm keys
    (one per item overlapping the block, relative offset may be negative), then
    the cache_salt key on the block starting at token 0 only.
    """
    keys: list[Any] = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    for item in mm_items:
        if item.offset < block_end and item.offset + item.length > block_start:
            keys.append(("mm", item.identifier, item.offset - block_start))
    if cache_salt and block_start == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


class BlockHasher:
    """Computes vLLM's block-hash chain for one engine configuration.

    ``block_size`` in tokens (>= 1), ``hash_algo`` one of ``HASH_ALGOS``,
    ``seed`` the engines' ``PYTHONHASHSEED`` string or ``None`` when unset.
    Raises ``HashConfigError`` on settings that cannot match an engine.
    Instances are immutable and thread-safe.
    """

    __slots__ = ("_digest", "_hash_object", "_seed_fingerprint", "_serialise", "block_size",
                 "hash_algo", "none_hash", "seed")

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        hash_algo: str = DEFAULT_HASH_ALGO,
        seed: str | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise HashConfigError(f"block size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.seed = resolve_seed(hash_algo, seed)
        self._serialise = _serialiser(hash_algo)
        self._digest = _digester(hash_algo)
        self._hash_object = _object_hasher(hash_algo)
        self.none_hash: bytes = self._digest(self._serialise(self.seed))
        # compared with every candidate replica's on every routed request: formatted once
        self._seed_fingerprint = f"{block_key(self.none_hash):016x}"

    @property
    def seed_fingerprint(self) -> str:
        """Short public fingerprint of (algo, seed): hex of NONE_HASH's 64-bit key."""
        return self._seed_fingerprint

    def hash_block(
        self, parent: bytes | None, block_tokens: Sequence[int], extra_keys: tuple[Any, ...] | None
    ) -> bytes:
        """One block's raw digest; a falsy ``parent`` means NONE_HASH (vLLM ``hash_block_tokens``)."""
        return self._digest(
            self._serialise((parent or self.none_hash, tuple(block_tokens), extra_keys))
        )

    def digests(
        self,
        tokens: Sequence[int],
        *,
        lora: tuple[str, str] | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        parent: bytes | None = None,
        start_block: int = 0,
        max_blocks: int | None = None,
    ) -> list[bytes]:
        """Raw digests of the full blocks of ``tokens``, one per block, in order.

        ``lora`` is ``(lora_name, lora_path)``; ``cache_salt`` goes into block 0
        only; ``mm_items`` positions are absolute token offsets. To continue a
        chain, pass the previous block's digest as ``parent`` and the index of
        the first block to hash as ``start_block`` (``tokens`` is still the whole
        prompt). ``max_blocks`` stops after that many blocks. Trailing partial
        tokens are ignored (vLLM hashes only full blocks).
        """
        size = self.block_size
        end_block = len(tokens) // size
        if max_blocks is not None:
            end_block = min(end_block, start_block + max_blocks)
        out: list[bytes] = []
        if start_block >= end_block:
            return out
        hash_object = self._hash_object
        prev = parent or self.none_hash
        append = out.append
        index = start_block
        if lora is not None or mm_items or (cache_salt and start_block == 0):
            # blocks with extra keys: the first (cache_salt), or all of them (LoRA, mm items)
            last_extra = end_block if lora is not None or mm_items else start_block + 1
            for index in range(start_block, last_extra):
                start = index * size
                extra = block_extra_keys(
                    start, start + size, lora=lora, mm_items=mm_items, cache_salt=cache_salt
                )
                prev = hash_object((prev, tuple(tokens[start : start + size]), extra))
                append(prev)
            index = last_extra
        # no extra keys: zip over one iterator cuts the blocks into tuples in C (a slice and a
        # tuple() per block are a fair share of a block's cost; loadtest.bench.hashing and
        # docs/benchmarks.md)
        rest = iter(tokens[index * size : end_block * size])
        if self.hash_algo == "sha256":
            # vLLM's default, written out: a Python call less per block, and the protocol passed
            # by position, take about 9% off the chain (docs/benchmarks.md, "Router CPU per
            # request, by phase")
            dumps, sha256 = pickle.dumps, hashlib.sha256
            for block in zip(*(rest,) * size, strict=True):  # the slice holds whole blocks
                prev = sha256(dumps((prev, block, None), _PICKLE_PROTOCOL)).digest()
                append(prev)
            return out
        for block in zip(*(rest,) * size, strict=True):
            prev = hash_object((prev, block, None))
            append(prev)
        return out

    def keys(self, tokens: Sequence[int], **kwargs: Any) -> list[BlockKey]:
        """64-bit block keys (what KV events carry) of the full blocks; same arguments as ``digests``."""
        return block_keys(self.digests(tokens, **kwargs))
