"""Start and stop a whole emulated fleet on loopback for one benchmark run. Does process and
network I/O.

A ``LoopbackFleet`` is, in start order: an embedded Redis (``loadtest.harness.redis_server.RedisServer``, unless
``redis_url`` is given), one emulator process serving ``replicas`` vLLM-compatible replicas
(``prefix-worker emulate --replicas N --port 0 --ready-file F``, KV events on ephemeral ZMQ
ports), then for prefix-router one ``prefix-worker report`` sidecar per replica and the router
(``prefix-router serve --port 0 --ready-file F --policy P``), or, for a peer router, the peer
process alone (the SGLang model gateway or vllm-project's router, pointed at the replicas'
URLs). ``start`` returns once the router can route to every replica; ``stop`` tears everything
down in reverse order (SIGTERM, then SIGKILL after a grace period) and is safe to call twice, on
errors and on Ctrl-C. On Linux every child also gets SIGTERM if this process dies
(``PR_SET_PDEATHSIG``), so a killed benchmark leaves no fleet behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.harness import processes
from loadtest.harness.orphans import die_with_parent
from loadtest.harness.redis_server import RedisServer, free_port
from router.shared.contract import DEFAULT_INDEX_STRIDE

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "emulated-llm"  # the emulator's default served model name
DEFAULT_BLOCK_SIZE = 16  # tokens; vLLM default
DEFAULT_HASH_ALGO = "sha256"  # vLLM 0.33 default --prefix-caching-hash-algo
DEFAULT_START_TIMEOUT_S = 90.0  # emulator + router start-up includes tokenizer loading
STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL
AFFINITY_TIMEOUT_S = 20.0  # wait for the workers' hash verification before a replay

# Router kinds.
OURS = "prefix-router"
SGLANG = "sglang"
VLLM_ROUTER = "vllm-router"
SMG = "smg"  # the SGLang model gateway's successor (PyPI ``smg``, Shepherd Model Gateway)

# The emulated GPUs come first: a real GPU does not slow down when the router's host is busy,
# so the process standing in for them runs at a higher priority than the router stack, the peers
# and the replayer (all at the default 0), the same for every run. Lowering a nice value needs
# CAP_SYS_NICE (root has it); without it the emulator stays at 0 and LoopbackFleet.priority says so.
EMULATOR_NICE = -10


class FleetError(RuntimeError):
    """A fleet component did not start or died; the message names it and points at its log."""


@dataclass(frozen=True)
class RouterSpec:
    """Which router fronts the fleet: ``kind`` is ``OURS``, ``SGLANG``, ``VLLM_ROUTER`` or ``SMG``,
    ``policy`` its policy name; ``label`` names the run in results (e.g. ``sglang:cache_aware``)."""

    kind: str
    policy: str

    @property
    def label(self) -> str:
        return self.policy if self.kind == OURS else f"{self.kind}:{self.policy}"


@dataclass(frozen=True)
class FleetConfig:
    """One fleet. ``num_gpu_blocks`` is the KV capacity per replica in ``block_size``-token blocks
    (None: the emulator's default); ``time_scale`` divides the emulator's modelled latencies;
    ``python_hash_seed`` is exported as ``PYTHONHASHSEED`` to every component (the emulator's
    root-parent hash seed, as vLLM); ``int_block_hashes`` False exports
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (byte-form event hashes). ``engines``: replicas
    already running (real vLLM engines, ``loadtest.harness.vllm_engine``), which the fleet uses instead
    of starting an emulator, and ``engine_pids`` their processes' leaders (CPU accounting)."""

    router: RouterSpec
    replicas: int = 8
    model: str = DEFAULT_MODEL
    block_size: int = DEFAULT_BLOCK_SIZE
    hash_algo: str = DEFAULT_HASH_ALGO
    num_gpu_blocks: int | None = None
    time_scale: float = 1.0
    python_hash_seed: str | None = None
    int_block_hashes: bool = True
    redis_url: str | None = None
    redis_prefix: str = "pr"
    log_dir: Path | None = None
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    emulator_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    emulator_priority: bool = True  # run the emulator at EMULATOR_NICE where allowed
    index_stride: int = DEFAULT_INDEX_STRIDE  # coarse-index stride, the same for workers and router
    engines: tuple[ReplicaInfo, ...] = ()
    engine_pids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("a fleet needs at least one replica")
        if self.engines and len(self.engines) != self.replicas:
            raise ValueError(f"{len(self.engines)} engines given for {self.replicas} replicas")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")


@dataclass(frozen=True)
class ReplicaInfo:
    """One emulated replica, as the emulator's ready file reports it."""

    index: int
    replica_id: str  # replica-{index}
    url: str
    kv_events_endpoint: str | None
    kv_replay_endpoint: str | None


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]  # started by loadtest.harness.processes.start_process


def _set_pdeathsig_and_priority() -> None:  # the emulator's child, between fork and exec
    die_with_parent()
    # Before exec, so every thread the emulator starts inherits it. The child already has a
    # session (and so, with CONFIG_SCHED_AUTOGROUP, a scheduling group) of its own: nice alone
    # only ranks threads inside one group, the group's own nice ranks it against the others.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, EMULATOR_NICE)
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as f:
        f.write(str(EMULATOR_NICE))


def process_priority(pid: int) -> dict[str, int | None]:
    """The nice value of ``pid`` and of its autogroup (None where the OS does not say)."""
    out: dict[str, int | None] = {"nice": None, "autogroup_nice": None}
    with contextlib.suppress(OSError):
        out["nice"] = os.getpriority(os.PRIO_PROCESS, pid)
    with contextlib.suppress(OSError, ValueError, IndexError):
        # "/autogroup-123 nice -10"
        out["autogroup_nice"] = int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    return out


def python_entry(module: str) -> list[str]:
    """Command prefix that runs ``python -m module`` with this interpreter (works from an
    editable or a regular install without relying on console scripts being on PATH)."""
    return [processes.PYTHON, "-m", module]


def peer_available(kind: str) -> bool:
    """Whether a peer router can be started here (the ``peers`` extra is installed)."""
    import importlib.util

    if kind == SGLANG:
        return importlib.util.find_spec("sglang_router") is not None
    if kind == VLLM_ROUTER:
        return importlib.util.find_spec("vllm_router") is not None
    if kind == SMG:
        return importlib.util.find_spec("smg") is not None
    raise ValueError(f"unknown peer router kind {kind!r}")


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """GET ``url``; (status, body). Raises ``OSError`` when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def ready_replica_ids(data: Any, require_affinity: bool = False) -> set[str]:
    """The replica ids a router's decoded GET /ready body lists as routable (and, with
    ``require_affinity``, usable for prefix affinity): ``{"replicas": [{"replica_id",
    "routable", "affinity"}]}``, or a list of ids or a mapping keyed by id."""
    found: set[str] = set()
    candidates: list[Any] = []
    if isinstance(data, dict):
        for key in ("replicas", "routable", "routable_replicas", "healthy"):
            if key in data:
                candidates.append(data[key])
    for value in candidates:
        if isinstance(value, dict):
            found.update(str(k) for k in value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, str):
                    found.add(item)
                elif isinstance(item, dict):
                    ident = item.get("replica_id") or item.get("id")
                    usable = item.get("routable", True) is not False and not (
                        require_affinity and item.get("affinity", True) is False)
                    if ident is not None and usable:
                        found.add(str(ident))
    return found


class LoopbackFleet:
    """An emulated fleet plus one router, as configured by ``FleetConfig``.

    After ``start``: ``router_url``, ``replicas`` (``ReplicaInfo`` list), ``pids`` (component
    name -> list of pids: ``redis``, ``emulator``, ``workers``, ``router``). Use as a context
    manager. ``progress`` receives one-line status messages.
    """

    def __init__(self, config: FleetConfig, progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.progress = progress or (lambda _msg: None)
        self.router_url: str | None = None
        self.redis_url: str | None = config.redis_url
        self.replicas: list[ReplicaInfo] = []
        self._redis: RedisServer | None = None
        self._procs: list[_Proc] = []  # start order
        self._stopped = False
        self.priority: dict[str, Any] = {}
        self._env = dict(os.environ)
        if config.python_hash_seed is not None:
            self._env["PYTHONHASHSEED"] = config.python_hash_seed
        if not config.int_block_hashes:
            self._env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
        self._env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._env.setdefault("PYTHONUNBUFFERED", "1")

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> LoopbackFleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LoopbackFleet:
        cfg = self.config
        if cfg.log_dir is not None:
            cfg.log_dir.mkdir(parents=True, exist_ok=True)
        if cfg.router.kind == OURS and self.redis_url is None:
            self._redis = RedisServer().start()
            self.redis_url = self._redis.url
        if cfg.engines:
            self.replicas = list(cfg.engines)
        else:
            self._start_emulator()
        if cfg.router.kind == OURS:
            self._start_workers()
            self.router_url, _ = self.add_router("router", self.config.router_args)
        else:
            self._start_peer_router()
        return self

    def stop(self) -> None:
        """Stop every component, newest first. Never raises; safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        processes.stop_processes([proc.popen for proc in self._procs], STOP_GRACE_S)
        if self._redis is not None:
            self._redis.stop()
            self._redis = None

    # -- facts -------------------------------------------------------------------------------

    @property
    def pids(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        if self._redis is not None and self._redis._proc is not None:
            out["redis"] = [self._redis._proc.pid]
        if self.config.engine_pids:
            out["engines"] = list(self.config.engine_pids)
        for proc in self._procs:
            group = "workers" if proc.name.startswith("worker-") else proc.name
            out.setdefault(group, []).append(proc.popen.pid)
        return out

    def check_alive(self) -> None:
        """Raise ``FleetError`` if a component has exited."""
        for proc in self._procs:
            if proc.popen.poll() is not None:
                raise FleetError(f"{proc.name} exited with status {proc.popen.returncode}"
                                 f"{self._log_hint(proc)}")

    # -- internals ---------------------------------------------------------------------------

    def _log_hint(self, proc: _Proc) -> str:
        return processes.output_hint(proc.popen)

    def _spawn(self, name: str, args: Sequence[str], prioritised: bool = False) -> _Proc:
        log_dir = self.config.log_dir
        logger.info("starting %s: %s", name, " ".join(args))
        popen = processes.start_process(
            args, self._env, log_dir / f"{name}.log" if log_dir is not None else None,
            stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=(None if not sys.platform.startswith("linux")
                        else _set_pdeathsig_and_priority if prioritised else die_with_parent))
        proc = _Proc(name, popen)
        self._procs.append(proc)
        return proc

    def _wait(self, what: str, cond: Callable[[], Any], procs: Sequence[_Proc],
              timeout_s: float | None = None) -> Any:
        timeout_s = self.config.start_timeout_s if timeout_s is None else timeout_s
        try:
            return processes.wait_for(cond, timeout_s, 0.1, what, [p.popen for p in procs])
        except (TimeoutError, processes.ProcessExited) as exc:
            raise FleetError(str(exc)) from exc

    def _ready_file(self, name: str) -> Path:
        base = self.config.log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
        path = base / f"{name}-{os.getpid()}-{time.monotonic_ns()}.ready.json"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return path

    def _start_emulator(self) -> None:
        cfg = self.config
        ready = self._ready_file("emulator")
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}
        args = [*processes.EMULATE, "--replicas", str(cfg.replicas), "--served-model-name", cfg.model,
                "--block-size", str(cfg.block_size), "--prefix-caching-hash-algo", cfg.hash_algo,
                "--kv-events-config", json.dumps(kv_events), "--enable-prompt-tokens-details",
                "--time-scale", repr(cfg.time_scale), "--ready-file", str(ready)]
        if cfg.num_gpu_blocks is not None:
            args += ["--num-gpu-blocks-override", str(cfg.num_gpu_blocks)]
        args += list(cfg.emulator_args)
        self.progress(f"starting emulator ({cfg.replicas} replicas)")
        proc = self._spawn("emulator", args, prioritised=cfg.emulator_priority)
        self.priority = self._describe_priority(proc.popen.pid)
        self.progress(f"emulator priority: {self.priority['note']}")

        data = self._wait("the emulator's ready file", lambda: json.loads(ready.read_text()),
                          [proc])
        self.replicas = [
            ReplicaInfo(index=int(r["index"]), replica_id=f"replica-{int(r['index'])}",
                        url=str(r["url"]).rstrip("/"),
                        kv_events_endpoint=r.get("kv_events_endpoint"),
                        kv_replay_endpoint=r.get("kv_replay_endpoint"))
            for r in sorted(data["replicas"], key=lambda r: int(r["index"]))]
        if len(self.replicas) != cfg.replicas:
            raise FleetError(f"emulator reported {len(self.replicas)} replicas, "
                             f"expected {cfg.replicas}")
        with contextlib.suppress(OSError):
            ready.unlink()

    def _describe_priority(self, pid: int) -> dict[str, Any]:
        got = process_priority(pid)
        wanted = self.config.emulator_priority
        if not wanted:
            note = "not changed (emulator_priority off): every process at the default"
        elif got["nice"] == EMULATOR_NICE and got["autogroup_nice"] in (None, EMULATOR_NICE):
            note = (f"emulator at nice {EMULATOR_NICE} (autogroup "
                    f"{got['autogroup_nice'] if got['autogroup_nice'] is not None else 'n/a'}), "
                    "router stack, peers and replayer at their default")
        else:
            note = (f"could not raise the emulator's priority (nice {got['nice']}, autogroup "
                    f"{got['autogroup_nice']}; needs CAP_SYS_NICE, e.g. root): every process at "
                    "the default, so a busy host slows the emulated GPUs too")
        return {"requested": wanted, "emulator_nice": got["nice"],
                "emulator_autogroup_nice": got["autogroup_nice"], "note": note}

    def _start_workers(self) -> None:
        cfg = self.config
        assert self.redis_url is not None
        self.progress(f"starting {len(self.replicas)} workers")
        for rep in self.replicas:
            if rep.kv_events_endpoint is None:
                raise FleetError(f"replica {rep.index} publishes no KV events")
            args = [*python_entry("worker.cli"), "report", "--engine-url", rep.url,
                    "--kv-events-endpoint", rep.kv_events_endpoint,
                    "--redis-url", self.redis_url, "--replica-id", rep.replica_id,
                    "--advertise-url", rep.url, "--redis-prefix", cfg.redis_prefix,
                    "--metrics-port", "0", "--index-stride", str(cfg.index_stride)]
            if rep.kv_replay_endpoint:
                args += ["--kv-replay-endpoint", rep.kv_replay_endpoint]
            if cfg.python_hash_seed is not None:
                args += ["--hash-seed", cfg.python_hash_seed]
            args += list(cfg.worker_args)
            self._spawn(f"worker-{rep.index}", args)

    def add_router(self, name: str, router_args: Sequence[str]) -> tuple[str, int]:
        """Start a prefix-router on this fleet's Redis with ``router_args`` (after the fleet's
        own flags; a later flag overrides), named ``name`` in logs and ``pids``: the fleet's own
        router, or one more (the second of an active-active pair, or other settings over the
        same replicas). Returns its URL and pid once it routes to every replica (no
        hash-verified affinity within ``AFFINITY_TIMEOUT_S`` is only a warning). Stopped with
        the fleet; raises ``FleetError`` when it does not start."""
        cfg = self.config
        assert self.redis_url is not None
        ready = self._ready_file(name)
        args = [*python_entry("router.cli"), "serve", "--host", "127.0.0.1", "--port", "0",
                "--ready-file", str(ready), "--redis-url", self.redis_url,
                "--redis-prefix", cfg.redis_prefix, "--policy", cfg.router.policy,
                "--model", cfg.model, "--block-size", str(cfg.block_size),
                "--hash-algo", cfg.hash_algo, "--log-level", "warning",
                "--index-stride", str(cfg.index_stride)]
        if cfg.python_hash_seed is not None:
            args += ["--hash-seed", cfg.python_hash_seed]
        args += list(router_args)
        self.progress(f"starting prefix-router {name} (policy {cfg.router.policy})")
        proc = self._spawn(name, args)
        watched = [p for p in self._procs]

        url = str(self._wait(f"{name}'s ready file", lambda: json.loads(ready.read_text()),
                             [proc])["url"]).rstrip("/")
        with contextlib.suppress(OSError):
            ready.unlink()
        want = {r.replica_id for r in self.replicas}
        self._wait(f"{name} to see all {len(want)} replicas",
                   lambda: want <= self._router_replica_ids(url=url), watched)
        # Affinity needs the worker's hash verification; without it the router still routes, so
        # a replica that never verifies is a warning, not a failure. A real engine's probe
        # request runs on a CPU: it gets the whole start-up bound.
        try:
            self._wait("hash-verified affinity on every replica",
                       lambda: want <= self._router_replica_ids(require_affinity=True, url=url),
                       watched,
                       timeout_s=cfg.start_timeout_s if cfg.engines else AFFINITY_TIMEOUT_S)
        except FleetError as exc:
            if "exited" in str(exc):
                raise
            missing = want - self._router_replica_ids(require_affinity=True, url=url)
            self.progress(f"warning: not every replica has affinity after {AFFINITY_TIMEOUT_S} s: "
                          f"{sorted(missing)}")
        return url, proc.popen.pid

    def _router_replica_ids(self, require_affinity: bool = False,
                            url: str | None = None) -> set[str]:
        """Replica ids the router at ``url`` (default: the fleet's) reports as routable (and,
        with ``require_affinity``, usable for prefix affinity) on GET /ready:
        ``{"replicas": [{"replica_id", "routable", "affinity"}]}``; also accepts a list of ids or
        a mapping keyed by id."""
        url = url or self.router_url
        assert url is not None
        status, body = http_get(url + "/ready")
        if status != 200:
            return set()
        return ready_replica_ids(json.loads(body or b"{}"), require_affinity)

    def _start_peer_router(self) -> None:
        cfg = self.config
        spec = cfg.router
        port, prom_port = free_port(), free_port()
        urls = [r.url for r in self.replicas]
        if spec.kind == SGLANG:
            args = [sys.executable, "-m", "sglang_router.launch_router", "--log-level", "warn"]
        elif spec.kind == VLLM_ROUTER:
            # its console script calls main() with no arguments; main() reads sys.argv
            args = [sys.executable, "-c",
                    "import sys; from vllm_router.launch_router import main; sys.exit(main())",
                    "--log-level", "warning"]
        elif spec.kind == SMG:
            # The replicas are HTTP workers: smg routes them with its approximate trees (text or
            # token ids seen at routing time); its event-driven KV index needs gRPC workers that
            # serve SubscribeKvEvents, which the emulator is not. No tokenizer: nothing here
            # needs one and the hub is out of reach.
            args = [sys.executable, "-m", "smg", "launch", "--log-level", "warn",
                    "--backend", "vllm", "--disable-tokenizer-autoload"]
        else:
            raise ValueError(f"unknown router kind {spec.kind!r}")
        args += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                 "--policy", spec.policy, "--prometheus-host", "127.0.0.1",
                 "--prometheus-port", str(prom_port)]
        if spec.kind == VLLM_ROUTER and spec.policy == "kv_aware":
            for rep in self.replicas:
                if rep.kv_events_endpoint:
                    args += ["--kv-event-source", f"{rep.url}={rep.kv_events_endpoint}"]
                if rep.kv_replay_endpoint:
                    args += ["--kv-event-replay-source", f"{rep.url}={rep.kv_replay_endpoint}"]
            args += ["--kv-event-block-size", str(cfg.block_size), "--kv-event-model", cfg.model]
        args += list(cfg.router_args)
        self.progress(f"starting {spec.kind} (policy {spec.policy})")
        proc = self._spawn("router", args)
        self.router_url = f"http://127.0.0.1:{port}"
        want = set(urls)

        def all_healthy() -> bool:
            status, body = http_get(f"{self.router_url}/workers")
            if status != 200:
                return False
            data = json.loads(body)
            workers = data.get("workers", data) if isinstance(data, dict) else data
            healthy = set()
            for w in workers or []:
                if isinstance(w, dict) and w.get("is_healthy", True):
                    healthy.add(str(w.get("url", "")).rstrip("/"))
                elif isinstance(w, str):
                    healthy.add(w.rstrip("/"))
            return want <= healthy

        self._wait(f"{spec.kind} to list all {len(want)} workers as healthy", all_healthy,
                   [p for p in self._procs])
        del proc


def which(name: str) -> str | None:
    """A console script next to this interpreter, else on PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    return shutil.which(name)
