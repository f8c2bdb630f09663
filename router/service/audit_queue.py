"""The hand-off of served requests to the template audit (``router.observability.audit``): a
bounded queue onto the audit's own thread, so that the audit never competes with routing for
the tokenizer pool and never delays an answer. Runs work on a thread; no network I/O.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from router.observability.audit import PrefixAudit, prompt_head
from router.request.prompts import PromptSpec, PromptTokenizer
from router.request.usage import cached_tokens_from_tail

logger = logging.getLogger(__name__)

AUDIT_QUEUE = 64  # template-audit observations waiting at most (more are dropped and counted)


class AuditQueue:
    """Observations of served requests for ``audit`` (None: the audit is off), at most
    ``AUDIT_QUEUE`` waiting; more are dropped and counted by the audit per tenant."""

    def __init__(self, audit: PrefixAudit | None, tokenizer: PromptTokenizer | None,
                 head_tokens: int) -> None:
        self.audit = audit
        self.tokenizer = tokenizer
        self.head_tokens = head_tokens  # prompt tokens the audit reads of each request
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="audit")
        self.num_queued = 0  # observations submitted and not yet done

    def submit(self, spec: PromptSpec, num_tokens: int, predicted_hit_tokens: int,
               tail: bytes, tenant: str | None) -> None:
        """Hand a served request (its answer's ``tail``, for the engine's cached tokens) to the
        audit's thread, or drop it when the queue is full."""
        audit = self.audit
        if audit is None:
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
        try:
            future = asyncio.get_running_loop().run_in_executor(self.executor, observe)
        except RuntimeError:  # the executor is shut down: the router is stopping
            self.num_queued -= 1
            return
        future.add_done_callback(self._done)

    def _done(self, future: asyncio.Future[None]) -> None:
        self.num_queued -= 1
        if not future.cancelled() and future.exception() is not None:
            logger.warning("template audit failed on a request: %r", future.exception())

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
