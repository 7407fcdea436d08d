"""PeerDropper against real XPUB sockets: a peer past its budget of refused filters has its
connections to that endpoint shut down (and only those); the key is libzmq's Peer-Address."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from api.kvevents.peers import PeerDropper


class Sockets:
    """A context whose sockets are kept (and closed at the end) by the fixture."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.opened: list[zmq.Socket[bytes]] = []

    def socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.opened.append(sock)
        return sock


@pytest.fixture
def ctx() -> Iterator[Sockets]:
    s = Sockets()
    yield s
    for sock in s.opened:
        sock.close(0)
    s.ctx.term()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvpeer-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def xpub(ctx: Sockets, endpoint: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.XPUB_MANUAL, 1)
    sock.bind(endpoint)
    return sock


def peer_address(pub: zmq.Socket[bytes]) -> str:
    assert pub.poll(5000), "no subscription arrived"
    frame = pub.recv(copy=False)
    pub.setsockopt(zmq.SUBSCRIBE, frame.bytes[1:])  # XPUB_MANUAL: applied by hand
    address = frame.get("Peer-Address")
    assert isinstance(address, str)
    return address


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_peer_past_its_budget_is_disconnected_and_other_endpoints_keep_theirs(
    ctx: Sockets, short_dir: Path, transport: str
) -> None:
    if transport == "ipc":
        endpoints = [f"ipc://{short_dir}/a.sock", f"ipc://{short_dir}/b.sock"]
    else:
        endpoints = ["tcp://127.0.0.1:0", "tcp://127.0.0.1:0"]
    pubs = [xpub(ctx, e) for e in endpoints]
    bound = [p.getsockopt_string(zmq.LAST_ENDPOINT) for p in pubs]
    pubs[0].monitor(f"inproc://monitor-{transport}", zmq.EVENT_DISCONNECTED)
    monitor = ctx.socket(zmq.PAIR)
    monitor.connect(f"inproc://monitor-{transport}")
    subs = []
    for e in bound:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RECONNECT_IVL, 60_000)  # dropped, it stays away for this test
        sub.subscribe(b"junk")
        sub.connect(e)
        subs.append(sub)
    address = peer_address(pubs[0])
    peer_address(pubs[1])
    dropper = PeerDropper(bound[0], budget=3)
    dropper.refused(address)
    dropper.refused(address)
    assert dropper.dropped == 0  # under the budget
    dropper.refused(address)
    assert (dropper.dropped, dropper.peers_dropped) == (1, 1)
    assert monitor.poll(5000), "the connection was not dropped"
    # the other endpoint's connection (the same peer) is not this dropper's
    assert PeerDropper(bound[1], budget=1000).dropped == 0
    pubs[1].send_multipart([b"junk", b"still here"])
    assert subs[1].poll(5000), "the other endpoint's subscriber was cut off"
    assert subs[1].recv_multipart() == [b"junk", b"still here"]


def test_a_peer_address_libzmq_gives_is_keyed_as_the_descriptor_s_peer() -> None:
    ipc = PeerDropper("ipc:///nowhere.sock", budget=1)
    assert ipc._key("localhost:1000:1000:4242") == "1000:1000:4242"
    assert ipc._key("") is None
    assert ipc._key(None) is None
    assert ipc._key("nocolons") is None
    tcp = PeerDropper("tcp://127.0.0.1:5557", budget=1)
    assert tcp._key("10.0.0.1") == "10.0.0.1"
    assert tcp._key("[::1]") == "::1"
    tcp.refused("10.9.9.9")  # nobody of that address connected: nothing to shut
    assert (tcp.dropped, tcp.peers_dropped) == (0, 1)
