"""``/v1/responses`` continuing a stored response (``previous_response_id``), and
``GET /v1/responses/{id}`` / ``POST /v1/responses/{id}/cancel``: routed to the replica holding
it, and each stored answer's holder remembered with its tenant (``router.apis.affinity``: this
process's memory and Redis, shared by the routers). Redis I/O through the affinity store.
"""

from __future__ import annotations

import asyncio
import time

from router.apis.affinity import ResponseAffinity, holder_target, response_id_from_head
from router.decision.fleet import Fleet
from router.edges.proxy import ProxyOutcome
from router.request.prompts import PromptSpec, estimated_tokens
from router.request.routing import Routed, Target


class ResponseHolders:
    """Where stored Responses answers live, and the routing of requests that continue one."""

    def __init__(self, fleet: Fleet, affinity: ResponseAffinity) -> None:
        self.fleet = fleet
        self.affinity = affinity
        self._writes: set[asyncio.Task[None]] = set()

    async def route(self, response_id: str, spec: PromptSpec, tenant: str | None) -> Routed:
        """``tenant``'s Responses request continuing ``response_id``: to the replica holding
        it, its prompt unhashed (its prefix is the stored conversation, which only the engine
        has). Raises ``ResponseNotFound`` (404; also for another tenant's id),
        ``NoRoutableReplica`` (503)."""
        holder = await self.affinity.holder(response_id, tenant)
        decision, targets, lora = holder_target(self.fleet, response_id, holder, spec.model,
                                                time.monotonic())
        return Routed(decision, estimated_tokens(spec.fallback_text()), [], targets,
                      tokenized=False, lora=lora)

    async def target(self, response_id: str, tenant: str | None) -> Target:
        """The replica holding ``tenant``'s ``response_id`` (retrieve, cancel), with the errors
        of ``route``."""
        holder = await self.affinity.holder(response_id, tenant)
        _, targets, _ = holder_target(self.fleet, response_id, holder, None, time.monotonic())
        return targets[0]

    def remember(self, outcome: ProxyOutcome, tenant: str | None) -> None:
        """Record which replica answered ``tenant``'s stored Responses request (its id from the
        answer's head): in this process at once, in Redis on a task of its own. Not awaited by
        the handler: a client that hangs up right after the answer cancels the handler (aiohttp's
        handler cancellation), which lost the Redis record and counted a delivered answer 499."""
        response_id = response_id_from_head(outcome.head)
        if response_id is None:
            return
        task = asyncio.create_task(self.affinity.remember(response_id, outcome.replica_id, tenant))
        self._writes.add(task)  # a strong reference until done (the loop keeps only weak ones)
        task.add_done_callback(self._writes.discard)

    async def drain(self) -> None:
        """Wait for the holders' Redis writes still under way (shutdown)."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
