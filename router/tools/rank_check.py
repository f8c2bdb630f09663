"""Static data-parallel targets checked against their engine's ranks. HTTP edge (aiohttp).

A static ``--replica URL#RANK`` names one rank of an engine started with vLLM's
``--data-parallel-size N``; a rank at or beyond N passes ``/health`` (the engine is fine) but
every request sent to it is the engine's 400 ("data_parallel_rank R is out of range"), which
opens no circuit. ``StaticRankCheck`` asks each such engine's ``GET /kv_event_sources`` (vLLM
0.33 lists each ready rank; ``router.shared.kv_event_sources``) and sets ``Replica.rank_problem`` on a
target whose rank is not listed, which takes it out of routing (``Fleet.routable_problem``,
shown in ``/ready``) until a later check lists it. An engine that does not answer the list
(404: an older vLLM, or another server) or lists no rank (KV events off) leaves its targets
as they were: routable unless an earlier answer said otherwise.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from router.decision.fleet import Fleet, Replica
from router.shared.kv_event_sources import parse_kv_event_sources

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 2.0  # as the /health probe's


class StaticRankCheck:
    """Checks the static replicas that name a data-parallel rank, engine by engine, every
    ``interval_s`` seconds (``static_probe_interval_s``)."""

    def __init__(self, fleet: Fleet, session: aiohttp.ClientSession, interval_s: float) -> None:
        self.fleet = fleet
        self.session = session
        self.interval_s = interval_s

    def targets(self) -> dict[str, list[Replica]]:
        """``{engine URL: its static replicas that name a rank}``."""
        by_engine: dict[str, list[Replica]] = {}
        for replica in self.fleet.replicas.values():
            if replica.static and replica.dp_rank is not None:
                by_engine.setdefault(replica.url, []).append(replica)
        return by_engine

    async def check_once(self) -> None:
        await asyncio.gather(*(self._check(url, replicas)
                               for url, replicas in self.targets().items()))

    async def _check(self, url: str, replicas: list[Replica]) -> None:
        try:
            async with self.session.get(f"{url}/kv_event_sources",
                                        timeout=aiohttp.ClientTimeout(total=CHECK_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    ranks = None  # not listed by this engine: nothing to check against
                else:
                    body = await resp.json(content_type=None)
                    ranks = sorted({s.dp_rank for s in parse_kv_event_sources(body, url)}) or None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            # unreachable or garbled: the /health probe judges reachability; keep the verdict
            logger.debug("engine %s: GET /kv_event_sources failed: %s", url, exc)
            return
        for replica in replicas:
            problem = None
            if ranks is not None and replica.dp_rank not in ranks:
                problem = (f"data-parallel rank {replica.dp_rank} is not one of the engine's "
                           f"ranks {ranks} (GET /kv_event_sources)")
            if problem != replica.rank_problem:
                if problem is None:
                    logger.info("static replica %s: the engine lists rank %d now: routable",
                                replica.replica_id, replica.dp_rank)
                else:
                    logger.warning("static replica %s is not routable: %s; check its --replica "
                                   "URL's #RANK", replica.replica_id, problem)
            replica.rank_problem = problem

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_once()
