"""``prefix-loadtest fidelity``: the emulator against a real vLLM engine, request for request and
event for event. Does process, network and file I/O (the comparison itself is pure).

One request sequence (``synthetic_workload``: system prompts, shared documents and random
suffixes over tenants; or ``trace_workload``: a slice of a Mooncake trace) goes to a fresh
emulator and to a fresh vLLM CPU engine (``loadtest.harness.vllm_engine``) started with the same
capacity and scheduler flags (block size, ``--num-gpu-blocks-override``,
``--max-num-batched-tokens``, ``--max-num-seqs``, ``--max-model-len``, hash algorithm and
``PYTHONHASHSEED``). Both publish KV events, which a subscriber per engine records (completed
through the replay socket if the subscriber missed a batch). ``compare`` then reports:

* per request, ``usage.prompt_tokens_details.cached_tokens`` of each engine
  (``--enable-prompt-tokens-details``) and whether they agree;
* whether the sequences of stored block hashes (``BlockStored``, block by block), of removed
  block hashes (``BlockRemoved``) and of all events are identical, and where they first differ.

Requests go one at a time by default (``concurrency`` 1): each engine then schedules exactly the
same steps, so any difference is a rule the emulator gets wrong. With ``concurrency`` > 1 which
requests share a step depends on each engine's own step times (a CPU vLLM's steps last far longer
than the emulated GPU's), so differences there are expected and do not by themselves show a
wrong rule. ``max_tokens`` 1 (the default) stores prompt blocks only; with more output tokens
the blocks the output fills hold vLLM's sampled tokens (random weights) on one side and the
emulator's own on the other, so their hashes differ by construction: such blocks are then
compared by position (``flatten``'s ``prompt_keys``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
import zmq

from loadtest.harness import processes
from loadtest.harness.vllm_engine import (
    KVEventTap,
    make_model_dir,
    start_vllm_engine,
    unavailable_reason,
)
from loadtest.replay.trace import read_trace
from router.shared.hashing import BlockHasher, block_keys
from router.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    event_hash_key,
)
from router.tools.trace_format import TokenMapper

DEFAULT_NUM_REQUESTS: Final = 120
DEFAULT_BLOCK_SIZE: Final = 32  # tokens; the least block size vLLM's CPU attention accepts
DEFAULT_NUM_GPU_BLOCKS: Final = 160  # small enough that the synthetic workload evicts
# vLLM's defaults for its OpenAI server on a CPU (vllm/engine/arg_utils.py get_batch_defaults),
# passed explicitly to both engines
DEFAULT_MAX_NUM_BATCHED_TOKENS: Final = 2048
DEFAULT_MAX_NUM_SEQS: Final = 128
DEFAULT_MAX_MODEL_LEN: Final = 4096  # tokens; must fit the pool (160 blocks of 32 = 5,120)
VOCAB_LOW: Final = 1000  # token ids drawn from [VOCAB_LOW, VOCAB_HIGH): plain Qwen3 tokens
VOCAB_HIGH: Final = 100_000
EVENTS_QUIET_S: Final = 2.0  # no new batch for this long after the last answer: all are in
EVENTS_WAIT_S: Final = 60.0  # at most this long for the last batches
REQUEST_TIMEOUT_S: Final = 600.0  # a CPU engine prefilling 4k tokens on a busy machine
REPLAY_END_SEQ: Final = b"\xff" * 8
EMULATOR_MODEL: Final = "emulated-llm"


@dataclass(frozen=True, slots=True)
class FidelityConfig:
    """The flags both engines get and how the sequence is sent."""

    block_size: int = DEFAULT_BLOCK_SIZE
    num_gpu_blocks: int = DEFAULT_NUM_GPU_BLOCKS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    max_tokens: int = 1  # output tokens per request
    concurrency: int = 1  # requests in flight per engine; 1 = one at a time
    hash_algo: str = "sha256"
    hash_seed: str = "0"  # PYTHONHASHSEED of both engines

    def engine_flags(self) -> list[str]:
        """Scheduler and cache flags, spelled as both ``vllm serve`` and the emulator take them."""
        return ["--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--max-num-seqs", str(self.max_num_seqs),
                "--max-model-len", str(self.max_model_len)]


# ------------------------------------------------------------------------------------ workloads


def synthetic_workload(num_requests: int = DEFAULT_NUM_REQUESTS, seed: int = 0,
                       max_prompt_tokens: int = DEFAULT_MAX_MODEL_LEN - 1,
                       num_system_prompts: int = 6, num_documents: int = 4) -> list[list[int]]:
    """A seeded multi-tenant sequence of token-id prompts: each request is one of
    ``num_system_prompts`` system prompts (200-1,300 tokens), then with probability 0.6 one of
    ``num_documents`` shared documents (300-1,500 tokens), then a random suffix (20-400 tokens),
    cut to ``max_prompt_tokens``. Popular system prompts and documents recur (Zipf-like
    weights), so hits, partial hits and evictions all occur on a 160-block pool."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

    systems = [tokens(rng.randint(200, 1300)) for _ in range(num_system_prompts)]
    documents = [tokens(rng.randint(300, 1500)) for _ in range(num_documents)]
    system_weights = [1.0 / (i + 1) for i in range(num_system_prompts)]
    document_weights = [1.0 / (i + 1) for i in range(num_documents)]
    prompts: list[list[int]] = []
    for _ in range(num_requests):
        prompt = list(rng.choices(systems, system_weights)[0])
        if rng.random() < 0.6:
            prompt += rng.choices(documents, document_weights)[0]
        prompt += tokens(rng.randint(20, 400))
        prompts.append(prompt[:max_prompt_tokens])
    return prompts


def trace_workload(path: Path, start: int = 0, limit: int = DEFAULT_NUM_REQUESTS,
                   max_prompt_tokens: int = DEFAULT_MAX_MODEL_LEN - 1,
                   token_seed: int = 0) -> list[list[int]]:
    """The token-id prompts (``TokenMapper``, as ``replay`` sends them) of the first ``limit``
    requests from line ``start`` on of a Mooncake trace whose prompt has at most
    ``max_prompt_tokens`` tokens (longer ones are skipped: neither engine would take them)."""
    mapper = TokenMapper(token_seed)
    prompts: list[list[int]] = []
    for request in read_trace(path, start=start):
        if request.input_length <= max_prompt_tokens:
            prompts.append(mapper.request_prompt(request))
            if len(prompts) >= limit:
                break
    return prompts


# ------------------------------------------------------------------------------------ one engine


@dataclass(slots=True)
class EngineRun:
    """What one engine did with the sequence: ``cached_tokens[i]`` of request ``i`` (None when
    it failed, its error in ``errors``), and every KV-event batch it published, in order."""

    name: str
    cached_tokens: list[int | None]
    batches: list[KVEventBatch]
    errors: list[str] = field(default_factory=list)
    missed_batches: int = 0  # batches the subscriber missed and the replay socket supplied


def save_run(run: EngineRun, path: Path, prompts: Sequence[list[int]],
             config: FidelityConfig) -> None:
    """Write ``run`` (batches as base64 msgpack, as published) with what it was run on, so a
    later emulator can be compared with it without starting vLLM again (``load_run``)."""
    path.write_text(json.dumps({
        "name": run.name, "cached_tokens": run.cached_tokens, "errors": run.errors,
        "missed_batches": run.missed_batches, "workload_digest": workload_digest(prompts),
        "config": asdict(config),
        "batches": [base64.b64encode(encode_batch(b)).decode() for b in run.batches]}))


def load_run(path: Path, prompts: Sequence[list[int]], config: FidelityConfig) -> EngineRun:
    """The run ``save_run`` wrote to ``path``. Raises ``ValueError`` when it was run on another
    workload or with other engine flags (a comparison would be meaningless)."""
    data = json.loads(path.read_text())
    if data["workload_digest"] != workload_digest(prompts):
        raise ValueError(f"{path} was recorded on another workload")
    recorded = {k: v for k, v in data["config"].items() if k != "concurrency"}
    if recorded != {k: v for k, v in asdict(config).items() if k != "concurrency"}:
        raise ValueError(f"{path} was recorded with other flags: {data['config']}")
    return EngineRun(data["name"], data["cached_tokens"],
                     [decode_batch(base64.b64decode(b)) for b in data["batches"]],
                     data["errors"], data["missed_batches"])


def workload_digest(prompts: Sequence[list[int]]) -> str:
    """SHA-256 of the prompts' token ids, in order."""
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(json.dumps(prompt).encode())
    return digest.hexdigest()


async def _send_sequence(url: str, model: str, prompts: Sequence[list[int]],
                         config: FidelityConfig) -> tuple[list[int | None], list[str]]:
    """POST every prompt to ``url``/v1/completions in order, at most ``config.concurrency`` in
    flight; returns each request's cached tokens and the errors."""
    cached: list[int | None] = [None] * len(prompts)
    errors: list[str] = []
    gate = asyncio.Semaphore(config.concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async def one(session: aiohttp.ClientSession, index: int, prompt: list[int]) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": config.max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        try:
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                answer = await resp.json(content_type=None)
                if resp.status != 200:
                    errors.append(f"request {index}: HTTP {resp.status}: {answer}")
                    return
            details = answer["usage"].get("prompt_tokens_details") or {}
            cached[index] = int(details.get("cached_tokens") or 0)
        except (TimeoutError, aiohttp.ClientError, KeyError, ValueError) as exc:
            errors.append(f"request {index}: {exc!r}")
        finally:
            gate.release()

    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = []
        for index, prompt in enumerate(prompts):
            await gate.acquire()  # sends in order: request i+1 leaves after request i
            tasks.append(asyncio.create_task(one(session, index, prompt)))
        await asyncio.gather(*tasks)
    return cached, errors


def replay_batches(endpoint: str, start_seq: int = 0, timeout_s: float = 30.0,
                   ) -> dict[int, KVEventBatch]:
    """Every batch an engine still buffers from ``start_seq`` on, through its replay (ROUTER)
    socket: ``{seq: batch}``. Raises ``TimeoutError`` when the engine does not answer."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: dict[int, KVEventBatch] = {}
        while True:
            try:
                frames = sock.recv_multipart()
            except zmq.Again as exc:
                raise TimeoutError(f"no replay from {endpoint} in {timeout_s} s") from exc
            if frames[2] == REPLAY_END_SEQ:
                return out
            out[int.from_bytes(frames[2], "big")] = decode_batch(frames[3])
    finally:
        sock.close(linger=0)
        ctx.term()


def run_engine(name: str, url: str, model: str, events_endpoint: str,
               replay_endpoint: str | None, prompts: Sequence[list[int]],
               config: FidelityConfig) -> EngineRun:
    """Send ``prompts`` to a running engine while recording its KV events; the batches the
    subscriber missed (ZMQ's slow joiner, a dropped message) come from the replay socket."""
    subscriber = KVEventTap(events_endpoint)
    try:
        time.sleep(1.0)  # let the subscription reach the publisher before the first event
        cached, errors = asyncio.run(_send_sequence(url, model, prompts, config))
        subscriber.wait_quiet(EVENTS_QUIET_S, EVENTS_WAIT_S)
        batches = dict(subscriber.batches)  # {seq: batch}
    finally:
        subscriber.close()
    missed = 0
    expected = set(range(max(batches, default=-1) + 1))
    if replay_endpoint is not None and (expected - batches.keys() or not batches):
        replayed = replay_batches(replay_endpoint)
        missed = len(replayed.keys() - batches.keys())
        batches.update(replayed)
    gaps = set(range(max(batches, default=-1) + 1)) - batches.keys()
    if gaps:
        errors.append(f"{len(gaps)} KV-event batches lost (first seq {min(gaps)})")
    return EngineRun(name, cached, [batches[s] for s in sorted(batches)], errors, missed)


# ------------------------------------------------------------------------------------ comparison


EventKey = tuple[str, int | str | None]  # ("stored" | "removed" | "cleared", block key or name)


def flatten(batches: Sequence[KVEventBatch],
            prompt_keys: Set[int] | None = None) -> list[EventKey]:
    """The GPU events of ``batches`` block by block: one ``("stored", key)`` per block of a
    BlockStored, one ``("removed", key)`` per hash of a BlockRemoved, ``("cleared", None)`` per
    AllBlocksCleared (keys as the router indexes them, ``event_hash_key``).

    With ``prompt_keys`` (the keys of every full prompt block sent), a block that is not one
    of them holds output tokens, which differ between the engines: it is named by its parent
    instead (``"<parent>+o"``), so that the two engines' sequences compare by structure."""
    out: list[EventKey] = []
    names: dict[int, int | str] = {}  # {block key: its name}

    def name(key: int, parent: int | str | None) -> int | str:
        if prompt_keys is None or key in prompt_keys:
            return key
        return f"{parent}+o"

    for batch in batches:
        for event in batch.events:
            if getattr(event, "medium", "GPU") not in (None, "GPU"):
                continue
            if isinstance(event, BlockStored):
                parent: int | str | None = None
                if event.parent_block_hash is not None:
                    parent_key = event_hash_key(event.parent_block_hash)
                    parent = names.get(parent_key, parent_key)
                for h in event.block_hashes:
                    key = event_hash_key(h)
                    parent = names[key] = name(key, parent)
                    out.append(("stored", parent))
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    key = event_hash_key(h)
                    out.append(("removed", names.get(key, key)))
            elif isinstance(event, AllBlocksCleared):
                out.append(("cleared", None))
    return out


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first index where ``a`` and ``b`` differ (``min(len)`` when one is a prefix of the
    other and they differ in length), None when they are equal."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def _sequence_report(name: str, a: Sequence[Any], b: Sequence[Any]) -> dict[str, Any]:
    index = first_difference(a, b)
    report: dict[str, Any] = {"name": name, "identical": index is None,
                              "emulator_len": len(a), "vllm_len": len(b)}
    if index is not None:
        report["first_difference"] = index
        report["emulator_at"] = [list(x) if isinstance(x, tuple) else x for x in a[index:index + 3]]
        report["vllm_at"] = [list(x) if isinstance(x, tuple) else x for x in b[index:index + 3]]
    return report


def _counts(batches: Sequence[KVEventBatch]) -> dict[str, int]:
    counts = {"batches": len(batches), "BlockStored": 0, "blocks_stored": 0, "BlockRemoved": 0,
              "AllBlocksCleared": 0}
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                counts["BlockStored"] += 1
                counts["blocks_stored"] += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                counts["BlockRemoved"] += 1
            elif isinstance(event, AllBlocksCleared):
                counts["AllBlocksCleared"] += 1
    return counts


def compare(emulator: EngineRun, vllm: EngineRun, prompt_lengths: Sequence[int],
            prompt_keys: Set[int] | None = None) -> dict[str, Any]:
    """The fidelity report of two runs of the same sequence (pure): ``agree`` requests of
    ``requests`` with equal cached tokens, ``mismatches`` (index, prompt tokens, each engine's
    cached tokens), totals, event counts, and per sequence (``stored``: stored block keys in
    order; ``removed``: removed block keys in order; ``events``: both interleaved) whether it is
    identical and where it first differs. ``identical`` is the overall verdict. ``prompt_keys``:
    see ``flatten`` (output blocks compared by position)."""
    pairs = list(zip(emulator.cached_tokens, vllm.cached_tokens, strict=True))
    mismatches = [{"request": i, "prompt_tokens": prompt_lengths[i], "emulator": e, "vllm": v}
                  for i, (e, v) in enumerate(pairs) if e != v or e is None]
    emu_events = flatten(emulator.batches, prompt_keys)
    vllm_events = flatten(vllm.batches, prompt_keys)
    sequences = [
        _sequence_report("stored", [k for t, k in emu_events if t == "stored"],
                         [k for t, k in vllm_events if t == "stored"]),
        _sequence_report("removed", [k for t, k in emu_events if t == "removed"],
                         [k for t, k in vllm_events if t == "removed"]),
        _sequence_report("events", emu_events, vllm_events),
    ]
    errors = [f"emulator: {e}" for e in emulator.errors] + [f"vllm: {e}" for e in vllm.errors]
    return {
        "requests": len(pairs),
        "agree": len(pairs) - len(mismatches),
        "mismatches": mismatches,
        "cached_tokens_total": {"emulator": sum(e or 0 for e, _ in pairs),
                                "vllm": sum(v or 0 for _, v in pairs)},
        "counts": {"emulator": _counts(emulator.batches), "vllm": _counts(vllm.batches)},
        "missed_batches": {"emulator": emulator.missed_batches, "vllm": vllm.missed_batches},
        "sequences": sequences,
        "errors": errors,
        "identical": not mismatches and not errors and all(s["identical"] for s in sequences),
    }


def prompt_block_keys(prompts: Sequence[list[int]], config: FidelityConfig) -> set[int]:
    """The keys of every full block of ``prompts``, hashed as both engines hash them."""
    hasher = BlockHasher(config.block_size, config.hash_algo, config.hash_seed)
    return {key for prompt in prompts for key in block_keys(hasher.digests(prompt))}


def format_report(report: dict[str, Any], config: FidelityConfig, workload: str) -> str:
    """The report as a few lines of text for the terminal."""
    lines = [
        f"fidelity: {workload}; block size {config.block_size}, {config.num_gpu_blocks} blocks, "
        f"max_num_batched_tokens {config.max_num_batched_tokens}, max_num_seqs "
        f"{config.max_num_seqs}, max_tokens {config.max_tokens}, concurrency {config.concurrency}",
        f"cached_tokens agree on {report['agree']} of {report['requests']} requests "
        f"(emulator {report['cached_tokens_total']['emulator']:,} cached tokens in all, "
        f"vLLM {report['cached_tokens_total']['vllm']:,})",
    ]
    for m in report["mismatches"][:10]:
        lines.append(f"  request {m['request']} ({m['prompt_tokens']} prompt tokens): emulator "
                     f"{m['emulator']}, vLLM {m['vllm']}")
    emu, real = report["counts"]["emulator"], report["counts"]["vllm"]
    lines.append("events (emulator / vLLM): " + ", ".join(
        f"{k} {emu[k]:,} / {real[k]:,}" for k in emu))
    for seq in report["sequences"]:
        if seq["identical"]:
            lines.append(f"{seq['name']} sequence: identical ({seq['emulator_len']:,} entries)")
        else:
            lines.append(f"{seq['name']} sequence: differs at {seq['first_difference']:,} "
                         f"(lengths {seq['emulator_len']:,} / {seq['vllm_len']:,}); emulator "
                         f"{seq['emulator_at']}, vLLM {seq['vllm_at']}")
    lines.extend(report["errors"][:10])
    lines.append("IDENTICAL" if report["identical"] else "DIFFERENT")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ engines


def run_emulator(prompts: Sequence[list[int]], config: FidelityConfig,
                 log_dir: Path) -> EngineRun:
    """A fresh emulator with ``config``'s flags, given ``prompts``; stopped afterwards."""
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}
    args = ["--block-size", str(config.block_size),
            "--num-gpu-blocks-override", str(config.num_gpu_blocks),
            "--prefix-caching-hash-algo", config.hash_algo,
            "--kv-events-config", json.dumps(kv_events), "--enable-prompt-tokens-details",
            "--served-model-name", EMULATOR_MODEL, *config.engine_flags()]
    ready = log_dir / "emulator.ready.json"
    ready.unlink(missing_ok=True)  # a kept log directory's last run must not pass for this one
    proc, replicas = processes.start_emulator(ready, args,
                                            env={"PYTHONHASHSEED": config.hash_seed},
                                            log_path=log_dir / "emulator.log")
    try:
        replica = replicas[0]
        return run_engine("emulator", str(replica["url"]), EMULATOR_MODEL,
                          str(replica["kv_events_endpoint"]), replica.get("kv_replay_endpoint"),
                          prompts, config)
    finally:
        processes.stop_process(proc)


def run_vllm(prompts: Sequence[list[int]], config: FidelityConfig, log_dir: Path,
             progress: Callable[[str], None] = lambda line: None) -> EngineRun:
    """A fresh vLLM CPU engine (``loadtest.harness.vllm_engine``) with ``config``'s flags, given
    ``prompts``; stopped afterwards. Raises ``RuntimeError`` when vLLM cannot run here."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    model_dir = make_model_dir(log_dir / "model")
    progress("starting vLLM (1-3 min on a busy machine)")
    engine = start_vllm_engine(
        model_dir, num_gpu_blocks=config.num_gpu_blocks, hash_seed=config.hash_seed,
        hash_algo=config.hash_algo, block_size=config.block_size,
        extra_args=config.engine_flags(), log_path=log_dir / "vllm.log")
    try:
        progress(f"vLLM serves at {engine.url}; sending {len(prompts)} requests")
        return run_engine("vllm", engine.url, engine.model, engine.kv_events_endpoint,
                          engine.kv_replay_endpoint, prompts, config)
    finally:
        engine.stop()


def run_fidelity(prompts: Sequence[list[int]], config: FidelityConfig,
                 log_dir: Path | None = None,
                 progress: Callable[[str], None] = lambda line: None,
                 vllm_run: Path | None = None, record_dir: Path | None = None,
                 ) -> dict[str, Any]:
    """Run ``prompts`` on a fresh emulator and a fresh vLLM (one after the other: a vLLM engine
    takes a core's worth of CPU while it prefills) and return ``compare``'s report.
    ``vllm_run``: take vLLM's side from this recording (``save_run``) instead of an engine;
    ``record_dir``: record both runs there (``emulator.run.json``, ``vllm.run.json``)."""
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fidelity-")))
        log_dir.mkdir(parents=True, exist_ok=True)
        progress(f"emulator: sending {len(prompts)} requests")
        emulator = run_emulator(prompts, config, log_dir)
        if vllm_run is not None:
            vllm = load_run(vllm_run, prompts, config)
        else:
            vllm = run_vllm(prompts, config, log_dir, progress)
        if record_dir is not None:
            record_dir.mkdir(parents=True, exist_ok=True)
            save_run(emulator, record_dir / "emulator.run.json", prompts, config)
            save_run(vllm, record_dir / "vllm.run.json", prompts, config)
        report = compare(emulator, vllm, [len(p) for p in prompts], prompt_block_keys(
            prompts, config) if config.max_tokens > 1 else None)
        report["config"] = asdict(config)
        return report


# ------------------------------------------------------------------------------------ CLI


def add_fidelity_parser(sub: Any) -> None:
    """Register ``fidelity`` on the CLI's subparsers."""
    p = sub.add_parser("fidelity", help="the emulator against a real vLLM CPU engine: "
                                        "cached tokens per request and KV events, compared")
    p.add_argument("--workload", choices=("synthetic", "trace"), default="synthetic")
    p.add_argument("--requests", type=int, default=DEFAULT_NUM_REQUESTS,
                   help="requests in the sequence")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")
    p.add_argument("--trace", type=Path, default=None,
                   help="Mooncake JSONL trace (default: the packaged slice)")
    p.add_argument("--start", type=int, default=0, help="first trace line (0-based)")
    p.add_argument("--token-seed", type=int, default=0,
                   help="seed of the trace's hash-id -> token-id mapping")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--num-gpu-blocks", type=int, default=DEFAULT_NUM_GPU_BLOCKS,
                   help="KV capacity of both engines in blocks (--num-gpu-blocks-override)")
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                   help="both engines' limit; longer prompts are cut (synthetic) or skipped "
                        "(trace)")
    p.add_argument("--max-tokens", type=int, default=1,
                   help="output tokens per request (above 1 the output blocks' hashes differ "
                        "by construction)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests in flight per engine (1: one at a time, the exact comparison)")
    p.add_argument("--output", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the engines' logs here")
    p.add_argument("--record", type=Path, default=None, metavar="DIR",
                   help="record both runs (requests' cached tokens and every KV-event batch) "
                        "in DIR")
    p.add_argument("--vllm-run", type=Path, default=None, metavar="FILE",
                   help="take vLLM's side from a recording (DIR/vllm.run.json of --record, same "
                        "workload and flags) instead of starting an engine: for trying emulator "
                        "changes")
    p.set_defaults(func=_cmd_fidelity)


def _cmd_fidelity(args: Any) -> int:
    from loadtest.data import packaged_trace_path

    for name in ("requests", "block_size", "num_gpu_blocks", "max_num_batched_tokens",
                 "max_num_seqs", "max_model_len", "max_tokens", "concurrency"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    config = FidelityConfig(
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, max_tokens=args.max_tokens,
        concurrency=args.concurrency)
    max_prompt = args.max_model_len - args.max_tokens
    if args.workload == "synthetic":
        prompts = synthetic_workload(args.requests, args.seed, max_prompt)
        workload = f"synthetic workload, seed {args.seed}, {len(prompts)} requests"
    else:
        trace = args.trace or packaged_trace_path()
        prompts = trace_workload(trace, args.start, args.requests, max_prompt, args.token_seed)
        workload = (f"trace {trace.name} from line {args.start}, {len(prompts)} requests of at "
                    f"most {max_prompt} prompt tokens")
    if not prompts:
        print("no requests in the selected workload", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        report = run_fidelity(prompts, config, args.log_dir, progress, args.vllm_run,
                              args.record)
    except (RuntimeError, ValueError) as exc:
        print(f"prefix-loadtest fidelity: {exc}", file=sys.stderr)
        return 2
    report["workload"] = workload
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2))
    print(format_report(report, config, workload))
    return 0 if report["identical"] else 1
