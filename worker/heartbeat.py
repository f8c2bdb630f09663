"""Heartbeat: the engine's models, cache config and load, refreshed in Redis every ~1 s. Does I/O (HTTP, Redis).

Reads the engine's ``GET /v1/models`` (served models, LoRA cards: ``root`` is the
adapter path, ``parent`` the base model) and ``GET /metrics`` (vLLM 0.33 names:
``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries_total``,
``vllm:prefix_cache_hits_total``, and the ``block_size``,
``prefix_caching_hash_algo`` and ``num_gpu_blocks`` labels of
``vllm:cache_config_info``, and the current series of ``vllm:lora_requests_info``:
``router.apis.lora_load``), parsed with prometheus-client's text parser, then
writes the ``F_*`` fields of ``router/contract.py`` to ``{prefix}:{r}:replica``
with a TTL of ``HEARTBEAT_TTL_S``. An engine that fails ``ENGINE_FAILURES``
polls in a row stops the heartbeat, so the key expires and routers take the
replica out; fewer failures (a busy engine slow to answer ``/metrics``) keep the
heartbeat going on the last load seen, and a poll slower than the heartbeat
interval does not delay the heartbeat. The parsing functions are pure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.shared import contract
from router.shared.lora_state import LORA_INFO_METRIC, LoraLoad, current_lora_load
from worker.redis_writer import REDIS_ERRORS, RedisOutOfMemory, RedisWriter

logger = logging.getLogger(__name__)

MODELS_REFRESH_S: Final = 5.0  # served models and LoRA adapters change rarely
ENGINE_TIMEOUT_S: Final = 2.0  # per engine HTTP request
ENGINE_FAILURES: Final = 3  # consecutive failed polls before the heartbeat stops (Kubernetes'
# failureThreshold default): one slow /metrics of a busy engine is not an outage


class EngineUnreachable(RuntimeError):
    """The engine did not answer ``/v1/models`` or ``/metrics`` (or answered garbage)."""


@dataclass(frozen=True, slots=True)
class EngineModels:
    """Served base models and LoRA adapters ``{lora_name: lora_path}``."""

    models: tuple[str, ...]
    lora_adapters: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One ``/metrics`` scrape. ``block_size``/``hash_algo``/``num_gpu_blocks`` are None if not exposed."""

    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    prefix_cache_queries: float = 0.0  # tokens, counter
    prefix_cache_hits: float = 0.0  # tokens, counter
    block_size: int | None = None
    hash_algo: str | None = None
    num_gpu_blocks: int | None = None
    # creation time (unix s) of the prefix-cache counter (prometheus_client's ``_created``
    # sample): a new value means a new engine process, even when its counters have already
    # grown past the old ones; None if not exposed
    counters_created: float | None = None
    lora: LoraLoad | None = None  # vllm:lora_requests_info's current series; None: not exposed


def parse_models(body: Any) -> EngineModels:
    """OpenAI ``/v1/models`` body -> models and LoRA adapters.

    vLLM 0.33 ``serving_models``: a LoRA card has ``root`` = the adapter path and
    ``parent`` = the base model; a base card has ``parent`` null.
    Raises ``ValueError`` for a body of another shape.
    """
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise ValueError("models body has no 'data' list")
    models: list[str] = []
    loras: dict[str, str] = {}
    for card in body["data"]:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            raise ValueError(f"bad model card {card!r:.80}")
        if card.get("parent"):
            loras[card["id"]] = str(card.get("root") or "")
        else:
            models.append(card["id"])
    return EngineModels(tuple(models), loras)


_SAMPLES: Final = {
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
}


_CREATED_SAMPLE: Final = "vllm:prefix_cache_queries_created"
_WANTED_PREFIXES: Final = (*_SAMPLES, "vllm:cache_config_info", _CREATED_SAMPLE,
                           LORA_INFO_METRIC)


def parse_metrics(text: str, engine: str | None = None) -> EngineLoad:
    """Prometheus text of the engine's ``/metrics`` -> ``EngineLoad``.

    Sums over engines/models, except ``kv_usage`` (the maximum). ``engine``: only the series
    of that engine (a data-parallel rank; vLLM labels each rank's series ``engine="<rank>"``,
    ``vllm/v1/metrics/loggers.py``); ``vllm:lora_requests_info`` has no ``engine`` label (one
    series for the API server) and is read whatever ``engine``. Raises ``ValueError`` when a line of those metrics is
    malformed.
    """
    values: dict[str, float] = {}
    cache_labels: dict[str, str] = {}
    created: float | None = None
    lora_samples: list[tuple[dict[str, str], float]] = []
    # only the samples used here go through the (slow, pure-Python) parser: an engine exposes
    # hundreds of histogram lines per heartbeat
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED_PREFIXES))
    for family in text_string_to_metric_families(wanted + "\n"):
        for sample in family.samples:
            if sample.name == LORA_INFO_METRIC:
                lora_samples.append((sample.labels, sample.value))
                continue
            if engine is not None and sample.labels.get("engine") != engine:
                continue
            name = _SAMPLES.get(sample.name)
            if name == "kv_usage":
                values[name] = max(values.get(name, 0.0), sample.value)
            elif name is not None:
                values[name] = values.get(name, 0.0) + sample.value
            elif sample.name == "vllm:cache_config_info" and not cache_labels:
                cache_labels = dict(sample.labels)
            elif sample.name == _CREATED_SAMPLE:
                created = max(created or 0.0, sample.value)

    def label_int(label: str) -> int | None:
        try:
            return int(cache_labels[label])
        except (KeyError, ValueError):
            return None

    return EngineLoad(
        block_size=label_int("block_size"),
        hash_algo=cache_labels.get("prefix_caching_hash_algo") or None,
        num_gpu_blocks=label_int("num_gpu_blocks"),
        counters_created=created,
        lora=current_lora_load(lora_samples),
        **values,
    )


def _number(value: float) -> int | float:
    """Counts as ints ("33", not "33.0") when integral."""
    return int(value) if value.is_integer() else value


def heartbeat_fields(*, replica_id: str, url: str, models: EngineModels, load: EngineLoad,
                     seed_fingerprint: str, hash_verified: str, key_mode: str,
                     num_blocks: int, now_s: float, index_stride: int = 1,
                     dp_rank: int | None = None,
                     kv_tiers: str = contract.TIER_GPU) -> dict[str, str | int | float]:
    """The ``F_*`` fields of one heartbeat except epoch/seq (the writer adds the committed ones).
    ``dp_rank``: the engine's data-parallel rank this replica is (None: no data parallelism);
    ``kv_tiers``: the tiers the worker indexes (``router.shared.contract.TIERS``, comma-separated)."""
    return {
        contract.F_REPLICA_ID: replica_id,
        contract.F_URL: url,
        contract.F_DP_RANK: "" if dp_rank is None else dp_rank,
        contract.F_MODELS: json.dumps(list(models.models)),
        contract.F_LORA_ADAPTERS: json.dumps(dict(models.lora_adapters)),
        contract.F_BLOCK_SIZE: "" if load.block_size is None else load.block_size,
        contract.F_HASH_ALGO: load.hash_algo or "",
        contract.F_SEED_FINGERPRINT: seed_fingerprint,
        contract.F_HASH_VERIFIED: hash_verified,
        contract.F_KEY_MODE: key_mode,
        contract.F_CONTRACT: contract.CONTRACT_VERSION,
        contract.F_INDEX_STRIDE: index_stride,
        contract.F_KV_TIERS: kv_tiers,
        contract.F_NUM_RUNNING: _number(load.num_running),
        contract.F_NUM_WAITING: _number(load.num_waiting),
        contract.F_KV_USAGE: load.kv_usage,
        contract.F_PREFIX_CACHE_QUERIES: _number(load.prefix_cache_queries),
        contract.F_PREFIX_CACHE_HITS: _number(load.prefix_cache_hits),
        contract.F_NUM_BLOCKS: num_blocks,
        contract.F_NUM_GPU_BLOCKS: "" if load.num_gpu_blocks is None else load.num_gpu_blocks,
        contract.F_HEARTBEAT_TS: now_s,
        **lora_fields(load.lora),
    }


def lora_fields(lora: LoraLoad | None) -> dict[str, str | int]:
    """The heartbeat's LoRA fields (``F_LORA_*``, ``F_MAX_LORA``): "" each when not reported."""
    if lora is None:
        return {contract.F_LORA_RUNNING: "", contract.F_LORA_WAITING: "", contract.F_MAX_LORA: ""}
    return {contract.F_LORA_RUNNING: ",".join(sorted(lora.running)),
            contract.F_LORA_WAITING: ",".join(sorted(lora.waiting)),
            contract.F_MAX_LORA: "" if lora.max_lora is None else lora.max_lora}


class EngineClient:
    """HTTP client of the engine's ``/v1/models``, ``/metrics``, ``/v1/completions`` and
    ``/kv_event_sources``. ``dp_rank``: the data-parallel rank this client speaks for (its
    ``engine`` label in ``/metrics``, vLLM's ``X-data-parallel-rank`` header on completions);
    None for an engine without data parallelism."""

    def __init__(self, session: aiohttp.ClientSession, engine_url: str,
                 dp_rank: int | None = None) -> None:
        self.session = session
        self.engine_url = engine_url.rstrip("/")
        self.dp_rank = dp_rank
        self._timeout = aiohttp.ClientTimeout(total=ENGINE_TIMEOUT_S)

    async def _get(self, path: str) -> str:
        try:
            async with self.session.get(self.engine_url + path, timeout=self._timeout) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise EngineUnreachable(f"GET {path}: HTTP {resp.status}")
                return text
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnreachable(f"GET {path}: {exc!r}") from exc

    async def models(self) -> EngineModels:
        """Raises ``EngineUnreachable``."""
        text = await self._get("/v1/models")
        try:
            return parse_models(json.loads(text))
        except ValueError as exc:
            raise EngineUnreachable(f"GET /v1/models: {exc}") from exc

    async def load(self) -> EngineLoad:
        """Raises ``EngineUnreachable``."""
        text = await self._get("/metrics")
        try:
            return parse_metrics(text, None if self.dp_rank is None else str(self.dp_rank))
        except ValueError as exc:
            raise EngineUnreachable(f"GET /metrics: {exc}") from exc

    async def complete(self, model: str, prompt: list[int], timeout_s: float) -> None:
        """POST a token-id completion with ``max_tokens`` 1. Raises ``EngineUnreachable``."""
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        headers = {} if self.dp_rank is None else {contract.DP_RANK_HEADER: str(self.dp_rank)}
        try:
            async with self.session.post(self.engine_url + "/v1/completions", json=body,
                                         headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise EngineUnreachable(f"POST /v1/completions: HTTP {resp.status}: {text:.200}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnreachable(f"POST /v1/completions: {exc!r}") from exc

    async def kv_event_sources(self) -> Any:
        """The JSON body of ``GET /kv_event_sources``. Raises ``EngineUnreachable``."""
        text = await self._get("/kv_event_sources")
        try:
            return json.loads(text)
        except ValueError as exc:
            raise EngineUnreachable(f"GET /kv_event_sources: {exc}") from exc


class Heartbeat:
    """Polls the engine and refreshes the heartbeat every ``interval_s``.

    ``fields`` returns the worker-side fields (hash_verified, key_mode,
    seed_fingerprint, num_blocks); ``on_engine`` is told every successful poll.
    ``engine_up`` is False after ``engine_failures`` failed polls in a row (the
    heartbeat then stops); before that, and while a poll is slower than
    ``interval_s``, the heartbeat is written with the last load seen.
    """

    def __init__(self, engine: EngineClient, writer: RedisWriter, *, replica_id: str, url: str,
                 fields: Callable[[], dict[str, str | int]],
                 on_engine: Callable[[EngineModels, EngineLoad], None],
                 interval_s: float = contract.HEARTBEAT_INTERVAL_S,
                 ttl_s: float = contract.HEARTBEAT_TTL_S,
                 engine_failures: int = ENGINE_FAILURES) -> None:
        self.engine = engine
        self.writer = writer
        self.replica_id = replica_id
        self.url = url
        self.fields = fields
        self.on_engine = on_engine
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.engine_failures = engine_failures
        self.failed_polls = 0  # consecutive
        self.engine_up = False
        self.models: EngineModels | None = None
        self.load: EngineLoad | None = None
        self.previous_load: EngineLoad | None = None  # the poll before ``load``
        self.num_beats = 0
        self.num_engine_errors = 0
        self.num_redis_errors = 0
        self.wake = asyncio.Event()  # set to beat early (e.g. after an epoch change)
        self._models_at = 0.0

    async def _poll(self) -> tuple[EngineModels, EngineLoad]:
        """Raises ``EngineUnreachable``."""
        now = time.monotonic()
        if self.models is None or now - self._models_at >= MODELS_REFRESH_S:
            models, load = await asyncio.gather(self.engine.models(), self.engine.load())
            self._models_at = now
            return models, load
        return self.models, await self.engine.load()

    async def beat(self) -> bool:
        """One poll + write. Returns True when the heartbeat was written."""
        poll = asyncio.ensure_future(self._poll())
        try:
            try:
                models, load = await asyncio.wait_for(asyncio.shield(poll), self.interval_s)
            except TimeoutError:
                # a slow engine: keep the replica alive on the last load while the poll runs
                if self.engine_up and self.failed_polls + 1 < self.engine_failures:
                    await self._write(self.models, self.load)
                models, load = await poll
        except EngineUnreachable as exc:
            self.num_engine_errors += 1
            self.failed_polls += 1
            if self.engine_up and self.failed_polls < self.engine_failures:
                logger.warning("engine poll failed (%s), %d of %d in a row: heartbeat kept",
                               exc, self.failed_polls, self.engine_failures)
                return await self._write(self.models, self.load)
            if self.engine_up:
                logger.error("engine unreachable (%s): heartbeat stopped, replica will expire", exc)
            self.engine_up = False
            self.models = None
            return False
        finally:
            poll.cancel()
        self.failed_polls = 0
        self.previous_load, self.models, self.load = self.load, models, load
        if not self.engine_up:
            logger.info("engine %s is up: %s, block_size=%s, hash_algo=%s", self.engine.engine_url,
                        list(models.models), load.block_size, load.hash_algo)
        self.engine_up = True
        self.on_engine(models, load)
        return await self._write(models, load)

    async def _write(self, models: EngineModels | None, load: EngineLoad | None) -> bool:
        if models is None or load is None:
            return False
        fields = heartbeat_fields(replica_id=self.replica_id, url=self.url, models=models,
                                  load=load, now_s=time.time(), dp_rank=self.engine.dp_rank,
                                  **self.fields())  # type: ignore[arg-type]
        try:
            await self.writer.write_heartbeat(fields, self.ttl_s)
        except RedisOutOfMemory:
            self.num_redis_errors += 1  # the writer logs out-of-memory refusals, rate-limited
            return False
        except REDIS_ERRORS as exc:
            self.num_redis_errors += 1
            logger.warning("heartbeat write failed: %s", exc)
            return False
        self.num_beats += 1
        return True

    async def run(self) -> None:
        """Beat every ``interval_s`` until cancelled."""
        while True:
            try:
                await self.beat()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("heartbeat failed unexpectedly; continuing")
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), self.interval_s)
            except TimeoutError:
                pass
