"""The hand-off of served requests to the template audit (``router.observability.audit``): a
bounded queue, drained in order after the answers went out, ``AUDIT_SLICE`` observations per
event-loop turn. A token-id prompt's observation runs on the event loop (about 80 us at the
default ``audit_head_tokens``, up to ``LOOP_AUDIT_MAX_HEAD_TOKENS``: no thread hop, and no
second thread contending with the loop for the GIL, docs/benchmarks.md "Router CPU per request,
by phase"); a text prompt's, which tokenizes the head, on the audit's own thread, so that the
audit never competes with routing for the tokenizer pool. No network I/O.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from router.observability.audit import PrefixAudit, prompt_head
from router.request.prompts import PromptSpec, PromptTokenizer
from router.request.usage import cached_tokens_from_tail

logger = logging.getLogger(__name__)

AUDIT_QUEUE = 64  # template-audit observations waiting at most (more are dropped and counted)
# observations audited per event-loop turn: a saturated loop turns about once per request, so one
# a turn fell behind (a fifth dropped at 600 requests/s); 4 hold the loop about 0.3 ms at most
AUDIT_SLICE = 4
# a token-id observation runs on the loop only while the audit reads at most this many tokens of
# each prompt: one costs about 0.09 ms at the default 1,024 and grows with it (0.5 ms at 8,192,
# 9 ms at 131,072, a reviewer's measurement); above, it goes to the audit's thread as text does
LOOP_AUDIT_MAX_HEAD_TOKENS = 2048


class AuditQueue:
    """Observations of served requests for ``audit`` (None: the audit is off), at most
    ``AUDIT_QUEUE`` waiting; more are dropped and counted by the audit per tenant. Use on one
    event loop."""

    def __init__(self, audit: PrefixAudit | None, tokenizer: PromptTokenizer | None,
                 head_tokens: int) -> None:
        self.audit = audit
        self.tokenizer = tokenizer
        self.head_tokens = head_tokens  # prompt tokens the audit reads of each request
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="audit")
        self.num_queued = 0  # observations submitted and not yet done
        # (observe, on the event loop?) waiting, oldest first
        self._waiting: deque[tuple[Callable[[], None], bool]] = deque()
        self._draining = False  # a drain step is scheduled, or an observation is on the thread
        self._closed = False

    def submit(self, spec: PromptSpec, num_tokens: int, predicted_hit_tokens: int,
               tail: bytes, tenant: str | None) -> None:
        """Queue a served request (its answer's ``tail``, for the engine's cached tokens) for
        the audit, or drop it when the queue is full."""
        audit = self.audit
        if audit is None or self._closed:
            return
        if self.num_queued >= AUDIT_QUEUE:
            audit.drop(tenant)
            return
        cached = cached_tokens_from_tail(tail)
        tokenizer, head = self.tokenizer, self.head_tokens

        def observe() -> None:
            tokens = prompt_head(spec, tokenizer, head)
            if tokens is not None:
                audit.observe(tokens, num_tokens, predicted_hit_tokens, cached, tenant)

        self.num_queued += 1
        on_loop = spec.token_ids is not None and head <= LOOP_AUDIT_MAX_HEAD_TOKENS
        self._waiting.append((observe, on_loop))
        self._drain_soon()

    def _drain_soon(self) -> None:
        if self._waiting and not self._draining and not self._closed:
            self._draining = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        """Audit the oldest waiting observations, up to ``AUDIT_SLICE`` on the loop, until one
        is handed to the thread."""
        self._draining = False
        waiting = self._waiting
        for _ in range(AUDIT_SLICE):
            if self._closed or not waiting:
                return
            if not waiting[0][1]:
                break
            observe, _ = waiting.popleft()
            try:
                observe()
            except Exception as exc:  # the audit is advisory: a failure never stops it
                logger.warning("template audit failed on a request: %r", exc)
            self.num_queued -= 1
        else:
            self._drain_soon()
            return
        observe, _ = waiting.popleft()
        try:
            future = asyncio.get_running_loop().run_in_executor(self.executor, observe)
        except RuntimeError:  # the executor is shut down: the router is stopping
            self.num_queued -= 1
            return
        self._draining = True
        future.add_done_callback(self._done)

    def _done(self, future: asyncio.Future[None]) -> None:
        self.num_queued -= 1
        self._draining = False
        if not future.cancelled() and future.exception() is not None:
            logger.warning("template audit failed on a request: %r", future.exception())
        self._drain_soon()

    def shutdown(self) -> None:
        """Audit nothing more (what the thread holds may end)."""
        self._closed = True
        self.num_queued -= len(self._waiting)
        self._waiting.clear()
        self.executor.shutdown(wait=False, cancel_futures=True)
