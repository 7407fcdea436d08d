"""`kvdepot bench fuzz --surface directory` (bench/fuzz_fleet.py runs it): a real `kvdepot
directory`, attacked on its two inputs at once while the pinger GETs its `/health`.

The fuzzer plays a static instance: it serves that instance's `/inventory` (an empty listing) and
binds the KV-event PUB socket the directory subscribes to. Two senders share the frame count, side
by side: event frames on that socket (well-formed batches with hostile events, sequence jumps, new
incarnations, random payloads, wrong frame counts, frames up to 1 MiB) as fast as PUB takes them,
and, in a thread of their own, registrations (`POST /v1/instances`) with a hostile body (random
JSON, wrong types, bad ids, huge lists) and no token, a wrong one or the admin token, each sent
when the one before was answered. So the directory ingests while it registers, and the mix
(`kinds`) is whatever it keeps up with. At the end the directory must list its instances to the
admin token (`served`).

State (one attack): its sockets, the inventory server's thread, the registrations' thread, counters.
Primitives: directory_target(args, tmp) -> (figures, the directory's process, its port).
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import random
import struct
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import zmq

from bench.fuzz_watch import get_status, over_budget, rss_mb, start_pinger, stop_pinger
from bench.route import _free_port, _spawn

ADMIN = "fuzz-admin-token"
_SEQ = struct.Struct(">q")


class _Noise:
    """Random payloads up to 1 MiB, cut at random offsets from one seeded 2 MiB pool (drawing each
    afresh cost the fuzzer more than the frames cost the target)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.pool = rng.randbytes(2 << 20)

    def __call__(self, n: int) -> bytes:
        at = self.rng.randrange(0, len(self.pool) - n + 1)
        return self.pool[at : at + n]


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


def _event_frames(rng: random.Random, noise: _Noise, i: int) -> tuple[str, list[bytes]]:
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
        return kind, [topic, _SEQ.pack(i), noise(rng.choice((1 << 16, 1 << 20)))]
    if kind == "badseq":
        return kind, [topic, noise(rng.choice((0, 3, 9))), batch]
    return kind, [topic, _SEQ.pack(i), noise(rng.randrange(1, 512))]


def _registration(rng: random.Random, inventory: str, events: str) -> tuple[str, bytes, str | None]:
    kind = rng.choice(("spec", "random", "types", "ids", "huge", "json"))
    spec: Any = {"id": f"fuzz-{rng.randrange(8)}", "url": inventory, "events_endpoint": events}
    if kind == "types":
        spec = {**spec, "tiers": "x", "l1_usage": rng.choice((-1, 2, "x", 1e308)), "queue_depth": -1}
    elif kind == "ids":
        spec = {**spec, "id": rng.choice(("", "../x", "a" * 300, "\0", "id with spaces"))}
    elif kind == "huge":
        spec = {**spec, "namespaces": _HUGE}
    elif kind == "json":
        spec = rng.choice(([], 1, None, "x", {"id": {"nested": [1] * 100}}))
    body = rng.randbytes(rng.randrange(1, 200)) if kind == "random" else json.dumps(spec).encode()
    return kind, body, rng.choice((None, "wrong-token", ADMIN))


_HUGE = [{"model": "m" * 64, "layout_fp": "00" * 16}] * 10_000


class _Registrar(threading.Thread):
    """Posts hostile registrations one after another until `budget` says the frames are spent."""

    def __init__(self, args: argparse.Namespace, http_port: int, inventory: str, events: str,
                 budget: _Budget) -> None:  # fmt: skip
        super().__init__(name="fuzz-registrar", daemon=True)
        self.args, self.port, self.budget = args, http_port, budget
        self.inventory, self.events = inventory, events
        self.kinds: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.stalled = 0

    def run(self) -> None:
        rng = random.Random(self.args.seed + 1)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.args.hang_s)
        try:
            while self.budget.take():
                name, body, token = _registration(rng, self.inventory, self.events)
                self.kinds["register:" + name] += 1
                headers = {"Content-Type": "application/json"} | (
                    {"Authorization": f"Bearer {token}"} if token else {}
                )
                try:
                    conn.request("POST", "/v1/instances", body, headers)
                    resp = conn.getresponse()
                    resp.read()
                    self.statuses[str(resp.status)] += 1
                except TimeoutError:
                    self.stalled += 1
                    conn.close()
                except (OSError, http.client.HTTPException):
                    self.statuses["closed"] += 1
                    conn.close()
                self.budget.answered()
        finally:
            conn.close()
            self.budget.stop()  # the event sender waits on no registration after the last


class _Budget:
    """The frames left, shared by the two senders (`take` answers whether one more may go), and
    the pace: the event sender goes at most EVENTS_PER_REGISTRATION frames ahead of the
    registrations answered (`pace`), so the mix stays nine event frames to one registration
    while both run at once."""

    EVENTS_PER_REGISTRATION = 9

    def __init__(self, frames: int) -> None:
        self.left = frames
        self.stopped = False
        self.registered = 0
        self._cond = threading.Condition()

    def take(self) -> bool:
        with self._cond:
            if self.stopped or self.left <= 0:
                return False
            self.left -= 1
            return True

    def answered(self) -> None:
        with self._cond:
            self.registered += 1
            self._cond.notify_all()

    def pace(self, events: int, timeout_s: float) -> None:
        """Wait until the registrations answered allow event frame number `events` (or timeout_s)."""
        with self._cond:
            self._cond.wait_for(
                lambda: self.stopped or events < self.EVENTS_PER_REGISTRATION * (self.registered + 1),
                timeout_s,
            )

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()


def _attack_directory(args: argparse.Namespace, http_port: int, pub: zmq.Socket[bytes],
                      inventory: str, events: str, *, pid: int) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(args.seed)
    noise = _Noise(rng)
    rss_start = rss_mb(pid)
    kinds: Counter[str] = Counter()
    budget = _Budget(args.frames)
    registrar = _Registrar(args, http_port, inventory, events, budget)
    start = time.monotonic()
    registrar.start()
    exceeded = False
    i = 0
    try:
        while True:
            budget.pace(i, args.hang_s)
            if not budget.take():
                break
            if over_budget(args, pid, rss_start, i):
                exceeded = True
                break
            name, frames = _event_frames(rng, noise, i)
            kinds["event:" + name] += 1
            pub.send_multipart(frames)  # PUB never blocks: a slow directory loses frames (a gap)
            i += 1
    finally:
        budget.stop()
        registrar.join(args.hang_s * 4)
    kinds.update(registrar.kinds)
    sent = sum(kinds.values())
    return {"frames_sent": sent, "event_frames": i, "registrations": sent - i,
            "kinds": dict(sorted(kinds.items())), "statuses": dict(registrar.statuses),
            "stalled_sockets": registrar.stalled + int(registrar.is_alive()),
            "rss_exceeded": exceeded, "elapsed_s": time.monotonic() - start}  # fmt: skip


def directory_target(
    args: argparse.Namespace, tmp: Path
) -> tuple[dict[str, Any], subprocess.Popen[bytes], int]:
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
        attack["served"] = get_status(http_port, "/v1/instances", 30, ADMIN) == 200
    finally:
        pub.close(0)
        ctx.term()
        server.shutdown()
        server.server_close()
    return attack | pings, proc, http_port
