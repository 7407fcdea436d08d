"""The worker registry with real processes: an engine worker SIGKILLed while it holds read locks and
a reservation lets go of them at once; one SIGSTOPped past the worker timeout is suspect, loses its
locks, keeps its reservation quarantined, and after SIGCONT its late writes are never served; a
heartbeat flood does not starve the loop; a malformed heartbeat closes only that lifeline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import msgspec
import torch

from bench.sidecar import SidecarProcess
from kvdepot_connector.lifeline import HEADER, LifelineClient, Refused, decode_body
from kvdepot_connector.protocol import SlotStatus
from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import LAYOUT, chunk_data, client, request_tokens
from tests.integration.waiting import wait_for

CHUNK_BYTES = LAYOUT.chunk_bytes  # 64 KiB
SMALL_L1 = 1 / 1024  # 16 chunks
ENV = {
    "KVDEPOT_L1__CHUNK_SIZE": "16",
    "KVDEPOT_L2__ADAPTERS": "[]",
    "KVDEPOT_L1__WRITE_LEASE_S": "600",  # no lease frees anything here: only the registry does
    "KVDEPOT_L1__READ_LEASE_S": "600",
    "KVDEPOT_L1__MAX_REQUEST_SHARE": "1.0",
    "KVDEPOT_L1__HIGH_WATERMARK": "1.0",
    "KVDEPOT_L1__LOW_WATERMARK": "1.0",
    # a stalled worker's 4 quarantined chunks do not bar its instance from new reservations, nor
    # anyone from storing the whole of L1 (quarantined and in flight: no cap but L1 itself here)
    "KVDEPOT_L1__QUARANTINE_MAX_BYTES": str(1 << 40),
    "KVDEPOT_L1__QUARANTINE_TOTAL_MAX_BYTES": str(1 << 40),
    "KVDEPOT_FLEET__HEARTBEAT_S": "0.2",
    "KVDEPOT_FLEET__WORKER_TIMEOUT_S": "1.0",
}


def worker(url: str, chunks: int, seed: int, mode: str = "worker-hold") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.dp_client", mode, url, str(chunks), str(seed)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def line_of(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    return proc.stdout.readline().split()


def tell(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def the_worker(sc: SidecarProcess, pid: int) -> dict[str, Any]:
    for instance in sc.get_json("/workers")["instances"]:
        for w in instance["workers"]:
            if w["pid"] == pid:
                return dict(w)
    raise AssertionError(f"no worker with pid {pid} in /workers")


def state(sc: SidecarProcess, pid: int) -> str:
    return str(the_worker(sc, pid)["state"])


def measure(predicate: Any, bound_s: float, what: str) -> float:
    """Seconds until `predicate()` holds; fails past `bound_s` (a bound on waiting)."""
    start = time.monotonic()
    wait_for(predicate, timeout=bound_s, what=what)
    return time.monotonic() - start


def report(name: str, **figures: object) -> None:
    print(json.dumps({"test": name, **figures}), file=sys.stderr)


def finish(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


def test_a_killed_worker_lets_go_of_its_locks_and_reservation_within_a_second(
    sidecar_factory: StartSidecar,
) -> None:
    sc = sidecar_factory(env=ENV, l1_size_gb=SMALL_L1)
    victim = worker(sc.url, 8, 5)
    other = client(sc.url)
    try:
        words = line_of(victim)
        assert words[:3] == ["held", "8", "4"], words
        w = the_worker(sc, victim.pid)
        assert (w["state"], w["role"], w["rank"]) == ("alive", "worker", 0)
        wait_for(lambda: the_worker(sc, victim.pid)["heartbeats"] >= 2, timeout=10, what="heartbeats")
        # While it lives, its 8 locked and 4 reserved chunks leave 4 of 16 free.
        probe = other.reserve(request_tokens(90, 5), request_id="probe")
        oids = [s.oid for s in probe.slots if s.status is SlotStatus.RESERVED]
        assert len(oids) == 4 and probe.slots[4].status is SlotStatus.NO_SPACE
        assert other.abort(oids) == 4
        os.kill(victim.pid, signal.SIGKILL)
        start = time.monotonic()

        def released() -> bool:
            l1 = sc.get_json("/status")["l1"]
            return l1["locked_requests"] == 0 and l1["objects_by_state"]["write_reserved"] == 0

        released_s = measure(released, 1.0, "the killed worker's locks and reservation released")
        wait_for(lambda: state(sc, victim.pid) == "dead", timeout=max(1.0 - released_s, 0.05), what="dead")
        report("sigkill", released_s=round(released_s, 3), dead_s=round(time.monotonic() - start, 3))
        # Its memory is reusable: the whole of L1 takes a new store.
        toks = request_tokens(99, 16)
        assert other.store(toks, [chunk_data(99, i) for i in range(16)], request_id="w").stored == 16
        l1 = sc.get_json("/status")["l1"]
        assert l1["allocator_ok"] and l1["used_bytes"] == 16 * CHUNK_BYTES
        assert l1["counters"]["gone_locks"] == 1 and l1["counters"]["gone_reservations"] == 4
        assert l1["counters"]["expired_locks"] == l1["counters"]["expired_reservations"] == 0
        assert sc.get_json("/workers")["totals"]["dead"] >= 1
    finally:
        other.close()
        finish(victim)


def test_a_stalled_worker_is_suspect_loses_its_locks_and_its_late_writes_are_never_served(
    sidecar_factory: StartSidecar,
) -> None:
    sc = sidecar_factory(env=ENV, l1_size_gb=SMALL_L1)
    victim = worker(sc.url, 8, 5)
    other = client(sc.url)
    try:
        words = line_of(victim)
        assert words[:3] == ["held", "8", "4"], words
        reserved_offsets = {int(x) for x in words[3:]}
        wait_for(lambda: the_worker(sc, victim.pid)["heartbeats"] >= 2, timeout=10, what="heartbeats")
        os.kill(victim.pid, signal.SIGSTOP)  # a GC pause, a stuck engine step: alive, silent
        suspect_s = measure(lambda: state(sc, victim.pid) == "suspect", 5.0, "the stalled worker suspect")
        report("sigstop", worker_timeout_s=1.0, heartbeat_s=0.2, suspect_after_stop_s=round(suspect_s, 3))
        l1 = sc.get_json("/status")["l1"]
        assert l1["locked_requests"] == 0
        assert (l1["quarantined_objects"], l1["quarantined_bytes"]) == (4, 4 * CHUNK_BYTES)
        assert l1["counters"]["suspect_locks"] == 1 and l1["counters"]["suspect_reservations"] == 4
        # Its locks are gone: another client takes the 4 free chunks, storing the very keys the
        # stalled worker had reserved, with its own bytes.
        theirs = request_tokens(6, 4)  # the worker's reserved chunks (seed + 1)
        mine = [chunk_data(77, i) for i in range(4)]
        reply = other.reserve(theirs, request_id="other")
        got = [s for s in reply.slots if s.status is SlotStatus.RESERVED]
        assert len(got) == 4
        for s in got:
            other.slot_view(s).copy_(mine[s.chunk].view(torch.uint8))
        assert all(other.commit([s.oid for s in got]))
        assert other.lookup(theirs, request_id="keep").hit_chunks == 4  # held by us while it wakes
        assert not {s.offset for s in got} & reserved_offsets, "its quarantined memory was reused"
        # The 8 chunks it had locked are no longer locked, but they are in its write domain: its
        # process lives (stalled), so no other instance may write there, and nothing of ours is
        # evicted for room we could not use.
        more = other.reserve(request_tokens(91, 8), request_id="more").slots
        assert [s.status for s in more] == [SlotStatus.NO_SPACE] * 8
        assert sc.get_json("/status")["l1"]["allocator_ok"]
        # It wakes up: its late writes and its commit land nowhere, its release is invalid.
        os.kill(victim.pid, signal.SIGCONT)
        tell(victim)
        assert line_of(victim) == ["late", "0", "0", "0", "0", "valid=0"]
        assert other.lookup(theirs, request_id="read").hit_chunks == 4
        outs = [torch.empty(CHUNK_BYTES // 2, dtype=torch.float16) for _ in range(4)]
        assert other.retrieve("read", outs)
        served = all(torch.equal(o, mine[i]) for i, o in enumerate(outs))
        assert served, "the stalled worker's bytes were served"
        # It heartbeats again: alive, and it works with a clean new state.
        wait_for(lambda: state(sc, victim.pid) == "alive", timeout=5, what="the worker alive again")
        w = the_worker(sc, victim.pid)
        assert (w["suspected"], w["revived"]) == (1, 1)
        tell(victim)
        assert line_of(victim) == ["fresh", "2", "2", "identical"]
        # Its late commit said it writes there no more: its quarantine went then, not at its end.
        assert sc.get_json("/status")["l1"]["quarantined_objects"] == 0
        text = sc.get_json("/workers")
        assert text["totals"]["suspect"] == 1 and text["totals"]["revived"] == 1
        assert any('"worker_suspect"' in line for line in sc.lines)
        finish(victim)
        wait_for(lambda: sc.get_json("/status")["l1"]["quarantined_objects"] == 0, timeout=5, what="freed")
        assert sc.get_json("/status")["l1"]["allocator_ok"]
    finally:
        other.close()
        finish(victim)


def test_a_heartbeat_flood_does_not_starve_the_sidecar(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=ENV, l1_size_gb=SMALL_L1)
    flooder = worker(sc.url, 1, 1, mode="flood-heartbeats")
    c = client(sc.url)  # 10 s timeout: a starved loop fails its calls
    try:
        assert line_of(flooder) == ["flooding"]
        flooding_from = the_worker(sc, flooder.pid)["heartbeats"]
        toks = request_tokens(3, 4)
        for i in range(20):
            c.ping()
            assert c.store(toks, [chunk_data(3, j) for j in range(4)], request_id=f"w{i}").complete
            with urllib.request.urlopen(sc.http + "/health", timeout=10) as answer:
                assert answer.read() == b"OK"
        assert flooder.poll() is None, "the flooder was cut off"
        assert the_worker(sc, flooder.pid)["heartbeats"] > flooding_from  # it was being read
    finally:
        c.close()
        finish(flooder)


def test_a_malformed_heartbeat_closes_that_lifeline_only(sidecar_factory: StartSidecar) -> None:
    sc = sidecar_factory(env=ENV, l1_size_gb=SMALL_L1)
    good = client(sc.url)
    bad = client(sc.url)
    try:
        session = bad._session
        session._stop_heartbeats()
        line = session.lifeline
        assert line is not None
        bad_pid = os.getpid()
        body = msgspec.msgpack.encode({"op": "heartbeat", "seq": 1, "junk": "x" * 10})
        with _raw(line) as raw:
            raw.sendall(HEADER.pack(len(body)) + body)
            answer = _read_frame(raw)
            assert isinstance(answer, Refused) and "bad frame" in answer.reason, answer
            assert raw.recv(1) == b"", "the lifeline stays open"
        toks = request_tokens(4, 2)
        assert good.store(toks, [chunk_data(4, i) for i in range(2)], request_id="w").stored == 2
        dead = [w for i in sc.get_json("/workers")["instances"] for w in i["workers"] if w["state"] == "dead"]
        assert [w["pid"] for w in dead] == [bad_pid]  # one dead worker; `good` (same pid) is alive
        assert good.ping() >= 0
    finally:
        good.close()
        bad.close()


def _raw(line: LifelineClient) -> Any:
    import socket

    sock = socket.socket(fileno=os.dup(line.fileno()))
    sock.settimeout(5)
    return sock


def _read_frame(sock: Any) -> object:
    buf = b""
    while len(buf) < HEADER.size:
        buf += sock.recv(HEADER.size - len(buf))
    (n,) = HEADER.unpack(buf)
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    return decode_body(body)
