"""Prefix pins are not inflated by data-plane clients: a real `kvdepot serve` process, an honest
engine of model "m", and a second client that registers ~1000 namespaces of the same model over
the data plane (16 instances x 63 kv ranks, no admin token needed).

On main the pins accounted for every namespace of the model registered since the start: a
4-chunk pin was refused as holding 1009 x 4 chunks (264 MB of a 20 MiB L1), and `GET /pins`
checked every chunk in every namespace. Now a pin accounts for the model's namespaces of the
engines registered now (else those seen since the start), at most `pins.max_namespaces` of them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import zmq

from bench.sidecar import SidecarProcess
from kvdepot_connector import protocol as p
from kvdepot_connector.client import KVDepotClient
from kvdepot_connector.lifeline import LifelineClient
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT
from tests.integration.tenant_traffic import CHUNK_BYTES, TOKEN, http, sequence, store
from tests.integration.waiting import wait_for

ENV = {"KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_L2__ADAPTERS": "[]", "KVDEPOT_HTTP__ADMIN_TOKEN": TOKEN}
INSTANCES, PER_INSTANCE = 16, 63
CHUNKS = 4
MAX_NAMESPACES = 16  # pins.max_namespaces, its default


class Flood:
    """Data-plane sessions (each with its lifeline held) registering namespaces of model "m"."""

    def __init__(self, sc: SidecarProcess) -> None:
        self.ctx = zmq.Context()
        self.stack = ExitStack()
        self.registered = 0
        self.sc = sc

    def register(self) -> int:
        for i in range(INSTANCES):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.sc.url)
            self.stack.callback(sock.close)
            said = self._ask(sock, p.Hello(id=0, version=p.PROTOCOL_VERSION, instance=f"{i:032x}"))
            assert isinstance(said, p.HelloReply), said
            line = LifelineClient(said.lifeline_path, said.lifeline_token)
            self.stack.callback(line.close)
            for j in range(PER_INSTANCE):
                rank = 1 + i * PER_INSTANCE + j  # the honest engine is rank 0
                reply = self._ask(sock, p.Register(id=j + 1, model="m", layout=LAYOUT, kv_rank=rank))
                self.registered += isinstance(reply, p.RegisterReply)
        return self.registered

    @staticmethod
    def _ask(sock: zmq.Socket[bytes], msg: p.Request) -> p.Reply:
        sock.send(p.encode(msg))
        assert sock.poll(10_000)
        return p.reply_decoder.decode(sock.recv())

    def close(self) -> None:
        self.stack.close()
        self.ctx.term()


@pytest.fixture
def sidecar(sidecar_factory: StartSidecar) -> SidecarProcess:
    return sidecar_factory(env=ENV, l1_size_gb=0.02)  # 20 MiB: 320 chunks of 64 KiB


@pytest.fixture
def honest(sidecar: SidecarProcess) -> Iterator[KVDepotClient]:
    c = KVDepotClient(sidecar.url, model="m", layout=LAYOUT, timeout_s=30).connect()
    yield c
    c.close()


def pin(sc: SidecarProcess) -> tuple[int, Any]:
    return http(sc, "PUT", "/pins/a", {"model": "m", "token_ids": sequence(0, CHUNKS), "tiers": ["l1"]})


def listing(sc: SidecarProcess) -> tuple[list[dict[str, Any]], float]:
    started = time.monotonic()
    code, body = http(sc, "GET", "/pins")
    assert code == 200, body
    return list(body["pins"]), time.monotonic() - started


def test_namespaces_registered_by_a_data_plane_client_do_not_inflate_pins(
    sidecar: SidecarProcess, honest: KVDepotClient
) -> None:
    code, baseline = pin(sidecar)
    assert code == 200, baseline
    one = baseline["pinned_bytes"]["l1"]
    assert one == CHUNKS * CHUNK_BYTES  # one namespace: 4 chunks of 64 KiB
    assert store(honest, "a", 0, 0, CHUNKS, "s").stored == CHUNKS
    flood = Flood(sidecar)
    try:
        registered = flood.register()
        assert registered >= 64, registered  # the flood's registrations (1008 on main)
        code, answer = pin(sidecar)
        assert code == 200, f"a {CHUNKS}-chunk pin after {registered} namespaces: {answer}"
        assert one <= answer["pinned_bytes"]["l1"] <= MAX_NAMESPACES * one
        pins, took = listing(sidecar)
        assert [x["id"] for x in pins] == [baseline["id"]]
        print(f"namespaces={registered + 1} pinned_bytes={answer['pinned_bytes']} list_s={took:.3f}")
    finally:
        flood.close()
    # The flood gone, a pin accounts for the engines registered now: the honest one alone.
    engines = lambda: len(sidecar.get_json("/status")["l1"]["engines"])  # noqa: E731
    wait_for(lambda: engines() == 1, what="the flood's registrations gone")
    code, again = pin(sidecar)
    assert code == 200, again
    assert again["pinned_bytes"]["l1"] == one
    pins, took = listing(sidecar)
    assert pins[0]["present_chunks"] == {"l1": CHUNKS}
    print(f"after: pinned_bytes={again['pinned_bytes']} list_s={took:.3f}")
