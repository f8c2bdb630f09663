"""Half-open probes: a replica whose circuit's ejection ended gets a request the router makes,
never a client's prompt, and takes client traffic again only once it answered. HTTP client.

The probe is a 1-token ``/v1/completions`` (``PROBE_PROMPT``, ``max_tokens`` 1, the replica's
first served model). vLLM's ``/health`` is no proof: it is answered by the API server, which
stays up while the engine core is hung (``/health`` only turns 503 once the engine process
died); a completion goes through the engine's scheduler, so only an engine that runs answers
it. So only a completion proves the replica serves (``probe_verdict``): a 2xx answer whose body
is a JSON object with a ``choices`` list. Any other answer is a failure: a 5xx; a 4xx, which
vLLM's API server gives without the engine (401 for a replica with API keys of its own, which
the probe does not carry; 404 for a model it no longer serves; 400), so it says nothing of
the engine; a 2xx that is no completion (another server on the port). So is a failed
connection or no answer within ``first_byte_deadline_floor_s`` (a 1-token prompt on a replica
this router sends nothing else to: its queue drains while it is benched); a timeout while the
router's own loop ran late (``router.observability.loop_lag``) is neither, and the replica is probed again
next time. (A client request's 2xx answer closes the circuit too: ``ReplicaHealth.record_success``.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Final

import aiohttp

from router.decision.fleet import Fleet
from router.edges.proxy import connect_refused
from router.observability.loop_lag import LoopLag
from router.observability.metrics import RouterMetrics
from router.service.config import RouterConfig
from router.shared.contract import DP_RANK_HEADER

logger = logging.getLogger(__name__)

PROBE_TICK_S: Final = 0.25  # how often replicas past their ejection are looked for
PROBE_PROMPT: Final = "ping"  # any text the engine tokenizes: one token out is the whole answer
PROBE_HEADER: Final = "x-prefix-router-probe"  # marks the probe (engine logs, fault proxies)


def probe_verdict(status: int, body: bytes) -> str | None:
    """Why the probe's answer (``status``, ``body``) does not prove the replica serves, or
    ``None`` when it does: a 2xx whose body is a JSON object with a ``choices`` list (module
    docstring)."""
    if not 200 <= status < 300:
        return f"HTTP {status}" + (" (the API server answered without the engine: does the "
                                   "replica require an API key?)" if status in (401, 403) else "")
    try:
        answer = json.loads(body)
    except ValueError:
        return f"HTTP {status} with a body that is not JSON"
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        return f"HTTP {status} with no completion in its body"
    return None


class CircuitProber:
    """Sends the half-open probes of ``fleet.health`` (``ReplicaHealth.probes_due``)."""

    def __init__(self, fleet: Fleet, session: aiohttp.ClientSession, config: RouterConfig,
                 metrics: RouterMetrics, loop_lag: LoopLag | None = None) -> None:
        self.fleet = fleet
        self.session = session
        self.config = config
        self.metrics = metrics
        self.loop_lag = loop_lag
        self._running: set[asyncio.Task[None]] = set()  # probes out (kept from the GC)

    async def run(self) -> None:
        """Probe every replica due, forever (a task of the router)."""
        while True:
            await asyncio.sleep(PROBE_TICK_S)
            for rid in self.fleet.health.probes_due(time.monotonic()):
                task = asyncio.create_task(self.probe(rid))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    def request(self, replica_id: str) -> tuple[str, dict[str, Any], dict[str, str]]:
        """The probe of ``replica_id``: URL, JSON body and headers. Raises ``KeyError`` for a
        replica no longer in the fleet."""
        replica = self.fleet.replicas[replica_id]
        body: dict[str, Any] = {"prompt": PROBE_PROMPT, "max_tokens": 1, "stream": False}
        model = min(replica.models) if replica.models else self.config.model
        if model is not None:
            body["model"] = model
        headers = {PROBE_HEADER: "half-open"}
        if replica.dp_rank is not None:
            headers[DP_RANK_HEADER] = str(replica.dp_rank)
        return replica.url + "/v1/completions", body, headers

    async def probe(self, replica_id: str) -> None:
        """Probe ``replica_id`` once and report the outcome (``ReplicaHealth.probe_done``)."""
        cfg = self.config
        started = time.monotonic()
        ok: bool | None
        try:
            url, body, headers = self.request(replica_id)
        except KeyError:
            return  # it left the fleet (its breaker went with it)
        # (the connect timeout is the session's connector's: router.edges.upstream_connector)
        timeout = aiohttp.ClientTimeout(total=cfg.first_byte_deadline_floor_s)
        try:
            async with self.session.post(url, json=body, headers=headers,
                                         timeout=timeout) as resp:
                problem = probe_verdict(resp.status, await resp.read())
                ok, failure = problem is None, problem or ""
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            late = self.loop_lag is not None and self.loop_lag.late(started, time.monotonic())
            ok, failure = (None if late else False), f"no answer ({exc.__class__.__name__})"
        except aiohttp.ClientError as exc:
            ok, failure = False, str(exc) or exc.__class__.__name__
            if isinstance(exc, aiohttp.ClientConnectorError) and connect_refused(exc):
                self.fleet.health.record_refused(replica_id, time.monotonic())
        result = "ok" if ok else "failed" if ok is False else "router_late"
        self.metrics.child(self.metrics.circuit_probes, replica_id, result).inc()
        if ok is None:
            self.metrics.child(self.metrics.loop_late, "probe_timeout").inc()
        self.fleet.health.probe_done(replica_id, time.monotonic(), ok)
        if ok:
            logger.info("replica %s answered its half-open probe: circuit closed", replica_id)
        elif ok is False:
            logger.warning("replica %s failed its half-open probe (%s): circuit open again",
                           replica_id, failure)
