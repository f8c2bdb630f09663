"""Cache of prompt block-key chains by prompt pieces, so shared prefixes cost almost nothing. Pure.

A prompt is cut into *pieces* that are deterministic from the start of the
prompt: pre-tokenizer-safe text chunks (``router.request.prompts.text_chunks``) for
text, spans of ``SPAN_BLOCKS`` full blocks for token ids (keyed by their
xxh3-128 digest). The cache is a trie
flattened into one LRU dict ``{(parent node id, piece): ChainNode}``; a node is
the hashing state after its piece: the block keys the piece completed, the
last full block's digest and the tokens after it (fewer than ``block_size``).
Walking a prompt's pieces from its root therefore yields the block-key chain
without tokenizing or hashing any piece seen before after the same prefix; the
first piece not in the cache and every piece after it are computed with
``BlockHasher`` from the parent's state and stored.

Results are bit-exact with ``BlockHasher.keys(all_tokens, lora=..., cache_salt=...)``
(vLLM 0.33 ``hash_block_tokens``: the chain only depends on the parent digest,
the block's tokens and its extra keys; the LoRA key is on every block and
``cache_salt`` on block 0, so both are part of the root). Multimodal items are
not supported here (the router never sees them). Thread-safe: one lock guards
the dict; hashing runs outside it.

Tenants: since the root is per ``cache_salt`` (the tenant's, with API keys on) and every node
is keyed under its parent's id, the trie is partitioned by salt: a prefix one tenant cached is
walked from another root by another tenant, and misses (issue 29: no timing side channel).
"""

from __future__ import annotations

import itertools
import threading
from array import array
from collections.abc import Callable, Generator, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import xxhash

from router.request.lru import SizedLRU
from router.shared.contract import BlockKey, is_anchor
from router.shared.hashing import BlockHasher, block_keys

SPAN_BLOCKS: Final = 16  # full blocks per token-id piece (256 tokens at block size 16)
DEFAULT_CAPACITY: Final = 65536  # cached pieces (nodes)
DEFAULT_MAX_BYTES: Final = 96 << 20  # nodes' measured size at the default capacity (benchmarks.md)
# a token-id prompt with at most this many new blocks is hashed whole, never lazily (hashing them
# is cheaper than the thread hop its rest would take; docs/benchmarks.md)
LAZY_MIN_UNCACHED_BLOCKS: Final = 64


@dataclass(frozen=True, slots=True)
class ChainNode:
    """Hashing state after a prompt prefix that ends at a piece boundary.

    ``keys`` are the 64-bit block keys of the blocks completed by the last piece;
    ``digest`` is the raw digest of the last full block of the whole prefix
    (``None`` before the first full block); ``tail`` the prefix's tokens after
    that block (``len(tail) < block_size``); ``head`` the prefix's first
    ``block_size`` tokens (ring key for prompts shorter than one block).
    """

    node_id: int
    num_tokens: int  # tokens in the whole prefix
    keys: tuple[BlockKey, ...]
    digest: bytes | None
    tail: tuple[int, ...]
    head: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PromptChain:
    """A prompt's length and block-key chain: what routing needs of its tokens."""

    num_tokens: int
    keys: list[BlockKey]  # 64-bit block keys of the full blocks, block 0 first
    head: tuple[int, ...]  # the first block_size tokens (all of them if fewer)
    cached_pieces: int = 0  # pieces served from the cache (for metrics/tests)
    computed_pieces: int = 0  # pieces tokenized and/or hashed now
    complete: bool = True  # False: ``keys`` stops after the first piece with an un-held key


class ChainCache:
    """LRU trie of ``ChainNode`` keyed by ``(parent node id, piece)``. Thread-safe.

    ``capacity`` counts nodes, ``max_bytes`` bounds their estimated memory (``node_bytes``);
    0 disables caching but still computes. Raises ``ValueError`` for negative bounds.
    """

    def __init__(self, hasher: BlockHasher, capacity: int = DEFAULT_CAPACITY,
                 index_stride: int = 1, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.hasher = hasher
        # lazy mode asks ``held`` only about anchor positions: the index holds no other keys
        self.index_stride = index_stride
        self.capacity = capacity
        self._nodes: SizedLRU[ChainNode] = SizedLRU(capacity, max_bytes, node_bytes)
        self._roots: dict[Hashable, ChainNode] = {}  # {(lora, cache_salt, prefix tokens): root}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards ``_roots``

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def hits(self) -> int:
        return self._nodes.hits

    @property
    def misses(self) -> int:
        return self._nodes.misses

    @property
    def num_bytes(self) -> int:
        """Estimated bytes held by the cached nodes."""
        return self._nodes.num_bytes

    # -- computing ------------------------------------------------------------------

    def extend(self, parent: ChainNode, tokens: Sequence[int], lora: tuple[str, str] | None,
               cache_salt: str | None) -> ChainNode:
        """The state after appending ``tokens`` to ``parent``'s prefix (not cached)."""
        size = self.hasher.block_size
        seq = parent.tail + tuple(tokens)
        first_block = (parent.num_tokens - len(parent.tail)) // size
        digests = self.hasher.digests(
            seq, lora=lora, cache_salt=cache_salt if first_block == 0 else None,
            parent=parent.digest)
        num_tokens = parent.num_tokens + len(tokens)
        head = parent.head
        if len(head) < size:
            head = (head + tuple(tokens[: size - len(head)]))
        return ChainNode(
            next(self._ids), num_tokens,
            tuple(block_keys(digests)),
            digests[-1] if digests else parent.digest, seq[len(digests) * size:], head)

    def root(self, lora: tuple[str, str] | None, cache_salt: str | None,
             prefix_tokens: Sequence[int] = ()) -> ChainNode:
        """The node every prompt with these extra keys (and special prefix tokens) starts from."""
        key = (lora, cache_salt, tuple(prefix_tokens))
        node = self._roots.get(key)
        if node is None:
            empty = ChainNode(0, 0, (), None, (), ())
            node = self.extend(empty, prefix_tokens, lora, cache_salt)
            with self._lock:
                if len(self._roots) > 4096:  # many distinct salts: keep the dict bounded
                    self._roots.clear()
                node = self._roots.setdefault(key, node)
        return node

    # -- the trie ---------------------------------------------------------------------

    def child(self, parent: ChainNode, piece: Hashable) -> ChainNode | None:
        """The cached node after ``piece`` under ``parent``, or ``None`` (LRU touch on hit)."""
        return self._nodes.get((parent.node_id, piece))

    def put(self, parent: ChainNode, piece: Hashable, node: ChainNode) -> None:
        self._nodes.put((parent.node_id, piece), node)

    def walk(self, root: ChainNode, pieces: Sequence[Hashable]) -> list[ChainNode]:
        """Cached nodes for the leading ``pieces`` under ``root`` (stops at the first miss)."""
        path: list[ChainNode] = []
        node = root
        for piece in pieces:
            found = self.child(node, piece)
            if found is None:
                break
            path.append(found)
            node = found
        return path

    def chain(
        self,
        root: ChainNode,
        pieces: Sequence[Hashable],
        tokens_of: Callable[[list[int]], list[Sequence[int]]],
        lora: tuple[str, str] | None,
        cache_salt: str | None,
        suffix_tokens: Sequence[int] = (),
        path: list[ChainNode] | None = None,
        held: Callable[[int], bool] | None = None,
        num_tokens: int | None = None,
        max_pieces: int | None = None,
    ) -> PromptChain | None:
        """The chain of the prompt made of ``pieces`` (+ uncached ``suffix_tokens``).

        ``tokens_of(indexes)`` returns the tokens of the pieces at those indexes
        (called once, for the pieces not cached). ``path`` is a previous
        ``walk(root, pieces)`` result to reuse.

        Lazy mode (``held`` given, with the prompt's total ``num_tokens``): hashing
        stops after the first computed piece holding a key (at an anchor position,
        ``index_stride``) for which ``held(key)`` is False (no replica can hit beyond it, and it already contains the first
        un-held block the ring needs); the result has ``complete=False`` and a
        later call without ``held`` finishes the chain from the cached pieces.
        ``tokens_of`` is then called once per piece. With ``max_pieces``, lazy mode
        gives up (returns ``None``) after computing that many pieces without meeting an
        un-held key; the pieces it computed stay cached, so a later call resumes there.
        """
        if path is None:
            path = self.walk(root, pieces)
        node = path[-1] if path else root
        cached = len(path)
        missing = list(range(cached, len(pieces)))
        complete = True
        if missing and held is not None:
            size, stride = self.hasher.block_size, self.index_stride
            for n_done, i in enumerate(missing):
                if max_pieces is not None and n_done >= max_pieces:
                    return None
                first = (node.num_tokens - len(node.tail)) // size  # chain position of new.keys[0]
                new = self.extend(node, tokens_of([i])[0], lora, cache_salt)
                self.put(node, pieces[i], new)
                path.append(new)
                node = new
                if i + 1 < len(pieces) and not all(
                        held(key) for pos, key in enumerate(new.keys, first)
                        if stride == 1 or is_anchor(pos, stride)):
                    complete = False
                    break
        elif missing:
            for i, toks in zip(missing, tokens_of(missing), strict=True):
                new = self.extend(node, toks, lora, cache_salt)
                self.put(node, pieces[i], new)
                path.append(new)
                node = new
        final = (self.extend(node, suffix_tokens, lora, cache_salt)
                 if suffix_tokens and complete else None)
        keys: list[BlockKey] = list(root.keys)
        for n in path:
            keys.extend(n.keys)
        if final is not None:
            keys.extend(final.keys)
            node = final
        total = node.num_tokens if complete or num_tokens is None else num_tokens
        return PromptChain(total, keys, node.head, cached, len(path) - cached, complete)

    # -- token ids ----------------------------------------------------------------------

    def id_pieces(self, tokens: Sequence[int]) -> list[Hashable]:
        """Cache keys of a token-id prompt's spans of ``SPAN_BLOCKS`` blocks (last may be short).

        A key is the span's xxh3-128 digest (16 bytes instead of the span itself,
        so cached id prompts cost about 1 KB per span); ids beyond 64 bits fall
        back to the span tuple.
        """
        span = SPAN_BLOCKS * self.hasher.block_size
        try:
            raw = memoryview(array("Q", tokens)).cast("B")
        except OverflowError:
            return [tuple(tokens[i:i + span]) for i in range(0, len(tokens), span)]
        step = span * 8
        return [xxhash.xxh3_128_digest(raw[i:i + step]) for i in range(0, len(raw), step)]

    def id_spans(self, tokens: Sequence[int]) -> Callable[[Iterable[int]], list[Sequence[int]]]:
        """``tokens_of`` for ``chain``: the token spans at the given piece indexes."""
        span = SPAN_BLOCKS * self.hasher.block_size
        return lambda indexes: [tokens[i * span:(i + 1) * span] for i in indexes]

    def chain_of_ids(self, tokens: Sequence[int], lora: tuple[str, str] | None = None,
                     cache_salt: str | None = None) -> PromptChain:
        """Chain of a token-id prompt (vLLM uses given token ids as they are)."""
        chain = self.chain(self.root(lora, cache_salt), self.id_pieces(tokens),
                           self.id_spans(tokens), lora, cache_salt)
        assert chain is not None  # only lazy mode gives up
        return chain

    def id_chain(self, tokens: Sequence[int], lora: tuple[str, str] | None,
                 cache_salt: str | None, max_uncached_blocks: int | None = None,
                 held: Callable[[int], bool] | None = None,
                 lazy_min_blocks: int = LAZY_MIN_UNCACHED_BLOCKS,
                 pieces: list[Hashable] | None = None) -> PromptChain | None:
        """Block-key chain of a token-id prompt (the token-id counterpart of
        ``PromptTokenizer.text_chain``; vLLM uses given token ids as they are).

        Returns ``None`` (having hashed nothing) when more than ``max_uncached_blocks``
        blocks would be hashed: the caller then runs it again without the limit off the event
        loop. Lazy mode (``held`` given, more than ``lazy_min_blocks`` new blocks): hashing
        stops at the first piece holding an un-held key (``chain``; ``complete=False``); with
        ``max_uncached_blocks`` it gives up after that many blocks' pieces, keeping them cached.
        ``pieces``: ``id_pieces(tokens)`` computed before (a lazy chain's rest reuses them).
        """
        if pieces is None:
            pieces = self.id_pieces(tokens)
        root = self.root(lora, cache_salt)
        path = self.walk(root, pieces)
        done = path[-1].num_tokens if path else 0
        uncached = (len(tokens) - done) // self.hasher.block_size
        if uncached <= lazy_min_blocks:
            held = None  # a short rest: hashed whole (no thread hop for it later)
        if held is None and max_uncached_blocks is not None and uncached > max_uncached_blocks:
            return None
        max_pieces = (max(max_uncached_blocks // SPAN_BLOCKS, 1)
                      if held is not None and max_uncached_blocks is not None else None)
        return self.chain(root, pieces, self.id_spans(tokens), lora, cache_salt, path=path,
                          held=held, num_tokens=len(tokens), max_pieces=max_pieces)

    def id_chain_steps(self, tokens: Sequence[int], lora: tuple[str, str] | None,
                       cache_salt: str | None,
                       pieces: list[Hashable] | None = None) -> Generator[None, None, PromptChain]:
        """``id_chain(tokens, lora, cache_salt)`` (whole, not lazy) one piece at a time: the
        generator yields before hashing each uncached piece (``SPAN_BLOCKS`` blocks) and returns
        the chain, so that a caller on the event loop hashes a long prompt between loop turns. A
        piece another caller cached meanwhile is taken from the cache, not hashed again."""
        if pieces is None:
            pieces = self.id_pieces(tokens)
        root = self.root(lora, cache_salt)
        path = self.walk(root, pieces)
        span = SPAN_BLOCKS * self.hasher.block_size
        node = path[-1] if path else root
        cached = len(path)
        for i in range(cached, len(pieces)):
            yield
            new = self.child(node, pieces[i])
            if new is None:
                new = self.extend(node, tokens[i * span:(i + 1) * span], lora, cache_salt)
                self.put(node, pieces[i], new)
            path.append(new)
            node = new
        keys: list[BlockKey] = list(root.keys)
        for n in path:
            keys.extend(n.keys)
        return PromptChain(node.num_tokens, keys, node.head, cached, len(path) - cached)

    def uncached_id_blocks(self, tokens: Sequence[int], lora: tuple[str, str] | None = None,
                           cache_salt: str | None = None) -> tuple[int, list[ChainNode],
                                                                     list[Hashable]]:
        """Blocks that would be hashed now, plus the cached path and piece keys to reuse."""
        pieces = self.id_pieces(tokens)
        path = self.walk(self.root(lora, cache_salt), pieces)
        done = path[-1].num_tokens if path else 0
        return (len(tokens) - done) // self.hasher.block_size, path, pieces


def node_bytes(key: Hashable, node: ChainNode) -> int:
    """Estimated memory of one cached node in bytes, its ``(parent id, piece)`` key included.

    CPython 3.11 sizes: a text piece costs its characters plus ~50 bytes, a key or token
    ~40 bytes (int object plus tuple slot), the node, its key tuple and the LRU entry ~300.
    """
    piece = key[1] if isinstance(key, tuple) and len(key) == 2 else key
    piece_bytes = (len(piece) + 50 if isinstance(piece, (str, bytes))
                   else 40 * len(piece) + 56 if isinstance(piece, tuple) else 32)
    return 300 + piece_bytes + 40 * (len(node.keys) + len(node.tail))
