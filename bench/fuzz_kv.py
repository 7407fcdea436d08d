"""`kvdepot bench fuzz` at a sidecar's other local sockets: the KV-event replay (ROUTER) and
publisher (XPUB) sockets and the lifeline (unix socket), while the pinger PINGs the data plane and
GETs `/health`.

- `kv-replay`: DEALER sockets send replay requests: well-formed ones from any sequence number
  (negative, huge, inside the buffer), 1-byte and empty frames, extra frames, frames over the
  socket's MAXMSGSIZE; replies are drained as they come.
- `kv-pub`: XSUB sockets send subscriptions and unsubscriptions: this sidecar's topics, unique
  model topics, random bytes, flag bytes other than 0/1, oversized filters.
- `lifeline`: unix connections send lifeline frames: random bodies, huge or zero lengths, valid
  Hellos with wrong tokens, heartbeats before a hello, descriptors attached (/dev/null), truncated
  frames, then close (the server closes on the first bad frame).

A socket that blocks past `--hang-s` on a send is a stalled socket. The storm ends once the
sidecar's KV-event counters stop moving (what was queued toward it was read), so the figures
(frames per second included) are the sidecar's, not the client's queueing. At the end the sidecar must be
alive, answer a PING, and give back a correct round trip (fuzz.roundtrip); its RSS at start and at
end are reported.

State (one attack): its sockets and counters. One thread.
Primitives: sidecar_surface(args, surface) -> one JSON-able result.
"""

from __future__ import annotations

import argparse
import array
import os
import random
import socket
import struct
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import zmq

from bench.fuzz_watch import rss_mb, start_pinger, stop_pinger

SOCKETS = 4
_SEQ = struct.Struct(">q")
_LEN = struct.Struct(">I")


def _rand(rng: random.Random, n: int) -> bytes:
    return rng.getrandbits(8 * n).to_bytes(n, "little") if n else b""


def _replay_frames(rng: random.Random) -> tuple[str, list[bytes]]:
    kind = rng.choice(("valid", "valid", "tiny", "empty", "extra", "seq", "oversize", "random"))
    if kind == "valid":
        return kind, [b"", _SEQ.pack(rng.choice((0, -1, 1 << 62, -(1 << 62), rng.randrange(1 << 20))))]
    if kind == "tiny":
        return kind, [b"x"]
    if kind == "empty":
        return kind, [b""]
    if kind == "extra":
        return kind, [b"", _SEQ.pack(0), b"more"]
    if kind == "seq":
        return kind, [b"", _rand(rng, rng.choice((0, 1, 7, 9, 16)))]
    if kind == "oversize":
        return kind, [b"", _rand(rng, 4096)]
    return kind, [_rand(rng, rng.randrange(1, 64)) for _ in range(rng.randrange(1, 4))]


def _sub_frame(rng: random.Random, host: str, i: int) -> tuple[str, bytes]:
    kind = rng.choice(("topic", "unique", "broad", "random", "flag", "oversize", "unsubscribe"))
    if kind == "topic":
        return kind, b"\x01" + f"kv@{host}@fuzz-check".encode()
    if kind == "unique":
        return kind, b"\x01" + f"kv@{host}@m{i}-{rng.getrandbits(32):x}".encode()
    if kind == "broad":
        return kind, b"\x01" + rng.choice((b"", b"kv", b"kv@", f"kv@{host}@".encode()))
    if kind == "flag":
        return kind, bytes([rng.randrange(2, 256)]) + _rand(rng, rng.randrange(0, 32))
    if kind == "oversize":  # past MAXMSGSIZE; rarely a subscription (XSUB keeps each in its own trie)
        return kind, (b"\x01" + _rand(rng, 5000)) if rng.random() < 1 / 64 else b"\x02" + _rand(rng, 8192)
    if kind == "unsubscribe":
        return kind, b"\x00" + f"kv@{host}@m{rng.randrange(i + 1)}".encode()
    return kind, _rand(rng, rng.randrange(0, 64))


def settle(http: str, patience_s: float = 120.0) -> None:
    """Wait until the sidecar's KV-event counters stop moving (what was queued toward it was read)."""
    names = ("bad_requests_total", "replays_total", "replays_refused_total", "subscriptions_refused_total",
             "subscribers")  # fmt: skip
    last, same, deadline = -1.0, 0, time.monotonic() + patience_s
    while same < 3 and time.monotonic() < deadline:
        with urllib.request.urlopen(http + "/metrics", timeout=30) as resp:
            lines = resp.read().decode().splitlines()
        now = sum(
            float(ln.split()[1])
            for ln in lines
            if ln.split(" ")[0].removeprefix("kvdepot_kv_events_") in names
        )
        same = same + 1 if now == last else 0
        last = now
        time.sleep(0.3)


def _attack_zmq(
    endpoint: str, kind: int, frames: int, make: Any, *, hang_s: float, http: str
) -> dict[str, Any]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks = []
    for _ in range(SOCKETS + 1):  # the last: frames over MAXMSGSIZE (the peer drops its connection)
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, int(hang_s * 1000))
        sock.connect(endpoint)
        socks.append(sock)
    kinds: Counter[str] = Counter()
    replies = stalled = 0
    start = time.monotonic()
    try:
        for i in range(frames):
            name, parts = make(i)
            sock = socks[SOCKETS if name == "oversize" else i % SOCKETS]
            kinds[name] += 1
            try:
                if name == "oversize":  # its connection is down half the time: never wait for it
                    sock.send_multipart(parts if isinstance(parts, list) else [parts], zmq.NOBLOCK)
                else:
                    sock.send_multipart(parts if isinstance(parts, list) else [parts])
            except zmq.Again:
                if name == "oversize":
                    kinds["oversize_not_sent"] += 1
                else:
                    stalled += 1
            if i % 64 == 0:
                for s in socks[:SOCKETS]:
                    while kind == zmq.DEALER and s.poll(0, zmq.POLLIN):
                        s.recv_multipart()
                        replies += 1
        settle(http)  # the frames still queued toward the sidecar are part of the storm
    finally:
        elapsed = time.monotonic() - start
        for sock in socks:
            sock.close(0)
        ctx.term()
    return {"frames_sent": frames, "kinds": dict(sorted(kinds.items())), "replies": replies,
            "stalled_sockets": stalled, "elapsed_s": elapsed}  # fmt: skip


def _lifeline_frame(rng: random.Random) -> tuple[str, bytes, bool]:
    """(kind, bytes, attach a descriptor)"""
    kind = rng.choice(("random", "huge", "zero", "hello", "heartbeat", "truncated", "fds", "garbage"))
    enc = msgspec.msgpack.encode
    if kind == "random":
        body = _rand(rng, rng.randrange(1, 256))
        return kind, _LEN.pack(len(body)) + body, False
    if kind == "huge":
        return kind, _LEN.pack(rng.choice((1 << 31, (1 << 32) - 1, 65537))) + b"x" * 16, False
    if kind == "zero":
        return kind, _LEN.pack(0), False
    if kind == "hello":
        body = enc({"op": "hello", "token": _rand(rng, rng.choice((0, 16, 32, 300)))})
        return kind, _LEN.pack(len(body)) + body, False
    if kind == "heartbeat":
        body = enc({"op": "heartbeat"})
        return kind, _LEN.pack(len(body)) + body, False
    if kind == "truncated":
        return kind, _LEN.pack(100) + b"\x81", False
    if kind == "fds":
        body = enc({"op": "share", "names": ["x"] * rng.randrange(1, 70), "sizes": [1]})
        return kind, _LEN.pack(len(body)) + body, True
    return kind, _rand(rng, rng.randrange(1, 32)), False


def _attack_lifeline(path: str, frames: int, rng: random.Random, hang_s: float) -> dict[str, Any]:
    kinds: Counter[str] = Counter()
    refused = stalled = 0
    devnull = os.open(os.devnull, os.O_RDONLY)
    start = time.monotonic()
    conn: socket.socket | None = None
    i = 0
    try:
        while i < frames:  # frames sent: a connection refused sends none (counted, retried)
            if conn is None:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.settimeout(hang_s)
                try:
                    conn.connect(path)
                except OSError:
                    refused += 1  # the listen backlog is full (or past the per-uid cap)
                    conn.close()
                    conn = None
                    time.sleep(0.0005)  # the server accepts a bounded number per wake
                    continue
            name, data, with_fd = _lifeline_frame(rng)
            i += 1
            kinds[name] += 1
            try:
                if with_fd:
                    conn.sendmsg(
                        [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [devnull] * 4))]
                    )
                else:
                    conn.sendall(data)
            except TimeoutError:
                stalled += 1
            except OSError:
                pass  # closed by the server: a fresh connection next
            if i % 4 == 3 or name != "hello":
                conn.close()
                conn = None
    finally:
        elapsed = time.monotonic() - start
        if conn is not None:
            conn.close()
        os.close(devnull)
    return {"frames_sent": frames, "kinds": dict(sorted(kinds.items())), "connections_refused": refused,
            "stalled_sockets": stalled, "elapsed_s": elapsed}  # fmt: skip


def _attack(args: argparse.Namespace, surface: str, d: Path, host: str, http: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    if surface == "kv-replay":
        return _attack_zmq(f"ipc://{d}/replay.sock", zmq.DEALER, args.frames,
                           lambda _i: _replay_frames(rng), hang_s=args.hang_s, http=http)  # fmt: skip
    if surface == "kv-pub":
        return _attack_zmq(f"ipc://{d}/events.sock", zmq.XSUB, args.frames,
                           lambda i: _sub_frame(rng, host, i), hang_s=args.hang_s, http=http)  # fmt: skip
    return _attack_lifeline(str(d / "lifeline.sock"), args.frames, rng, args.hang_s)


def sidecar_surface(args: argparse.Namespace, surface: str) -> dict[str, Any]:
    """Start a sidecar (KV events on ipc sockets in its data dir), attack `surface`, check it."""
    from bench.fuzz import answers, roundtrip
    from bench.sidecar import start_sidecar

    host = "fuzz"
    with tempfile.TemporaryDirectory(prefix="kvdepot-fuzz-") as tmp:
        d = Path(tmp)
        env = {
            "KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_L2__ADAPTERS": "[]",
            "KVDEPOT_KV_EVENTS__ENDPOINT": f"ipc://{d}/events.sock",
            "KVDEPOT_KV_EVENTS__REPLAY_ENDPOINT": f"ipc://{d}/replay.sock", "KVDEPOT_KV_EVENTS__HOST": host,
            "KVDEPOT_KV_EVENTS__BUFFER": "1000",
        }  # fmt: skip
        sidecar = start_sidecar(d, env=env, l1_size_gb=0.0625)
        try:
            pid = sidecar.proc.pid
            pinger = start_pinger(args, sidecar.url, sidecar.http)
            rss_start = rss_mb(pid)
            try:
                attack = _attack(args, surface, d, host, sidecar.http)
            finally:
                pings = stop_pinger(pinger)
            rss_end = rss_mb(pid)
            crashed = sidecar.proc.poll() is not None or not answers(sidecar.url)
            rt = False if crashed else roundtrip(sidecar.url, 16, args.seed, patience_s=60)
        finally:
            status = sidecar.stop()
    elapsed = attack.pop("elapsed_s")
    ok = not crashed and rt and pings["hangs"] == 0 and attack["stalled_sockets"] == 0
    ok = ok and rss_end - rss_start <= args.max_rss_growth_mb
    result = {"surface": surface, **attack, "frames_per_s": round(attack["frames_sent"] / elapsed, 1),
              "elapsed_s": round(elapsed, 2), **pings, "rss_start_mb": rss_start, "rss_end_mb": rss_end,
              "crashed": crashed, "roundtrip_ok": rt, "sidecar_exit": status, "seed": args.seed,
              "ok": ok}  # fmt: skip
    if crashed:
        result["sidecar_log_tail"] = sidecar.lines[-20:]
    return result
