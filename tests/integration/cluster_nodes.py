"""The test Redis Cluster on 127.0.0.1:7101-7103 (tests/redis_cluster.sh): who serves a slot, a
slot moved from node to node (as `redis-cli --cluster reshard` does it: IMPORTING/MIGRATING,
MIGRATE of its keys, SETSLOT NODE everywhere), a node frozen with SIGSTOP (always thawed), and the
deletion of a test's keys on every node."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import redis

PORTS = (7101, 7102, 7103)


def answers() -> bool:
    """Whether the cluster's first node answers (a test that did not start it may clean up)."""
    try:
        with redis.Redis(host="127.0.0.1", port=PORTS[0], socket_timeout=2) as c:
            return bool(c.ping())
    except redis.RedisError:
        return False


def client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)


def node_id(port: int) -> str:
    with client(port) as c:
        return str(c.execute_command("CLUSTER MYID").decode())  # type: ignore[no-untyped-call]


def owner(slot: int) -> int:
    """The port of the node that serves `slot`."""
    with client(PORTS[0]) as c:
        for start, end, master, *_ in c.execute_command("CLUSTER SLOTS"):  # type: ignore[no-untyped-call]
            if start <= slot <= end:
                return int(master[1])
    raise LookupError(f"no node serves slot {slot}")


def begin_migration(slot: int, src: int, dst: int) -> None:
    with client(dst) as d:
        d.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", node_id(src))  # type: ignore[no-untyped-call]
    with client(src) as s:
        s.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", node_id(dst))  # type: ignore[no-untyped-call]


def migrate_keys(slot: int, src: int, dst: int, keys: list[bytes] | None = None) -> None:
    """MIGRATE `keys` (default: every key of the slot on src) to dst."""
    with client(src) as s:
        if keys is None:
            keys = list(s.execute_command("CLUSTER GETKEYSINSLOT", slot, 100000))  # type: ignore[no-untyped-call]
        if keys:
            s.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 10000, "KEYS", *keys)  # type: ignore[no-untyped-call]


def end_migration(slot: int, dst: int) -> None:
    new = node_id(dst)
    for port in PORTS:
        with client(port) as c:
            c.execute_command("CLUSTER SETSLOT", slot, "NODE", new)  # type: ignore[no-untyped-call]


def move_slot(slot: int, src: int, dst: int) -> None:
    begin_migration(slot, src, dst)
    migrate_keys(slot, src, dst)
    end_migration(slot, dst)


def count_keys(port: int, slot: int) -> int:
    """Keys of `slot` that the node on `port` holds (whether it serves the slot or not)."""
    with client(port) as c:
        return int(c.execute_command("CLUSTER COUNTKEYSINSLOT", slot))  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def slot_moved_back(slot: int) -> Iterator[int]:
    """Yields the slot's owner now; whatever the test does to the slot, it ends served by that
    node again, with its keys, and with no migration left open."""
    home = owner(slot)
    try:
        yield home
    finally:
        now = owner(slot)
        holders = [p for p in PORTS if p != now and count_keys(p, slot)]
        if holders:  # a migration to holders[0] left open: finish it, then move the slot back
            begin_migration(slot, now, holders[0])
            migrate_keys(slot, now, holders[0])
            end_migration(slot, holders[0])
            now = holders[0]
        for port in PORTS:
            with client(port) as c:
                c.execute_command("CLUSTER SETSLOT", slot, "STABLE")  # type: ignore[no-untyped-call]
        if now != home:
            move_slot(slot, now, home)


def pid(port: int) -> int:
    with client(port) as c:
        return int(c.info("server")["process_id"])


@contextlib.contextmanager
def frozen(port: int) -> Iterator[None]:
    """The node SIGSTOPped (it accepts connections, answers nothing) until the block ends."""
    node_pid = pid(port)
    os.kill(node_pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(node_pid, signal.SIGCONT)


def _config(port: int, name: str) -> str:
    with client(port) as c:
        return str(c.config_get(name)[name])


@contextlib.contextmanager
def killed(port: int) -> Iterator[None]:
    """The node SIGKILLed (connections refused) until the block ends; then started again from its
    nodes file, so it rejoins the cluster with its slots (and no keys: nothing is persisted)."""
    node_pid = pid(port)
    conf, workdir, logfile = (_config(port, n) for n in ("cluster-config-file", "dir", "logfile"))
    os.kill(node_pid, signal.SIGKILL)
    try:
        yield
    finally:
        subprocess.run(
            ["redis-server", "--port", str(port), "--cluster-enabled", "yes", "--cluster-config-file", conf,
             "--daemonize", "yes", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", workdir, "--logfile", logfile, "--cluster-require-full-coverage", "no"],
            check=True, timeout=30,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not _cluster_ok():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster node on {port} did not rejoin")
            time.sleep(0.1)


def _cluster_ok() -> bool:
    try:
        for port in PORTS:
            with client(port) as c:
                if c.cluster("info")["cluster_state"] != "ok":  # type: ignore[no-untyped-call]
                    return False
        return True
    except redis.RedisError:
        return False


def delete_prefix(prefix: str) -> None:
    for port in PORTS:
        with client(port) as c:
            keys = list(c.scan_iter(match=f"{prefix}*", count=1000))
            for key in keys:
                c.unlink(key)
