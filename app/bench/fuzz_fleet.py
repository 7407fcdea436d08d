"""`kvdepot bench fuzz` at the fleet's processes: the directory (`kvdepot directory`: registration
over HTTP and its KV-event ingest) and the router (`kvdepot route`), each a real process, while the
pinger GETs its `/health`.

- `directory`: the fuzzer plays a static instance: it serves that instance's `/inventory` (an empty
  listing) and binds the KV-event PUB socket the directory subscribes to. Nine frames in ten are
  event frames on it (well-formed batches with hostile events, sequence jumps, new incarnations,
  random payloads, wrong frame counts, frames up to 1 MiB); one in ten is a registration
  (`POST /v1/instances`) with a hostile body (random JSON, wrong types, bad ids, huge lists) and no
  token, a wrong one or the admin token.
- `router`: the bench's fake engine and directory (app/bench/route_peers.py) behind `kvdepot
  route`; each frame is one TCP connection to the router carrying random bytes, a malformed
  request line, oversized or Connection-listed headers, a bad JSON body, a half-sent request, or
  now and then a valid completion.

At the end the process must be alive, answer `/health`, and serve a real request (the
directory's listing with the admin token; a completion through the router); RSS at start and end.
A target that grows past `--max-rss-growth-mb` stops the storm there (`rss_exceeded`, not ok):
the fuzzer never takes the machine's memory with it.

State (one attack): its sockets, the inventory server's thread, counters. One thread besides the
inventory server's.
Primitives: fleet_surface(args, surface) -> one JSON-able result.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import random
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import zmq

from app.bench.fuzz_watch import rss_mb, start_pinger, stop_pinger
from app.bench.route import _free_port, _spawn
from app.bench.sidecar import stop_process

ADMIN = "fuzz-admin-token"
_SEQ = struct.Struct(">q")


def _rand(rng: random.Random, n: int) -> bytes:
    return rng.getrandbits(8 * n).to_bytes(n, "little") if n else b""


class _Inventory(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"kind": "header", "incarnation": "fuzz", "seq": -1}\n{"kind": "end", "chunks": 0}\n'
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def _event_frames(rng: random.Random, i: int) -> tuple[str, list[bytes]]:
    kind = rng.choice(("batch", "batch", "jump", "incarnation", "random", "frames", "big", "badseq"))
    topic = b"kv@fuzz@test-model"
    stored = {
        "type": "BlockStored",
        "block_hashes": [rng.getrandbits(64) for _ in range(rng.randrange(0, 8))],
        "parent_block_hash": rng.choice((None, rng.getrandbits(64), -1)),
        "token_ids": [1, 2],
        "block_size": rng.choice((0, 16, -1, 1 << 40)),
        "lora_id": None,
        "medium": rng.choice(("CPU", "X")),
    }
    events = [stored, {"type": "BlockRemoved", "block_hashes": [rng.getrandbits(64)], "medium": None},
              {"type": rng.choice(("AllBlocksCleared", "Nope"))}, rng.choice((1, "x", None, []))]  # fmt: skip
    batch = msgspec.msgpack.encode([time.time(), rng.sample(events, rng.randrange(0, 4)), 0, "fuzz"])
    if kind == "batch":
        return kind, [topic, _SEQ.pack(i), batch]
    if kind == "jump":
        return kind, [topic, _SEQ.pack(rng.choice((i + 1000, 1 << 62, -5))), batch]
    if kind == "incarnation":
        other = msgspec.msgpack.encode([time.time(), [], 0, f"other-{rng.getrandbits(16)}"])
        return kind, [topic, _SEQ.pack(0), other]
    if kind == "frames":
        return kind, [topic] * rng.choice((1, 2, 4, 7))
    if kind == "big":
        return kind, [topic, _SEQ.pack(i), _rand(rng, rng.choice((1 << 16, 1 << 20)))]
    if kind == "badseq":
        return kind, [topic, _rand(rng, rng.choice((0, 3, 9))), batch]
    return kind, [topic, _SEQ.pack(i), _rand(rng, rng.randrange(1, 512))]


def _registration(rng: random.Random, inventory: str, events: str) -> tuple[str, bytes, str | None]:
    kind = rng.choice(("spec", "random", "types", "ids", "huge", "json"))
    spec: Any = {"id": f"fuzz-{rng.randrange(64)}", "url": inventory, "events_endpoint": events}
    if kind == "types":
        spec = {**spec, "tiers": "x", "l1_usage": rng.choice((-1, 2, "x", 1e308)), "queue_depth": -1}
    elif kind == "ids":
        spec = {**spec, "id": rng.choice(("", "../x", "a" * 300, "\0", "id with spaces"))}
    elif kind == "huge":
        spec = {**spec, "namespaces": [{"model": "m" * 64, "layout_fp": "00" * 16}] * 10_000}
    elif kind == "json":
        spec = rng.choice(([], 1, None, "x", {"id": {"nested": [1] * 100}}))
    body = _rand(rng, rng.randrange(1, 200)) if kind == "random" else json.dumps(spec).encode()
    return kind, body, rng.choice((None, "wrong-token", ADMIN))


def _over_budget(args: argparse.Namespace, pid: int, rss_start: float, i: int) -> bool:
    """Every 256 frames: has the target grown past --max-rss-growth-mb? (The storm stops there.)"""
    return i % 256 == 255 and rss_mb(pid) - rss_start > args.max_rss_growth_mb


def _attack_directory(args: argparse.Namespace, http_port: int, pub: zmq.Socket[bytes],
                      inventory: str, events: str, *, pid: int) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(args.seed)
    rss_start, sent = rss_mb(pid), 0
    kinds: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=args.hang_s)
    stalled = 0
    start = time.monotonic()
    for i in range(args.frames):
        if _over_budget(args, pid, rss_start, i):
            break
        sent += 1
        if i % 10:
            name, frames = _event_frames(rng, i)
            kinds["event:" + name] += 1
            pub.send_multipart(frames)  # PUB never blocks: a slow directory loses frames (a gap)
            continue
        name, body, token = _registration(rng, inventory, events)
        kinds["register:" + name] += 1
        headers = {"Content-Type": "application/json"} | (
            {"Authorization": f"Bearer {token}"} if token else {}
        )
        try:
            conn.request("POST", "/v1/instances", body, headers)
            resp = conn.getresponse()
            resp.read()
            statuses[str(resp.status)] += 1
        except TimeoutError:
            stalled += 1
            conn.close()
        except (OSError, http.client.HTTPException):
            statuses["closed"] += 1
            conn.close()
    conn.close()
    return {"frames_sent": sent, "kinds": dict(sorted(kinds.items())), "statuses": dict(statuses),
            "stalled_sockets": stalled, "rss_exceeded": sent < args.frames,
            "elapsed_s": time.monotonic() - start}  # fmt: skip


def _get(port: int, path: str, timeout: float, token: str | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


def _directory(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], subprocess.Popen[bytes], int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Inventory)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    inventory = f"http://127.0.0.1:{server.server_address[1]}"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    events = f"tcp://127.0.0.1:{port}"
    config = tmp / "directory.toml"
    config.write_text(f'[http]\nadmin_token = "{ADMIN}"\n[directory]\nsidecar_token = "fuzz-sidecar"\n'
                      f'[[directory.static_instances]]\nid = "fuzz-static"\nurl = "{inventory}"\n'
                      f'events_endpoint = "{events}"\n')  # fmt: skip
    http_port = _free_port()
    proc = _spawn(["-m", "app.cli", "directory", "--config", str(config), "--http-port", str(http_port)],
                  http_port, "/health")  # fmt: skip
    try:
        if not pub.poll(30_000, zmq.POLLIN):
            raise RuntimeError("the directory did not subscribe")
        pub.recv()
        pinger = start_pinger(args, None, f"http://127.0.0.1:{http_port}")
        rss_start = rss_mb(proc.pid)
        try:
            attack = _attack_directory(args, http_port, pub, inventory, events, pid=proc.pid)
        finally:
            pings = stop_pinger(pinger)
        attack |= {"rss_start_mb": rss_start, "rss_end_mb": rss_mb(proc.pid)}
        attack["served"] = _get(http_port, "/v1/instances", 30, ADMIN) == 200
    finally:
        pub.close(0)
        ctx.term()
        server.shutdown()
        server.server_close()
    return attack | pings, proc, http_port


def _router_frame(rng: random.Random) -> tuple[str, bytes]:
    body = json.dumps({"model": "base", "prompt": [1, 2, 3], "max_tokens": 1}).encode()
    kind = rng.choice(("random", "line", "headers", "connection", "json", "half", "valid", "length"))
    if kind == "random":
        return kind, _rand(rng, rng.randrange(1, 512))
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
        bad = rng.choice((b"{", b"[]", b'{"model": 1, "prompt": {}}', _rand(rng, 64)))
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
        if _over_budget(args, pid, rss_start, i):
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


def _router(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], subprocess.Popen[bytes], int]:
    engine_port, directory_port, port = _free_port(), _free_port(), _free_port()
    peers = [_spawn(["-m", "app.bench.route_peers", "engine", "--port", str(engine_port)],
                    engine_port, "/health"),
             _spawn(["-m", "app.bench.route_peers", "directory", "--port", str(directory_port)],
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
        attack["alive"] = proc.poll() is None and _get(port, "/health", 30) == 200
    finally:
        for peer in peers:  # a peer slow to stop is killed: the storm's figures are not lost
            stop_process(peer)
    return attack | pings, proc, port


def fleet_surface(args: argparse.Namespace, surface: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvdepot-fuzz-") as tmp:
        result, proc, port = (_directory if surface == "directory" else _router)(args, Path(tmp))
        try:
            alive = result.pop("alive", None)
            if alive is None:
                alive = proc.poll() is None and _get(port, "/health", 30) == 200
        finally:
            proc.terminate()
            try:
                exit_status: int | None = proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                exit_status = None
    elapsed = result.pop("elapsed_s")
    grown = result["rss_end_mb"] - result["rss_start_mb"]
    ok = alive and result["served"] and result["hangs"] == 0 and result["stalled_sockets"] == 0
    ok = ok and grown <= args.max_rss_growth_mb and not result["rss_exceeded"]
    return {"surface": surface, **result, "frames_per_s": round(result["frames_sent"] / elapsed, 1),
            "elapsed_s": round(elapsed, 2), "crashed": not alive, "exit": exit_status, "seed": args.seed,
            "ok": ok}  # fmt: skip
