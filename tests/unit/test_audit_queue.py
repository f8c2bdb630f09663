"""The template audit's hand-off (``router.service.audit_queue``): every observation submitted is
audited once, in order (a token-id prompt's on the event loop, a text one's on the audit's
thread); beyond ``AUDIT_QUEUE`` waiting they are dropped and counted; after ``shutdown`` nothing
more is audited (what the thread holds may end). A real ``PrefixAudit``."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from router.observability.audit import PrefixAudit
from router.request.prompts import PromptSpec
from router.service.audit_queue import (
    AUDIT_QUEUE,
    AUDIT_SLICE,
    LOOP_AUDIT_MAX_HEAD_TOKENS,
    AuditQueue,
)

TAIL = (b'data: {"usage":{"prompt_tokens":64,"prompt_tokens_details":{"cached_tokens":16}}}\n\n'
        b"data: [DONE]\n\n")


class _Recording(PrefixAudit):
    """A ``PrefixAudit`` that records what it is asked to observe, and can be held."""

    def __init__(self) -> None:
        super().__init__(16)
        self.seen: list[tuple[int, int | None, str | None]] = []
        self.threads: set[int] = set()  # the threads it observed on
        self.hold = threading.Event()
        self.hold.set()

    def observe(self, tokens: Any, prompt_tokens: int | None = None,
                predicted_hit_tokens: int = 0, cached_tokens: int | None = None,
                tenant: str | None = None) -> str | None:
        self.hold.wait(10)
        self.threads.add(threading.get_ident())
        self.seen.append((tokens[0], cached_tokens, tenant))
        return super().observe(tokens, prompt_tokens, predicted_hit_tokens, cached_tokens, tenant)


def _spec(first: int) -> PromptSpec:
    return PromptSpec(kind="completion", model=None, token_ids=[first, *range(1, 64)])


async def _wait(condition: Any) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the audit thread did not catch up"
        await asyncio.sleep(0.01)


async def test_every_observation_is_audited_once_in_order() -> None:
    audit = _Recording()
    queue = AuditQueue(audit, None, 1024)
    try:
        for i in range(200):
            queue.submit(_spec(1000 + i), 64, 0, TAIL, "t" if i % 2 else None)
            if i % 7 == 0:
                await asyncio.sleep(0.001)  # some observations alone, some in a burst
        await _wait(lambda: queue.num_queued == 0)
        assert audit.seen == [(1000 + i, 16, "t" if i % 2 else None) for i in range(200)]
        assert audit.observed == 200 and audit.dropped == 0
        # token ids: on the event loop (issue 32: no hop, no thread contending for the GIL)
        assert audit.threads == {threading.get_ident()}
    finally:
        queue.shutdown()


async def test_beyond_the_queue_observations_are_dropped_and_counted() -> None:
    audit = _Recording()
    audit.hold.clear()  # the thread holds the first observation
    queue = AuditQueue(audit, None, 1024)
    try:
        for i in range(AUDIT_QUEUE + 5):
            queue.submit(_spec(1000 + i), 64, 0, TAIL, "t")
        assert audit.dropped == 5 and audit.report(tenant="t", all_tenants=False)[
            "dropped_requests"] == 5
        audit.hold.set()
        await _wait(lambda: queue.num_queued == 0)
        assert [seen[0] for seen in audit.seen] == [1000 + i for i in range(AUDIT_QUEUE)]
        queue.submit(_spec(5000), 64, 0, TAIL, None)  # room again
        await _wait(lambda: queue.num_queued == 0)
        assert audit.seen[-1][0] == 5000
    finally:
        queue.shutdown()


async def test_nothing_is_audited_after_shutdown() -> None:
    audit = _Recording()
    audit.hold.clear()
    queue = AuditQueue(audit, None, 1024)
    for i in range(10):
        queue.submit(_spec(1000 + i), 64, 0, TAIL, None)
    queue.shutdown()
    audit.hold.set()
    queue.executor.shutdown(wait=True)
    assert len(audit.seen) <= 1  # at most the one the thread held
    queue.submit(_spec(2000), 64, 0, TAIL, None)  # after shutdown: not audited, no error
    assert len(audit.seen) <= 1


async def test_a_burst_is_audited_a_slice_per_loop_turn() -> None:
    """Token-id observations are audited ``AUDIT_SLICE`` per event-loop turn: a saturated loop
    turns about once per request, so one a turn fell behind and dropped a fifth of them."""
    audit = _Recording()
    queue = AuditQueue(audit, None, 1024)
    try:
        for i in range(2 * AUDIT_SLICE):
            queue.submit(_spec(1000 + i), 64, 0, TAIL, None)
        await asyncio.sleep(0)  # one turn
        assert len(audit.seen) == AUDIT_SLICE
        await _wait(lambda: queue.num_queued == 0)
        assert [seen[0] for seen in audit.seen] == [1000 + i for i in range(2 * AUDIT_SLICE)]
    finally:
        queue.shutdown()


async def test_a_long_audit_head_keeps_token_id_observations_off_the_loop() -> None:
    """An operator's ``audit_head_tokens`` above ``LOOP_AUDIT_MAX_HEAD_TOKENS`` makes each
    observation long (9 ms at 131,072 tokens): token-id ones then go to the audit's thread, as
    text ones do, rather than holding the event loop."""
    for head, on_loop in ((LOOP_AUDIT_MAX_HEAD_TOKENS, True),
                          (LOOP_AUDIT_MAX_HEAD_TOKENS + 1, False)):
        audit = _Recording()
        queue = AuditQueue(audit, None, head)
        try:
            queue.submit(_spec(1000), 64, 0, TAIL, None)
            await _wait(lambda q=queue: q.num_queued == 0)
            assert (audit.threads == {threading.get_ident()}) == on_loop, (head, audit.threads)
            assert len(audit.seen) == 1
        finally:
            queue.shutdown()
