"""`kvdepot bench fuzz --surface router` (bench/fuzz_fleet.py runs it): a real `kvdepot route` in
front of the bench's fake engine and directory (bench/route_peers.py), while the pinger GETs its
`/health`. Each frame is one TCP connection to the router carrying random bytes, a malformed request
line, oversized or Connection-listed headers, a bad JSON body, a half-sent request, or now and then
a valid completion. At the end the router must serve a real completion (`served`) and answer
`/health` while its peers still run (`alive`).

State (one attack): counters; the peers' processes until it ends.
Primitives: router_target(args, tmp) -> (figures, the router's process, its port).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.fuzz_watch import get_status, over_budget, rss_mb, start_pinger, stop_pinger
from bench.route import _free_port, _spawn
from bench.sidecar import stop_process


def _router_frame(rng: random.Random) -> tuple[str, bytes]:
    body = json.dumps({"model": "base", "prompt": [1, 2, 3], "max_tokens": 1}).encode()
    kind = rng.choice(("random", "line", "headers", "connection", "json", "half", "valid", "length"))
    if kind == "random":
        return kind, rng.randbytes(rng.randrange(1, 512))
    if kind == "line":
        return kind, rng.choice((b"GET\r\n\r\n", b"POST /v1/completions HTTP/9.9\r\n\r\n", b"\r\n" * 50,
                                 b"GET " + b"/" * 70_000 + b" HTTP/1.1\r\n\r\n"))  # fmt: skip
    if kind == "headers":
        return kind, b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: " + b"a" * 100_000 + b"\r\n\r\n"
    if kind == "connection":
        return kind, (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close, X-Secret\r\n"
                      b"X-Secret: 1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(body), body))  # fmt: skip
    if kind == "json":
        bad = rng.choice((b"{", b"[]", b'{"model": 1, "prompt": {}}', rng.randbytes(64)))
        return kind, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
            len(bad),
            bad,
        )
    if kind == "half":
        return kind, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{"
    if kind == "length":
        return kind, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"
    return kind, (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip


def _attack_router(args: argparse.Namespace, port: int, pid: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    kinds: Counter[str] = Counter()
    refused = sent = 0
    rss_start = rss_mb(pid)
    start = time.monotonic()
    for i in range(args.frames):
        if over_budget(args, pid, rss_start, i):
            break
        sent += 1
        name, data = _router_frame(rng)
        kinds[name] += 1
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=args.hang_s) as s:
                s.sendall(data)
                if name == "valid":
                    s.recv(4096)
        except OSError:
            refused += 1  # closed early, refused past the connection limit, or reset mid-send
    return {"frames_sent": sent, "kinds": dict(sorted(kinds.items())), "connections_refused": refused,
            "stalled_sockets": 0, "rss_exceeded": sent < args.frames,
            "elapsed_s": time.monotonic() - start}  # fmt: skip


def router_target(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], subprocess.Popen[bytes], int]:
    engine_port, directory_port, port = _free_port(), _free_port(), _free_port()
    peers = [_spawn(["-m", "bench.route_peers", "engine", "--port", str(engine_port)],
                    engine_port, "/health"),
             _spawn(["-m", "bench.route_peers", "directory", "--port", str(directory_port)],
                    directory_port, "/health")]  # fmt: skip
    try:
        config = tmp / "route.toml"
        config.write_text(
            f'directory_url = "http://127.0.0.1:{directory_port}"\nlog_level = "warning"\n'
            f'[[engines]]\nurl = "http://127.0.0.1:{engine_port}"\nsidecar_id = "sc-0"\n'
        )
        proc = _spawn(
            ["-m", "app.cli", "route", "--config", str(config), "--http-port", str(port)], port, "/health"
        )
        pinger = start_pinger(args, None, f"http://127.0.0.1:{port}")
        rss_start = rss_mb(proc.pid)
        try:
            attack = _attack_router(args, port, proc.pid)
        finally:
            pings = stop_pinger(pinger)
        attack |= {"rss_start_mb": rss_start, "rss_end_mb": rss_mb(proc.pid)}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            body = json.dumps({"model": "base", "prompt": [1, 2, 3], "max_tokens": 1})
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            attack["served"] = conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            attack["served"] = False
        finally:
            conn.close()
        # alive while its engine and directory still are: its /health follows its engines
        attack["alive"] = proc.poll() is None and get_status(port, "/health", 30) == 200
    finally:
        for peer in peers:  # a peer slow to stop is killed: the storm's figures are not lost
            stop_process(peer)
    return attack | pings, proc, port
