"""Fencing with real processes: a writer stalled (SIGSTOP) past its write lease keeps its memory
quarantined until it is gone or commits late (done with it), so its late bytes land nowhere another
client reads; an instance over its quarantine cap is refused, another is not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request

import torch

from bench.sidecar import SidecarProcess
from kvdepot_connector.protocol import SlotStatus
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens
from tests.integration.waiting import wait_for

CHUNK_BYTES = LAYOUT.chunk_bytes  # 64 KiB
FENCE_ENV = {
    "KVDEPOT_L1__CHUNK_SIZE": "16",
    "KVDEPOT_L1__WRITE_LEASE_S": "1.0",
    "KVDEPOT_L1__READ_LEASE_S": "600",
    "KVDEPOT_L1__REAP_INTERVAL_S": "0.1",
    "KVDEPOT_L1__MAX_REQUEST_SHARE": "1.0",
    "KVDEPOT_L1__HIGH_WATERMARK": "1.0",
    "KVDEPOT_L1__LOW_WATERMARK": "1.0",
    "KVDEPOT_L2__ADAPTERS": "[]",  # no L2: every segment of the arena may go to engines' write domains
}


def metrics(sc: SidecarProcess) -> str:
    with urllib.request.urlopen(sc.http + "/metrics", timeout=5) as answer:
        text: str = answer.read().decode()
    return text


def writer(url: str, chunks: int, seed: int) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.dp_client", "stall-write", url, str(chunks), str(seed)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    assert words[0] == "reserved", words
    return proc, [int(w) for w in words[1:]]


#: the whole of L1 may be quarantined or in flight: a stalled writer of half of it beside a store of
#: the other half (the default total, 3/4 of L1, would refuse a quarter of that store)
WHOLE_L1_AT_RISK = {"KVDEPOT_L1__QUARANTINE_TOTAL_MAX_BYTES": str(1 << 40)}


def test_a_stalled_writers_late_bytes_land_only_in_quarantine(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=FENCE_ENV | WHOLE_L1_AT_RISK, l1_size_gb=1 / 1024)  # 16 chunks
    stalled, offsets = writer(sc.url, 8, 5)
    assert len(offsets) == 8 and stalled.stdin is not None and stalled.stdout is not None
    os.kill(stalled.pid, signal.SIGSTOP)  # a GC pause, an overloaded worker: alive, not writing
    c = client(sc.url)
    try:
        wait_for(lambda: sc.get_json("/status")["l1"]["counters"]["expired_reservations"] >= 8)
        # Another client stores the same chunks (the keys are free again) while the writer sleeps.
        toks = request_tokens(5, 8)
        mine = [chunk_data(77, i) for i in range(8)]
        reply = c.reserve(toks, request_id="other")
        got = [s for s in reply.slots if s.status is SlotStatus.RESERVED]
        assert len(got) == 8
        for s in got:
            c.slot_view(s).copy_(mine[s.chunk].view(torch.uint8))
        assert all(c.commit([s.oid for s in got]))
        assert not {s.offset for s in got} & set(offsets), "the stalled writer's extent was handed out"
        l1 = sc.get_json("/status")["l1"]
        assert (l1["quarantined_objects"], l1["quarantined_bytes"]) == (8, 8 * CHUNK_BYTES)
        assert l1["counters"]["quarantined"] == 8
        assert "kvdepot_l1_quarantined_bytes 524288.0" in metrics(sc)
        # The writer wakes up and writes where it was told to, then tries to commit: refused, and
        # with that commit it is done with those extents, so its quarantine goes at once.
        os.kill(stalled.pid, signal.SIGCONT)
        stalled.stdin.write("go\n")
        stalled.stdin.flush()
        assert stalled.stdout.readline().split() == ["committed"] + ["0"] * 8  # lease expired
        assert c.lookup(toks, request_id="read").hit_chunks == 8
        outs = [torch.empty(CHUNK_BYTES // 2, dtype=torch.float16) for _ in range(8)]
        valid = c.retrieve("read", outs)
        assert valid and all(torch.equal(o, mine[i]) for i, o in enumerate(outs)), "the writer's bytes"
        l1 = sc.get_json("/status")["l1"]
        assert (l1["quarantined_objects"], l1["counters"]["quarantine_freed"]) == (0, 8)
        assert l1["allocator_ok"] and l1["used_bytes"] == 8 * CHUNK_BYTES
    finally:
        c.close()
        stalled.kill()
        stalled.wait()
        stalled.stdin.close()
        stalled.stdout.close()


def test_an_instance_over_its_quarantine_cap_is_refused_and_another_is_not(
    sidecar_factory: StartSidecar,
) -> None:
    env = FENCE_ENV | {"KVDEPOT_L1__QUARANTINE_MAX_BYTES": str(2 * CHUNK_BYTES)}
    sc = sidecar_factory(env=env, l1_size_gb=2 / 1024)  # 32 chunks
    stalled_client = client(sc.url)  # one instance; its stalled store leaves 2 chunks quarantined
    other = client(sc.url)  # another instance
    try:
        # It asks for 4; it may reserve only what it may still quarantine: 2 (the other 2 are refused).
        reply = stalled_client.reserve(request_tokens(1, 4), request_id="stalled")
        assert [s.status for s in reply.slots] == [SlotStatus.RESERVED] * 2 + [SlotStatus.NO_SPACE] * 2
        wait_for(lambda: sc.get_json("/status")["l1"]["quarantined_objects"] == 2)
        toks = request_tokens(2, 2)
        refused = stalled_client.store(toks, [chunk_data(2, i) for i in range(2)], request_id="again")
        assert (refused.stored, refused.no_space) == (0, 2)
        assert other.store(toks, [chunk_data(2, i) for i in range(2)], request_id="w").stored == 2
        l1 = sc.get_json("/status")["l1"]
        assert l1["counters"]["quarantine_refused"] == 2 and l1["quarantine_max_bytes"] == 2 * CHUNK_BYTES
        assert "kvdepot_l1_quarantine_refusals_total 2.0" in metrics(sc)
        stalled_client.close()  # its lifeline closes: the quarantine goes
        wait_for(lambda: sc.get_json("/status")["l1"]["quarantined_objects"] == 0)
        assert sc.get_json("/status")["l1"]["allocator_ok"]
    finally:
        stalled_client.close()
        other.close()
