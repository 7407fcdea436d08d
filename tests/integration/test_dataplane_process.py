"""The data plane with real processes: a sidecar, clients in other processes, SIGKILLed clients."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import msgspec
import torch
import zmq

from kvdepot_connector import protocol as p
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens
from tests.integration.waiting import wait_for

CHUNK_ENV = {"KVDEPOT_L1__CHUNK_SIZE": "16"}
CHUNK_BYTES = LAYOUT.chunk_bytes  # 64 KiB


def run_client(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.dp_client", *args], stdout=subprocess.PIPE, text=True
    )


def test_client_process_stores_and_retrieves_identical_bytes(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=CHUNK_ENV, l1_size_gb=0.02)
    proc = run_client("store-retrieve", sc.url, "16", "7")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"hits_after_store": [16, 16, 16, 16], "identical": True, "stored": 64}
    status = sc.get_json("/status")["l1"]
    assert status["allocator_ok"] and status["counters"]["hit_chunks"] >= 64


def test_too_small_l1_gives_explicit_no_space_and_never_wrong_bytes(sidecar_factory: StartSidecar) -> None:
    # 16 chunks of 64 KiB fit in 1 MiB; each request has 24. L1 alone: a lookup's prefetch from an
    # L2 would load evicted chunks back (evicting others) at its own pace, and make the hits a race.
    env = CHUNK_ENV | {"KVDEPOT_L1__SIZE_GB": str(1 / 1024), "KVDEPOT_L2__ADAPTERS": "[]"}
    sc = sidecar_factory(env=env, l1_size_gb=1 / 1024)
    c = client(sc.url)
    try:
        for seed in (1, 2, 3):
            toks = request_tokens(seed, 24)
            outcome = c.store(toks, [chunk_data(seed, i) for i in range(24)], request_id=f"w{seed}")
            assert outcome.no_space > 0 and outcome.stored + outcome.no_space == 24
            assert not outcome.complete
        for seed in (1, 2, 3):  # whatever still hits must be exactly what was stored
            toks = request_tokens(seed, 24)
            hit = c.lookup(toks, request_id=f"r{seed}").hit_chunks
            if not hit:
                continue
            outs = [torch.empty(CHUNK_BYTES // 2, dtype=torch.float16) for _ in range(hit)]
            assert c.retrieve(f"r{seed}", outs)
            assert all(torch.equal(o, chunk_data(seed, i)) for i, o in enumerate(outs))
        l1 = sc.get_json("/status")["l1"]
        assert l1["counters"]["no_space_chunks"] > 0 and l1["allocator_ok"]
        assert l1["counters"]["retrieved_chunks"] > 0
    finally:
        c.close()


LONG_LEASES = CHUNK_ENV | {
    "KVDEPOT_L1__WRITE_LEASE_S": "600",  # far beyond the test: no lease frees anything here
    "KVDEPOT_L1__READ_LEASE_S": "600",
    "KVDEPOT_L1__MAX_REQUEST_SHARE": "1.0",
    "KVDEPOT_L2__ADAPTERS": "[]",  # no L2: every segment of the arena may go to engines' write domains
    # a store of the whole of L1 in flight: no quarantine budget but L1 itself here
    "KVDEPOT_L1__QUARANTINE_MAX_BYTES": str(1 << 40),
    "KVDEPOT_L1__QUARANTINE_TOTAL_MAX_BYTES": str(1 << 40),
}


def test_a_killed_clients_locks_and_reservations_go_at_once(sidecar_factory: StartSidecar) -> None:
    """A client SIGKILLed while it holds read locks and write reservations: its lifeline closes,
    and they are released at once, not after their leases (10 minutes here)."""
    sc = sidecar_factory(env=LONG_LEASES, l1_size_gb=2 / 1024)  # room for 32 chunks
    victim = run_client("lock-reserve-hang", sc.url, "8", "5")
    assert victim.stdout is not None
    assert victim.stdout.readline().split() == ["held", "8", "8"]
    l1 = sc.get_json("/status")["l1"]
    assert (l1["locked_requests"], l1["objects_by_state"]["write_reserved"]) == (1, 8)
    victim.kill()  # SIGKILL: no goodbye
    victim.wait()
    victim.stdout.close()

    def released() -> bool:
        l1 = sc.get_json("/status")["l1"]
        return l1["locked_requests"] == 0 and l1["objects_by_state"]["write_reserved"] == 0

    wait_for(released, timeout=10, what="the dead client's locks and reservations released")
    l1 = sc.get_json("/status")["l1"]
    assert l1["counters"]["gone_locks"] == 1 and l1["counters"]["gone_reservations"] == 8
    assert l1["counters"]["expired_reservations"] == l1["counters"]["expired_locks"] == 0
    assert l1["engines"] == [] and l1["allocator_ok"]
    c = client(sc.url)  # the whole of L1 is usable again: the 8 stored chunks are evictable now
    try:
        toks = request_tokens(99, 32)
        assert c.store(toks, [chunk_data(99, i) for i in range(32)], request_id="w").stored == 32
        assert sc.get_json("/status")["l1"]["allocator_ok"]
    finally:
        c.close()


def test_fuzzed_frames_over_the_socket_then_correct_service(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=CHUNK_ENV, l1_size_gb=0.02)
    c = client(sc.url)
    toks = request_tokens(3, 4)
    c.store(toks, [chunk_data(3, i) for i in range(4)], request_id="w")
    rng = random.Random(99)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sc.url)
    valid = p.encode(p.Lookup(id=5, engine_id=c.engine_id, request_id="x", tokens=b"\x00" * 64))
    sent = 0
    try:
        for i in range(3000):
            kind = i % 3
            if kind == 0:
                sock.send(rng.randbytes(rng.randrange(1, 100)))
            elif kind == 1:
                frame = bytearray(valid)
                frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
                sock.send(bytes(frame))
            else:
                sock.send_multipart([rng.randbytes(8), rng.randbytes(8)])  # two frames: refused
            sent += 1
        replies = 0
        while replies < sent and sock.poll(5000):
            msgspec.msgpack.decode(sock.recv())  # every reply is valid msgpack
            replies += 1
        assert replies == sent
    finally:
        sock.close()
        ctx.term()
    try:
        assert c.lookup(toks, request_id="after").hit_chunks == 4
        outs = [torch.empty(CHUNK_BYTES // 2, dtype=torch.float16) for _ in range(4)]
        assert c.retrieve("after", outs)
        assert all(torch.equal(o, chunk_data(3, i)) for i, o in enumerate(outs))
        toks2 = request_tokens(4, 2)
        assert c.store(toks2, [chunk_data(4, i) for i in range(2)], request_id="w2").stored == 2
        assert sc.get_json("/ready") == {"ready": True}
    finally:
        c.close()
