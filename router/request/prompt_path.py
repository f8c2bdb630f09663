"""Step 2 of the request path: a prompt's block-key chain, with one owner. Pure (asyncio only).

``PromptChainer`` is the one place that turns a parsed request (``PromptSpec``) into its
``PromptChain``: token ids through ``ChainCache.id_chain``, text and chat through
``PromptTokenizer.prompt_chain``; on the event loop when cheap or token ids (a long chain in
slices between loop turns), else in the tokenizer threads; lazily for long new prompts, with the
rest hashed after the request was sent, and the *pending tails* that make a burst of one new
long prefix see the whole prefix.

Lazy hashing: a long prompt is tokenized and hashed before routing only up to the first piece
holding a block no replica holds (no replica can hit beyond it); the rest after the request was
sent, then recorded as placed (for text, the prompt length used for routing is estimated from the
tokens per character so far until then). Rests are done one at a time, in order: a token-id rest
on the event loop, ``REST_SLICE_S`` of hashing per loop turn (no thread hop, and no thread
contending with the loop for the GIL: docs/benchmarks.md, "Router CPU per request, by phase"),
a text rest on a thread of its own (its tokenization is long). Until then the request's last
hashed key is a *pending tail*: a request whose chain reaches it waits for the rest to be
recorded (at most ``PENDING_TAIL_WAIT_S``) and hashes again, so a burst of one new long prefix
sees the whole prefix. With ``MAX_QUEUED_RESTS`` rests waiting, prompts are hashed whole before
routing again: the backlog (and the delay of the placements it records) stays bounded under
overload.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable, Generator, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

from router.request.chain_cache import ChainCache, PromptChain
from router.request.prompts import PromptSpec, PromptTokenizer
from router.shared.contract import BlockKey

LAZY_HASHING: Final = True
PENDING_TAIL_WAIT_S: Final = 1.0
MAX_QUEUED_RESTS: Final = 4
INLINE_HASH_BLOCKS: Final = 64  # uncached blocks hashed on the event loop before a thread hop
MAX_KEPT_PIECES: Final = 256  # lazy token-id chains whose piece keys wait for their rest
INLINE_TOKENIZE_CHARS: Final = 2048  # uncached characters tokenized on the loop before a thread hop
# (both cost less than the hop: docs/benchmarks.md, "Figures from the code's comments")
# seconds of token-id hashing per event-loop turn (a rest, or a whole chain too long to hash at
# once), at least one piece: about 1,200 blocks. A count of pieces (4, 64 blocks) made a 128k
# rest take 128 turns: with other work making turns 4 ms long, a request waiting for that rest's
# pending tail ran out of its PENDING_TAIL_WAIT_S and was routed on 48 of 4,102 blocks, where the
# rest thread it replaced took 0.1-0.25 s (a reviewer's measurement). 1 ms holds the loop less
# than the interpreter's 5 ms GIL switch interval let that thread hold it.
REST_SLICE_S: Final = 0.001

Lora = tuple[str, str] | None


class PromptChainer:
    """The chain of every request's prompt, and the rests of lazily hashed ones.

    ``chain(spec, lora, lazy=...)`` is the chain used for routing; ``hash_rest`` finishes a lazy
    one after dispatch. ``executor`` (``threads`` tokenizer threads) runs chains too costly for
    the event loop; the rests are queued and done one at a time (module docstring), a text one
    on ``rest_executor`` (one thread, so that under load rests never take the cores that routing
    needs). ``hold_rests()`` starts no rest until its release is called. Not thread-safe: call
    on the event loop.
    """

    def __init__(self, chains: ChainCache, tokenizer: PromptTokenizer | None,
                 holds_key: Callable[[int], bool], threads: int) -> None:
        self.chains = chains
        self.tokenizer = tokenizer
        self._holds_key = holds_key  # does any replica hold (or was recently sent) this key
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self.rest_executor = ThreadPoolExecutor(1, thread_name_prefix="tokenize-rest")
        # {last key of a lazily hashed chain: done when the rest of that chain is recorded}
        self.pending_tails: dict[int, asyncio.Future[None]] = {}
        self.queued_rests = 0  # rests of lazy chains submitted and not yet recorded
        # {id(token ids): (those ids, their piece keys)} of lazy token-id chains, until their
        # rest is hashed: cutting and digesting 8k ids costs about 0.1 ms, once per request
        self._rest_pieces: dict[int, tuple[list[int], list[Hashable]]] = {}
        self._rests: deque[_Rest] = deque()  # queued rests, oldest (the one under way) first
        self._rests_busy = False  # a slice is scheduled, or a text rest is on its thread
        self._holds = 0  # hold_rests() not released yet
        self._closed = False

    def tokenizes(self, spec: PromptSpec) -> bool:
        """True if ``spec`` gets a block chain (token ids, or text with a tokenizer)."""
        return spec.token_ids is not None or self.tokenizer is not None

    async def chain(self, spec: PromptSpec, lora: Lora, *, lazy: bool) -> tuple[PromptChain, str]:
        """The chain for routing ``spec`` and the path taken: ``"inline"`` (on the event loop,
        at once), ``"sliced"`` (a whole token-id chain on the event loop, ``REST_SLICE_S``
        pieces per loop turn) or ``"thread"`` (the tokenizer threads).

        ``lazy`` (a request that will be sent, under an index policy): hash only up to the first
        un-held piece while fewer than ``MAX_QUEUED_RESTS`` rests wait, and follow pending
        tails: a chain (lazy or whole) that reaches another request's pending tail is computed
        again once that tail is recorded, within ``PENDING_TAIL_WAIT_S`` in all. Raises
        ``PromptError`` (a ``BadRequest``).
        """
        follow = LAZY_HASHING and lazy
        lazy = follow and self.queued_rests < MAX_QUEUED_RESTS
        loop = asyncio.get_running_loop()
        give_up = loop.time() + PENDING_TAIL_WAIT_S
        ids = spec.token_ids
        pieces = self.chains.id_pieces(ids) if ids is not None else None
        while True:
            path = "inline"
            prompt = self._compute(spec, lora, inline=True, lazy=lazy, pieces=pieces)
            if prompt is None and ids is not None and not lazy:
                path = "sliced"
                prompt = await self._sliced_id_chain(ids, lora, spec.cache_salt, pieces)
            elif prompt is None:
                path = "thread"
                prompt = await loop.run_in_executor(self.executor, self._whole_or_lazy,
                                                    spec, lora, lazy, pieces)
            if ids is not None and pieces is not None and not prompt.complete:
                self._keep_pieces(ids, pieces)
            pending = self.pending_tails
            if not follow or not pending or pending.keys().isdisjoint(prompt.keys):
                return prompt, path
            wait_s = give_up - loop.time()
            if wait_s <= 0:
                return prompt, path
            keys = set(prompt.keys)
            await asyncio.wait([fut for key, fut in pending.items() if key in keys],
                               timeout=wait_s)

    async def _sliced_id_chain(self, ids: list[int], lora: Lora, cache_salt: str | None,
                               pieces: list[Hashable] | None) -> PromptChain:
        """A token-id prompt's whole chain hashed on the event loop, ``REST_SLICE_S`` of it per
        loop turn (as a rest is: no thread hop, no thread contending for the GIL)."""
        steps = self.chains.id_chain_steps(ids, lora, cache_salt, pieces)
        clock = time.perf_counter
        until = clock() + REST_SLICE_S
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value
            if clock() >= until:
                await asyncio.sleep(0)
                until = clock() + REST_SLICE_S

    def hash_rest(self, spec: PromptSpec, lora: Lora, boundary: BlockKey,
                  record: Callable[[PromptChain], None]) -> asyncio.Future[PromptChain]:
        """Queue the whole chain of a lazily routed ``spec`` (module docstring); when done, call
        ``record(whole_chain)`` (not when cancelled or failed), then release the pending tail
        ``boundary`` (the lazy chain's last key). Returns the future (cancel it to drop the
        rest: nothing is recorded, the tail is released)."""
        loop = asyncio.get_running_loop()
        recorded: asyncio.Future[None] = loop.create_future()
        self.pending_tails[boundary] = recorded

        def done(fut: asyncio.Future[PromptChain]) -> None:
            self.queued_rests -= 1
            try:
                if not fut.cancelled() and fut.exception() is None:
                    record(fut.result())
            finally:
                if self.pending_tails.get(boundary) is recorded:
                    del self.pending_tails[boundary]
                recorded.set_result(None)

        pieces = None
        if spec.token_ids is not None:
            kept = self._rest_pieces.pop(id(spec.token_ids), None)
            if kept is not None and kept[0] is spec.token_ids:
                pieces = kept[1]
        self.queued_rests += 1
        future: asyncio.Future[PromptChain] = loop.create_future()
        future.add_done_callback(done)
        if self._closed:  # the router is stopping
            future.cancel()
        else:
            self._rests.append(_Rest(spec, lora, pieces, future))
            self._next_rest()
        return future

    def hold_rests(self) -> Callable[[], None]:
        """Start no queued rest (one under way finishes its slice) until the returned release
        is called (a second call does nothing): tests hold the rests as a busy router would."""
        self._holds += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._holds -= 1
                if not self._closed:
                    self._next_rest()

        return release

    def shutdown(self, wait: bool = False) -> None:
        """Stop both thread pools and drop the queued rests (cancelled while their loop runs)."""
        self._closed = True
        while self._rests:
            future = self._rests.popleft().future
            if not future.get_loop().is_closed():
                future.cancel()
        self.executor.shutdown(wait=wait, cancel_futures=not wait)
        self.rest_executor.shutdown(wait=wait, cancel_futures=not wait)

    def _next_rest(self) -> None:
        """Schedule the next slice of the queued rests unless one is under way, or held."""
        if self._rests and not self._rests_busy and not self._holds:
            self._rests_busy = True
            asyncio.get_running_loop().call_soon(self._rest_slice)

    def _rest_slice(self) -> None:
        """Hash ``REST_SLICE_S`` of the queued token-id rests (at least one piece), or start the
        first queued text rest on its thread; then schedule the next slice (a loop callback)."""
        self._rests_busy = False
        if self._closed or self._holds:
            return
        clock = time.perf_counter
        until = clock() + REST_SLICE_S
        rests = self._rests
        while rests and clock() < until:
            rest = rests[0]
            if rest.future.done():  # cancelled: its request was refused
                rests.popleft()
                continue
            spec = rest.spec
            if spec.token_ids is None:
                rests.popleft()
                try:
                    on_thread = asyncio.get_running_loop().run_in_executor(
                        self.rest_executor, self._whole_or_lazy, spec, rest.lora, False, None)
                except RuntimeError:  # the executor is shut down: the router is stopping
                    rest.future.cancel()
                    return
                self._rests_busy = True
                on_thread.add_done_callback(functools.partial(self._text_rest_done, rest))
                return
            if rest.steps is None:
                rest.steps = self.chains.id_chain_steps(spec.token_ids, rest.lora,
                                                        spec.cache_salt, rest.pieces)
            try:
                next(rest.steps)
            except StopIteration as stop:
                rests.popleft()
                rest.future.set_result(stop.value)
            except Exception as exc:  # the rest fails: nothing recorded, the tail released
                rests.popleft()
                rest.future.set_exception(exc)
        self._next_rest()

    def _text_rest_done(self, rest: _Rest, on_thread: asyncio.Future[PromptChain]) -> None:
        """A text rest's thread is done: pass its outcome on, then go on with the queue."""
        self._rests_busy = False
        if not rest.future.done():
            if on_thread.cancelled():
                rest.future.cancel()
            elif (exc := on_thread.exception()) is not None:
                rest.future.set_exception(exc)
            else:
                rest.future.set_result(on_thread.result())
        if not self._closed:
            self._next_rest()

    def _keep_pieces(self, ids: list[int], pieces: list[Hashable]) -> None:
        """Keep a lazy chain's piece keys for its rest (``hash_rest``); a chain never sent
        leaves its entry until ``MAX_KEPT_PIECES`` newer ones push it out."""
        kept = self._rest_pieces
        if len(kept) >= MAX_KEPT_PIECES:
            del kept[next(iter(kept))]
        kept[id(ids)] = (ids, pieces)

    def _compute(self, spec: PromptSpec, lora: Lora, inline: bool, lazy: bool,
                 pieces: list[Hashable] | None = None) -> PromptChain | None:
        """The chain through the chain cache; ``inline`` (on the event loop): ``None`` instead
        of hashing more than ``INLINE_HASH_BLOCKS`` or tokenizing more than
        ``INLINE_TOKENIZE_CHARS``; ``lazy``: only up to the first un-held piece; ``pieces``: a
        token-id prompt's ``ChainCache.id_pieces``, when known."""
        held = self._holds_key if lazy else None
        if spec.token_ids is not None:
            return self.chains.id_chain(spec.token_ids, lora, spec.cache_salt,
                                        INLINE_HASH_BLOCKS if inline else None, held,
                                        lazy_min_blocks=INLINE_HASH_BLOCKS, pieces=pieces)
        assert self.tokenizer is not None
        return self.tokenizer.prompt_chain(spec, self.chains, lora,
                                           INLINE_TOKENIZE_CHARS if inline else None, held)

    def _whole_or_lazy(self, spec: PromptSpec, lora: Lora, lazy: bool,
                       pieces: list[Hashable] | None = None) -> PromptChain:
        chain = self._compute(spec, lora, inline=False, lazy=lazy, pieces=pieces)
        assert chain is not None  # only the inline limit gives up
        return chain


@dataclass(slots=True)
class _Rest:
    """A queued rest: what to hash, the future ``hash_rest`` returned, and (token ids, once
    started) the generator hashing it one piece per step."""

    spec: PromptSpec
    lora: Lora
    pieces: list[Hashable] | None
    future: asyncio.Future[PromptChain]
    steps: Generator[None, None, PromptChain] | None = None
