"""redis-server processes for tests, on free ports of 127.0.0.1, each in a directory of its own,
started and stopped by the fixtures (tests/support/fixtures.py):

- ServerProcess: one redis-server (or sentinel);
- RestartableRedis: one with AOF, which a test stops and starts again on the same port and data;
- LocalCluster: six nodes made one cluster of three masters, each with one replica, by
  `redis-cli --cluster create`.
- LocalSentinel: a master, its replica and three sentinels (quorum two) watching them.

Cluster and Sentinel nodes run without persistence: a failover here is the replica's promotion, not a restart. The
DEBUG command is enabled so that a test can make a replica fall behind (DEBUG SLEEP)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from harness.polling import eventually
from harness.processes import PROBE_INTERVAL_S, ChildProcess
from producer_client.connection import connect
from worker.embedded_redis import free_port

START_TIMEOUT_S = 30.0


class ServerProcess(ChildProcess):
    """One redis-server (or sentinel) on 127.0.0.1:port, its files and its log in `dir`."""

    start_timeout_s = START_TIMEOUT_S

    def __init__(self, dir: Path, *args: str, sentinel: bool = False):
        self.dir = dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.args = args
        self.sentinel = sentinel
        super().__init__([], dir / ("sentinel.log" if sentinel else "redis.log"))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, *more_args: str) -> ServerProcess:
        """Started and answering; `more_args` for this start only (a rejoining node's --replicaof).
        A first start whose port another test's server took after free_port() found it starts
        again on another (ChildProcess.on_a_free_port): the harness tells others its port once it
        is started (LocalSentinel)."""

        def move_to(port: int) -> None:
            self.port = port
            if "--cluster-port" in self.args:
                # The bind that failed may be the cluster bus's, a port picked with the node's
                # (CI: an outgoing connection took it in between): both move, and the node
                # forgets the ports its first start wrote down.
                i = self.args.index("--cluster-port") + 1
                self.args = (*self.args[:i], str(free_port()), *self.args[i + 1 :])
                (self.dir / "nodes.conf").unlink(missing_ok=True)

        return self.on_a_free_port(lambda: self._start_once(*more_args), move_to)

    def _start_once(self, *more_args: str) -> ServerProcess:
        if self.sentinel:
            config = self.dir / "sentinel.conf"  # a sentinel rewrites its own file as it learns
            config.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n{self.args[0]}")
            self.command = ["redis-server", str(config), "--sentinel"]
        else:
            self.command = [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--enable-debug-command",
                "yes",
                # A replica syncs at once (Redis waits 5 s for more replicas to share the transfer).
                "--repl-diskless-sync-delay",
                "0",
                *self.args,
                *more_args,
            ]
        super().start()
        return self.wait_ready()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=5)

    def ready(self) -> bool:
        """It answers a PING (not while it loads its AOF), and it is this process that answers: a
        server of another test on the port this one could not bind would answer too."""
        if not self.running:
            return False
        with self.client() as c:
            try:
                return bool(c.ping()) and c.info("server")["process_id"] == self.process.pid
            except redis.RedisError:
                return False


class RestartableRedis(ServerProcess):
    """A redis-server with AOF (appendfsync everysec), as deployments run it, that a test can
    stop and start again on the same port and data directory."""

    def __init__(self, data_dir: Path):
        super().__init__(data_dir, "--appendonly", "yes", "--appendfsync", "everysec")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def restart(self, down_s: float, keep_data: bool = True) -> None:
        """Stop (SIGTERM: Redis writes out its AOF and exits, as in a restart or an upgrade), wait
        `down_s`, start again; with keep_data=False the AOF goes first, so Redis comes back empty,
        as one without persistence does."""
        self.stop()
        if not keep_data:
            shutil.rmtree(self.dir / "appendonlydir", ignore_errors=True)
        time.sleep(down_s)
        self.start()


class Deployment:
    """Started on entering a `with`, stopped on leaving it, or at once if it did not start."""

    def start(self):
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def _cluster_ok(node: ServerProcess) -> bool:
    with node.client() as c:
        return c.cluster("INFO")["cluster_state"] == "ok"


def _in_sync(c: redis.Redis) -> bool:
    """A master, or a replica whose link to its master is up."""
    replication = c.info("replication")
    return replication["role"] == "master" or replication.get("master_link_status") == "up"


class LocalCluster(Deployment):
    """`masters` masters (three unless told) and a replica of each. `node_timeout_ms`: how long a
    master may be unreachable before the others count it as failed and its replica is promoted."""

    def __init__(self, root: Path, node_timeout_ms: int = 2000, masters: int = 3):
        self.masters = masters
        self.nodes = [
            ServerProcess(
                root / f"node{i}",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(node_timeout_ms),
                "--cluster-port",
                str(free_port()),
            )
            for i in range(2 * masters)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes[:3])

    def start(self) -> LocalCluster:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(n.address for n in self.nodes),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.wait_healthy()
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def live(self) -> list[ServerProcess]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until every live node says the cluster is ok, with its masters, that all nodes agree on,
        and every replica has synced with its master: a replica that has not may not take over
        (a test kills a master seconds after the cluster is made)."""

        def healthy() -> bool:
            views = set()
            for node in self.live():
                with node.client() as c:
                    if c.cluster("INFO")["cluster_state"] != "ok" or not _in_sync(c):
                        return False
                    views.add(tuple(sorted(self._masters_seen_by(c))))
            return len(views) == 1 and len(next(iter(views))) == self.masters

        assert eventually(healthy, timeout, PROBE_INTERVAL_S), f"the cluster did not settle in {timeout:g}s"

    def fail_over(self, key: str) -> None:
        """kill -9 the master that serves `key`; return once the cluster has promoted its replica
        and the killed node is back, as that replica's."""
        master = self.master_of(key)
        replica = self.replica_of(master)
        master.kill()
        self.wait_promoted(replica)
        self.rejoin(master)

    def wait_promoted(self, replica: ServerProcess, timeout: float = START_TIMEOUT_S) -> None:
        """Until `replica` is a master (its master failed, or handed it the role) and every live node
        serves every slot."""

        def promoted() -> bool:
            with replica.client() as c:
                if c.info("replication")["role"] != "master":
                    return False
            return all(_cluster_ok(node) for node in self.live())

        assert eventually(promoted, timeout, PROBE_INTERVAL_S), f"{replica.address} was not promoted in {timeout:g}s"

    def rejoin(self, node: ServerProcess) -> None:
        """Start a killed node again, as a failed machine is replaced: its node file remembers the
        cluster, whose newer configuration makes it a replica of the master that took its slots."""
        node.start()
        self.wait_healthy()

    def master_of(self, key: str) -> ServerProcess:
        with self.live()[0].client() as c:
            slot = c.cluster("KEYSLOT", key)
            for start, end, master, *_ in c.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return self._node_at(master[1])
        raise LookupError(f"no master serves the slot of {key!r}")

    def replica_of(self, master: ServerProcess) -> ServerProcess:
        with master.client() as c:
            master_id = c.execute_command("CLUSTER MYID")
        for node in self.live():
            with node.client() as c:
                if c.info("replication")["role"] == "slave" and self._master_id_of(c) == master_id:
                    return node
        raise LookupError(f"{master.address} has no replica")

    def node_id(self, node: ServerProcess) -> str:
        with node.client() as c:
            return c.execute_command("CLUSTER MYID")

    def slots_of(self, node: ServerProcess) -> list[int]:
        with node.client() as c:
            ranges = [
                (start, end) for start, end, master, *_ in c.execute_command("CLUSTER SLOTS") if master[1] == node.port
            ]
        return [slot for start, end in ranges for slot in range(start, end + 1)]

    def admin(self):
        """A cluster client, for what a test reads and checks."""
        return connect(self.url, decode_responses=True)

    @staticmethod
    def _master_id_of(c: redis.Redis) -> str:
        """The node id of the master that the replica `c` is connected to replicates."""
        return next(n["master_id"] for n in c.execute_command("CLUSTER NODES").values() if "myself" in n["flags"])

    @staticmethod
    def _masters_seen_by(c: redis.Redis) -> list[str]:
        nodes = c.execute_command("CLUSTER NODES").items()
        return [address for address, n in nodes if "master" in n["flags"] and "fail" not in n["flags"] and n["slots"]]

    def _node_at(self, port: int) -> ServerProcess:
        return next(n for n in self.nodes if n.port == port)


class LocalSentinel(Deployment):
    """A master, a replica and three sentinels that promote the replica once the master has not
    answered them for `down_after_ms`."""

    SERVICE = "mili"

    def __init__(self, root: Path, down_after_ms: int = 1000):
        self.down_after_ms = down_after_ms
        self.master = ServerProcess(root / "master")
        # The others learn the master's port once it is started (it may move: ServerProcess.start).
        self.replica = ServerProcess(root / "replica")
        self.sentinels = [ServerProcess(root / f"sentinel{i}", sentinel=True) for i in range(3)]

    @property
    def url(self) -> str:
        return f"redis+sentinel://{','.join(s.address for s in self.sentinels)}/{self.SERVICE}"

    def start(self) -> LocalSentinel:
        self.master.start()
        self.replica.args = ("--replicaof", "127.0.0.1", str(self.master.port))
        self.replica.start()
        assert eventually(self._replica_in_sync, START_TIMEOUT_S, PROBE_INTERVAL_S), "the replica did not sync"
        watch = (
            f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.master.port} 2\n"
            f"sentinel down-after-milliseconds {self.SERVICE} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.SERVICE} 10000\n"
        )
        for sentinel in self.sentinels:
            sentinel.args = (watch,)
            sentinel.start()
        assert eventually(self._sentinels_see_everything, START_TIMEOUT_S, PROBE_INTERVAL_S), (
            "the sentinels did not find the replica and each other"
        )
        return self

    def stop(self) -> None:
        for process in (*self.sentinels, self.replica, self.master):
            process.stop()

    def fail_over(self, key: str = "") -> None:
        """kill -9 the master (it serves every key); return once the sentinels have promoted the
        replica and the killed server is back, as the new master's replica."""
        master = self.current_master()
        master.kill()
        self.wait_promoted(master)
        self.rejoin(master)

    def wait_promoted(self, old: ServerProcess, timeout: float = START_TIMEOUT_S) -> ServerProcess:
        """Until the sentinels name another master than `old`, and it says it is one; returns it."""
        assert eventually(lambda: self._promoted_other_than(old), timeout, PROBE_INTERVAL_S), (
            f"no replica of {old.address} was promoted in {timeout:g}s"
        )
        return self.current_master()

    def rejoin(self, old: ServerProcess) -> None:
        """Start a killed master again as a replica of the new one, as a replaced machine is set
        up (the sentinels would make it one too, but only after it has claimed to be a master for
        8 s)."""
        new = self.current_master()
        old.start("--replicaof", "127.0.0.1", str(new.port))
        assert eventually(lambda: self._replicating(old), START_TIMEOUT_S, PROBE_INTERVAL_S), (
            f"{old.address} did not become a replica"
        )

    def current_master(self) -> ServerProcess:
        """The server the sentinels name as master now."""
        for sentinel in self.sentinels:
            if sentinel.ready():
                with sentinel.client() as c:
                    _, port = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE)
                return self.master if int(port) == self.master.port else self.replica
        raise LookupError("no sentinel answers")

    def admin(self):
        return connect(self.url, decode_responses=True)

    def _promoted_other_than(self, old: ServerProcess) -> bool:
        new = self.current_master()
        if new is old:
            return False
        with new.client() as c:
            return c.info("replication")["role"] == "master"

    @staticmethod
    def _replicating(node: ServerProcess) -> bool:
        with node.client() as c:
            replication = c.info("replication")
        return replication["role"] == "slave" and replication.get("master_link_status") == "up"

    def _replica_in_sync(self) -> bool:
        with self.replica.client() as c:
            return _in_sync(c)

    def _sentinels_see_everything(self) -> bool:
        for sentinel in self.sentinels:
            with sentinel.client() as c:
                if len(c.execute_command("SENTINEL", "REPLICAS", self.SERVICE)) != 1:
                    return False
                if len(c.execute_command("SENTINEL", "SENTINELS", self.SERVICE)) != 2:
                    return False
        return True
