"""A connection flood at a real sidecar's lifeline socket (a local peer of the sidecar's uid, with
no token): every /health and data-plane PING asked meanwhile is answered, the refusals and drops
are counted, and the sidecar's log says so in a bounded number of lines, not one line per
connection (writing them was what delayed its loop)."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from pathlib import Path

from tests.integration.conftest import StartSidecar
from tests.integration.dp_client import client

#: connections the flood opens; each is held until `HELD` are open (past the per-uid limit, 512:
#: the rest are refused), then all are closed (dropped: they never said hello)
CONNECTIONS = 12_000
HELD = 600
#: an answer this long in coming is a hang (the flood delays answers, it must not stop them)
ANSWER_S = 20.0


def _flood(path: str, stop: threading.Event, opened: list[int]) -> None:
    held: list[socket.socket] = []
    try:
        for i in range(CONNECTIONS):
            if stop.is_set():
                return
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                if i % 3 == 0:
                    sock.send(b"\xff\xff\xff\xff" if i % 2 else b"\x00\x00\x00\x01x")
            except OSError:
                sock.close()
                continue
            held.append(sock)
            opened[0] += 1
            if len(held) >= HELD:
                for s in held:
                    s.close()
                held.clear()
    finally:
        for s in held:
            s.close()


def _health(http: str) -> int:
    with urllib.request.urlopen(http + "/health", timeout=ANSWER_S) as resp:
        return int(resp.status)


def _lifeline_lines(lines: list[str]) -> list[dict[str, object]]:
    found = []
    for line in list(lines):
        if '"lifeline_' not in line:
            continue
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found


def test_a_lifeline_connection_flood_neither_stalls_the_sidecar_nor_floods_its_log(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    data_dir = tmp_path / "sc"
    sc = sidecar_factory(data_dir=data_dir, env={"KVDEPOT_L1__CHUNK_SIZE": "16"}, l1_size_gb=0.02)
    dp = client(sc.url)
    stop = threading.Event()
    opened = [0]
    flood = threading.Thread(target=_flood, args=(str(data_dir / "lifeline.sock"), stop, opened), daemon=True)
    answered = asked = 0
    flood.start()
    try:
        while flood.is_alive():
            asked += 2
            assert _health(sc.http) == 200
            dp.ping()  # raises past the client's timeout
            answered += 2
    finally:
        stop.set()
        flood.join(60)
        dp.close()
    assert answered == asked and asked >= 2
    assert opened[0] >= CONNECTIONS // 2, opened  # the flood ran
    assert _health(sc.http) == 200
    lines = _lifeline_lines(sc.lines)
    # one line per 10 s and kind at most (each with the count it stands for), not one per connection
    assert len(lines) <= 20, (len(lines), lines[:3])
    kinds = ("lifeline_refused", "lifeline_dropped")
    counted = sum(int(str(x.get("refused", 0))) for x in lines if x.get("event") in kinds)
    assert counted >= 1
