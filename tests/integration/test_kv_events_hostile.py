"""A hostile local process at a real sidecar's KV-event sockets: a flood of malformed replay requests,
a flood of unique subscriptions, oversized frames. The sidecar keeps answering PING on the data
plane and `/health` (every call answered within the client's hang timeout), counts what it refused,
logs it at a bounded rate, applies only its own topics up to a cap, and never buffers an oversized
frame; its ipc sockets are private to its user."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from bench.sidecar import SidecarProcess
from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.protocol import Layout
from tests.integration.conftest import StartSidecar
from tests.integration.waiting import wait_for

LAYOUT = Layout(
    dtype="float16", num_layers=1, num_kv_heads=1, head_dim=16, block_size=16, kind="test", chunk_size=16
)  # fmt: skip
HANG_S = 5.0  # a call unanswered this long is a hang (the sidecar answers a PING in well under 1 ms)
HOST = "h"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory whose path fits an ipc:// endpoint (at most ~100 characters)."""
    path = Path(tempfile.mkdtemp(prefix="kvev-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start(sidecar_factory: StartSidecar, d: Path) -> tuple[SidecarProcess, str, str]:
    pub, replay = f"ipc://{d}/ev.sock", f"ipc://{d}/replay.sock"
    sc = sidecar_factory(
        env={
            "KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_L2__ADAPTERS": "[]",
            "KVDEPOT_KV_EVENTS__ENDPOINT": pub, "KVDEPOT_KV_EVENTS__REPLAY_ENDPOINT": replay,
            "KVDEPOT_KV_EVENTS__HOST": HOST,
        },
        l1_size_gb=0.02,
    )  # fmt: skip
    return sc, pub, replay


def metrics(sc: SidecarProcess) -> dict[str, float]:
    with urllib.request.urlopen(sc.http + "/metrics", timeout=HANG_S) as resp:
        lines = resp.read().decode().splitlines()
    return {ln.split()[0]: float(ln.split()[1]) for ln in lines if ln and not ln.startswith("#")}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def answered_while(sc: SidecarProcess, busy: Callable[[], bool]) -> int:
    """PING the data plane and GET /health until `busy()` is false; every call must be answered
    within HANG_S (the client raises otherwise). Returns the number of rounds."""
    pinger = KVDepotClient(sc.url, model="pinger", layout=LAYOUT, timeout_s=HANG_S, map_arena=False)
    rounds = 0
    try:
        while busy() or rounds < 3:
            pinger.ping()
            with urllib.request.urlopen(sc.http + "/health", timeout=HANG_S) as resp:
                assert resp.status == 200
            rounds += 1
    finally:
        pinger.close()
    return rounds


class Flood(threading.Thread):
    """A hostile client in its own thread and ZMQ context. Its sockets stay open (what it queued
    keeps going out) until `release()`."""

    def __init__(self, work: Callable[[Flood], None]) -> None:
        super().__init__(daemon=True)
        self.work = work
        self.error: BaseException | None = None
        self.sent = threading.Event()
        self._release = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socks: list[zmq.Socket[bytes]] = []

    def socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._socks.append(sock)
        return sock

    def run(self) -> None:
        try:
            self.work(self)
        except BaseException as exc:
            self.error = exc
        finally:
            self.sent.set()
            self._release.wait(120)
            for sock in self._socks:
                sock.close(0)
            self._ctx.term()

    def release(self) -> None:
        self._release.set()
        self.join()


def test_a_flood_of_malformed_replay_requests_is_counted_and_leaves_ping_and_health_answered(
    sidecar_factory: StartSidecar, short_dir: Path
) -> None:
    sc, _, replay = start(sidecar_factory, short_dir)
    frames = 200_000

    def flood(f: Flood) -> None:
        sock = f.socket(zmq.DEALER)
        sock.connect(replay)
        for _ in range(frames):
            sock.send(b"x")  # blocks at the high-water mark: paced by the sidecar's reading
        big = f.socket(zmq.DEALER)  # frames far over any request's size
        big.connect(replay)
        for _ in range(4):
            big.send_multipart([b"", b"\0" * (32 << 20)])

    rss0 = rss_bytes(sc.proc.pid)
    attacker = Flood(flood)
    attacker.start()
    bad = "kvdepot_kv_events_bad_requests_total"
    answered_while(sc, lambda: not attacker.sent.is_set() or metrics(sc).get(bad, 0) < frames)
    attacker.release()
    assert attacker.error is None
    assert metrics(sc)[bad] >= frames
    complaints = [ln for ln in sc.lines if "kv_events_bad_replay_request" in ln]
    assert 1 <= len(complaints) < frames / 1000  # rate-limited, each line naming how many it stands for
    assert rss_bytes(sc.proc.pid) - rss0 < 64 << 20  # the 32 MiB frames were never buffered
    c = KVDepotClient(sc.url, model="m", layout=LAYOUT, timeout_s=HANG_S, map_arena=False)
    c.ping()
    c.close()


def test_a_flood_of_unique_subscriptions_drops_the_peer_bounds_rss_and_leaves_ping_and_health_answered(
    sidecar_factory: StartSidecar, short_dir: Path
) -> None:
    sc, pub, _ = start(sidecar_factory, short_dir)
    topics = 200_000

    def flood(f: Flood) -> None:
        sock = f.socket(zmq.XSUB)
        sock.setsockopt(zmq.SNDHWM, 0)  # nothing dropped on the attacker's side
        sock.connect(pub)  # (dropped, it reconnects and sends every filter it holds again)
        for i in range(topics):
            # half look like this sidecar's topics (kv@h@<model>), half like nothing it publishes
            sock.send(b"\x01" + (f"kv@{HOST}@m{i:08d}" if i % 2 else f"junk-{i:08d}").encode())

    def flooding() -> bool:
        m = metrics(sc)
        handled = m.get("kvdepot_kv_events_subscriptions_refused_total", 0)
        handled += m["kvdepot_kv_events_subscribers"]
        # the peer dropped and back several times, or (without dropping) every filter taken in
        return m.get("kvdepot_kv_events_peers_dropped_total", 0) < 3 and handled < topics

    rss0 = rss_bytes(sc.proc.pid)
    attacker = Flood(flood)
    attacker.start()
    answered_while(sc, lambda: not attacker.sent.is_set() or flooding())
    assert attacker.error is None
    m = metrics(sc)
    assert m["kvdepot_kv_events_subscribers"] <= 1024  # the cap on distinct model filters
    growth = rss_bytes(sc.proc.pid) - rss0
    print(json.dumps({"subscription_flood_rss_growth_mib": growth >> 20}))
    assert growth < 16 << 20  # libzmq holds no more than a budget of refused filters per peer
    assert m["kvdepot_kv_events_peers_dropped_total"] >= 1
    attacker.release()
    answered_while(sc, lambda: False)  # the attacker's connections going cost the loop nothing long

    # the attacker gone, so are its subscriptions; a real subscriber (every topic) gets the events
    wait_for(lambda: metrics(sc)["kvdepot_kv_events_subscribers"] == 0, what="the unsubscriptions")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    try:
        wait_for(lambda: metrics(sc)["kvdepot_kv_events_subscribers"] >= 1, what="the subscription")
        with KVDepotClient(sc.url, model="m", layout=LAYOUT, timeout_s=HANG_S).connect() as c:
            import torch

            chunk = [torch.zeros(LAYOUT.chunk_bytes // 2, dtype=torch.float16)]
            assert c.store(list(range(16)), chunk, request_id="w").stored == 1
        assert sub.poll(int(HANG_S * 4000)), "no event reached the real subscriber"
        topic, _, _ = sub.recv_multipart()
        assert topic == f"kv@{HOST}@m".encode()
    finally:
        sub.close(0)
        ctx.term()


def test_the_ipc_sockets_are_private_to_the_sidecar_s_user(
    sidecar_factory: StartSidecar, short_dir: Path
) -> None:
    _, pub, replay = start(sidecar_factory, short_dir)
    for endpoint in (pub, replay):
        mode = stat.S_IMODE(os.stat(endpoint[len("ipc://") :]).st_mode)
        assert mode == 0o600, oct(mode)
