"""``/v1/responses`` continuing a stored response (``previous_response_id``): routed to the
replica holding it, and each stored answer's holder remembered (``router.apis.affinity``: this
process's memory and Redis, shared by the routers). Redis I/O through the affinity store.
"""

from __future__ import annotations

import time

from router.apis.affinity import ResponseAffinity, holder_target, response_id_from_head
from router.decision.fleet import Fleet
from router.edges.proxy import ProxyOutcome
from router.request.prompts import PromptSpec
from router.request.routing import Routed


class ResponseHolders:
    """Where stored Responses answers live, and the routing of requests that continue one."""

    def __init__(self, fleet: Fleet, affinity: ResponseAffinity) -> None:
        self.fleet = fleet
        self.affinity = affinity

    async def route(self, response_id: str, spec: PromptSpec) -> Routed:
        """A Responses request continuing ``response_id``: to the replica holding it, its
        prompt unhashed (its prefix is the stored conversation, which only the engine has).
        Raises ``ResponseNotFound`` (404), ``NoRoutableReplica`` (503)."""
        holder = await self.affinity.holder(response_id)
        decision, targets, lora = holder_target(self.fleet, response_id, holder, spec.model,
                                                time.monotonic())
        return Routed(decision, max(1, len(spec.fallback_text()) // 4), [], targets,
                      tokenized=False, lora=lora)

    async def remember(self, outcome: ProxyOutcome) -> None:
        """Record which replica answered a stored Responses request (its id from the answer's
        head)."""
        response_id = response_id_from_head(outcome.head)
        if response_id is not None:
            await self.affinity.remember(response_id, outcome.replica_id)
