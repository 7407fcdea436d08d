"""`kvdepot bench fuzz`: hostile frames at a live service while another client pings it; one JSON
object per surface.

`--surface` chooses (comma-separated, or `all`, one at a time, each against a fresh process):
`dataplane` (this module), `kv-replay`, `kv-pub`, `lifeline` (a sidecar's other local sockets:
fuzz_kv.py), `directory`, `router` (the fleet's processes: fuzz_fleet.py runs fuzz_directory.py and
fuzz_route.py). Each reports frames per second, the pinger's p50/p99/max and hangs, and the
target's RSS at start and end (`--max-rss-growth-mb` bounds its growth).

The data plane: a sidecar is started (or `--url` used) and `--frames` frames go to it over several DEALER
sockets, pipelined (a bounded window of frames in flight per socket, replies drained as they come):
structure-aware ones from `fuzz_frames.FrameMaker` (every request type, hostile fields) and random
bytes. Frames over the sidecar's `max_frame_bytes` (the transport drops the connection that sent
one) go through a socket of their own that expects no reply. Meanwhile a pinger (fuzz_watch.py), in
its own process so that the fuzzer's work does not delay it, PINGs every `--ping-interval-ms`
through the client library and GETs `/health`, and times each answer; one not answered within
`--hang-s` is a hang.

At the end: the sidecar is alive, a store / lookup / retrieve round trip through the client library
gives back the same bytes, and `/status` says the allocator is consistent. `ok` (exit status 0)
needs all of that, no hang and no socket left without its replies; timing is reported, not judged.

State (`Fuzzer`): the sockets, frames in flight per socket, counts. One thread.
Primitives in call order: `run(args)` -> `Fuzzer.hello()` -> `Fuzzer.run(frames)` -> checks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import zmq

from bench.fuzz_frames import FrameMaker, Region
from bench.fuzz_watch import pinger, rss_mb, start_pinger, stop_pinger
from kvdepot_connector import protocol as p
from kvdepot_connector.lifeline import LifelineClient

#: a socket whose replies stop for this many pings' hang time is a stalled socket
STALL_FACTOR = 5
REGION_BYTES = 1 << 16
#: what `--surface` chooses from (bench/fuzz_kv.py, fuzz_fleet.py for all but the data plane)
SURFACES = ("dataplane", "kv-replay", "kv-pub", "lifeline", "directory", "router")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", help="use a running sidecar at this data-plane URL instead of starting one")
    ap.add_argument("--http", help="control-plane URL of the running sidecar (for the allocator check)")
    ap.add_argument("--frames", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sockets", type=int, default=4, help="DEALER sockets the frames are spread over")
    ap.add_argument("--window", type=int, default=64, help="frames in flight per socket")
    ap.add_argument("--rate", type=float, default=0.0, help="frames per second at most (0: no limit)")
    ap.add_argument("--ping-interval-ms", type=float, default=10.0)
    ap.add_argument("--hang-s", type=float, default=2.0, help="a ping unanswered this long is a hang")
    ap.add_argument(
        "--surface",
        default="dataplane",
        help=f"comma-separated surfaces to attack, one JSON line each: {', '.join(SURFACES)} or all",
    )
    ap.add_argument(
        "--max-rss-growth-mb",
        type=float,
        default=256.0,
        help="a target whose RSS grew more than this during its storm fails",
    )
    ap.add_argument("--pinger", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--health", help=argparse.SUPPRESS)


def client_for(url: str, chunk_size: int, timeout_s: float, model: str, *, map_arena: bool = True) -> Any:
    from kvdepot_connector.client import KVDepotClient

    layout = p.Layout(
        dtype="float16", num_layers=2, num_kv_heads=1, head_dim=16, block_size=chunk_size,
        kind="fuzz-check", chunk_size=chunk_size,
    )  # fmt: skip
    return KVDepotClient(url, model=model, layout=layout, timeout_s=timeout_s, map_arena=map_arena)


def answers(url: str) -> bool:
    """The sidecar answers a PING (through the client library)."""
    from kvdepot_connector.errors import KVDepotClientError

    client = client_for(url, 16, 5.0, "fuzz-pinger", map_arena=False)
    try:
        client.ping()
        return True
    except KVDepotClientError:
        return False
    finally:
        client.close()


# --- the fuzzer ---------------------------------------------------------------------------------


def _hello_frame() -> bytes:
    """A correct HELLO built from the protocol's own fields (optional ones left out)."""
    info = mi.type_info(p.Hello)
    assert isinstance(info, mi.StructType)
    msg: dict[str, Any] = {"op": p.Hello.__struct_config__.tag, "id": 1, "version": p.PROTOCOL_VERSION}
    for f in info.fields:
        if f.required and f.encode_name not in msg:
            msg[f.encode_name] = os.urandom(16) if isinstance(f.type, mi.BytesType) else os.urandom(8).hex()
    return msgspec.msgpack.encode(msg)


class Fuzzer:
    def __init__(self, url: str, *, sockets: int, window: int, stall_s: float) -> None:
        self.url = url
        self.window = window
        self.stall_s = stall_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socks = [self._dealer() for _ in range(sockets)]
        self._oversize = self._dealer()
        self._inflight = [0] * sockets
        self._last_reply = [time.monotonic()] * sockets
        self._poller = zmq.Poller()
        for sock in self._socks:
            self._poller.register(sock, zmq.POLLIN)
        self.replies: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.sent = 0
        self.oversize = 0
        self.lost = 0
        self.stalled_sockets = 0
        #: the lifeline of the first socket's session: held, its frames reach every handler
        self._lifeline: LifelineClient | None = None

    def _dealer(self) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.url)
        return sock

    def hello(self, timeout_s: float) -> p.HelloReply:
        sock = self._socks[0]
        sock.send(_hello_frame())
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise RuntimeError(f"no HELLO reply from {self.url}")
        reply = p.reply_decoder.decode(sock.recv())
        if not isinstance(reply, p.HelloReply):
            raise RuntimeError(f"HELLO answered with {reply}")
        if reply.lifeline_path:  # as a real client does: a session not held may not register or store
            self._lifeline = LifelineClient(reply.lifeline_path, reply.lifeline_token, timeout=timeout_s)
        return reply

    def run(self, maker: FrameMaker, frames: int, rate: float) -> float:
        """Send `frames` frames and drain every reply; the elapsed seconds."""
        start = time.monotonic()
        turn = 0
        while self.sent < frames or any(self._inflight):
            can_send = self.sent < frames and (rate <= 0 or self.sent < (time.monotonic() - start) * rate)
            if can_send:
                i = turn % len(self._socks)
                turn += 1
                if self._inflight[i] < self.window:
                    self._send(i, maker)
            self._drain(maker, 0 if can_send else 10)
            self._check_stalls()
        return time.monotonic() - start

    def _send(self, i: int, maker: FrameMaker) -> None:
        if self.sent % 20_000 == 10_000:
            kind, frames = "oversize", maker.oversize()
        elif self.sent % 500 == 0:
            kind, frames = "register", [maker.sane_register()]
        else:
            kind, frames = maker.frames()
        self.kinds[kind] += 1
        self.sent += 1
        if sum(map(len, frames)) > maker.max_frame_bytes:
            self.oversize += 1  # the transport drops this connection: no reply, and none expected
            self._oversize.send_multipart(frames, copy=False)
            return
        self._socks[i].send_multipart(frames, copy=False)
        if self._inflight[i] == 0:
            self._last_reply[i] = time.monotonic()
        self._inflight[i] += 1

    def _drain(self, maker: FrameMaker, timeout_ms: int) -> None:
        for sock, _ in self._poller.poll(timeout_ms):
            i = self._socks.index(sock)
            while self._inflight[i] and sock.poll(0, zmq.POLLIN):
                self._count(maker, sock.recv())
                self._inflight[i] -= 1
                self._last_reply[i] = time.monotonic()

    def _count(self, maker: FrameMaker, frame: bytes) -> None:
        try:
            reply = p.reply_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.replies["undecodable"] += 1
            return
        if isinstance(reply, p.ErrorReply):
            self.replies["error:" + reply.code] += 1
        else:
            self.replies[str(type(reply).__struct_config__.tag)] += 1
            maker.learn(reply)

    def _check_stalls(self) -> None:
        now = time.monotonic()
        for i, sock in enumerate(self._socks):
            if self._inflight[i] and now - self._last_reply[i] > self.stall_s:
                self.stalled_sockets += 1
                self.lost += self._inflight[i]
                self._inflight[i] = 0
                self._poller.unregister(sock)
                sock.close(linger=0)
                self._socks[i] = self._dealer()
                self._poller.register(self._socks[i], zmq.POLLIN)

    def close(self) -> None:
        if self._lifeline is not None:
            self._lifeline.close()
        for sock in [*self._socks, self._oversize]:
            sock.close(linger=0)
        self._ctx.term()


# --- checks after the storm ---------------------------------------------------------------------


def roundtrip(url: str, chunk_size: int, seed: int, patience_s: float) -> bool:
    """Store 4 chunks through the client library, look them up, retrieve them: the same bytes?
    Space the fuzz frames still hold (reservations, read locks) comes back when their leases end:
    a store refused for space is tried again until `patience_s` has passed."""
    import torch

    rng = random.Random(seed)
    tokens = [rng.randrange(1 << 31) for _ in range(4 * chunk_size)]
    with client_for(url, chunk_size, 10.0, "fuzz-check") as client:
        elems = client.chunk_bytes // 2
        chunks = [
            torch.randn(elems, generator=torch.Generator().manual_seed(seed + i)).half() for i in range(4)
        ]
        salt = f"fuzz-check-{rng.getrandbits(64):x}"
        deadline = time.monotonic() + patience_s
        while True:
            outcome = client.store(tokens, chunks, request_id="check-w", cache_salt=salt)
            if outcome.complete or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        hit = client.lookup(tokens, request_id="check-r", cache_salt=salt)
        outs = [torch.empty_like(c) for c in chunks]
        if hit.hit_chunks != 4 or not client.retrieve("check-r", outs):
            return False
        return all(torch.equal(a, b) for a, b in zip(chunks, outs, strict=True))


def _allocator_ok(http: str | None) -> bool | None:
    if http is None:
        return None
    import urllib.request

    with urllib.request.urlopen(http + "/status", timeout=30) as resp:
        return bool(json.loads(resp.read())["l1"]["allocator_ok"])


def _make_region() -> Region:
    name = f"kvdepot-fuzz-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(Path("/dev/shm") / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, REGION_BYTES)
    finally:
        os.close(fd)
    return Region(name, REGION_BYTES)


def _fuzz(
    args: argparse.Namespace, url: str, http: str | None, alive: Any, pid: int | None = None
) -> dict[str, Any]:
    fuzzer = Fuzzer(url, sockets=args.sockets, window=args.window, stall_s=STALL_FACTOR * args.hang_s)
    region = _make_region()
    try:
        hello = fuzzer.hello(30)
        maker = FrameMaker(random.Random(args.seed), region, hello.chunk_size, hello.max_frame_bytes)
        pinger_proc = start_pinger(args, url, http)
        rss_start = rss_mb(pid) if pid else 0.0
        try:
            elapsed = fuzzer.run(maker, args.frames, args.rate)
        finally:
            pings = stop_pinger(pinger_proc)
        rss_end = rss_mb(pid) if pid else 0.0
    finally:
        fuzzer.close()
        os.unlink(Path("/dev/shm") / region.name)
    crashed = not alive() or not answers(url)
    rt = False if crashed else roundtrip(url, hello.chunk_size, args.seed, patience_s=60)
    allocator = None if crashed else _allocator_ok(http)
    ok = not crashed and rt and allocator is not False and pings["hangs"] == 0 and fuzzer.stalled_sockets == 0
    ok = ok and rss_end - rss_start <= args.max_rss_growth_mb
    return {
        "surface": "dataplane",
        "frames_sent": fuzzer.sent,
        "frames_oversize": fuzzer.oversize,
        "replies": dict(sorted(fuzzer.replies.items())),
        "replies_lost": fuzzer.lost,
        "stalled_sockets": fuzzer.stalled_sockets,
        "frames_per_s": round(fuzzer.sent / elapsed, 1),
        "elapsed_s": round(elapsed, 2),
        "kinds": dict(sorted(fuzzer.kinds.items())),
        **pings,
        "rss_start_mb": rss_start,
        "rss_end_mb": rss_end,
        "crashed": crashed,
        "roundtrip_ok": rt,
        "allocator_ok": allocator,
        "seed": args.seed,
        "ok": ok,
    }


def _dataplane(args: argparse.Namespace) -> dict[str, Any]:
    from bench.sidecar import start_sidecar

    env = {
        "KVDEPOT_L1__CHUNK_SIZE": "16", "KVDEPOT_L2__ADAPTERS": "[]",
        # leftovers of the storm (reservations, read locks) come back soon after it
        "KVDEPOT_L1__WRITE_LEASE_S": "2", "KVDEPOT_L1__READ_LEASE_S": "2",
        "KVDEPOT_L1__REAP_INTERVAL_S": "0.2",
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvdepot-fuzz-") as tmp:
        sidecar = start_sidecar(Path(tmp), env=env, l1_size_gb=0.0625)
        try:
            result = _fuzz(args, sidecar.url, sidecar.http, alive=lambda: sidecar.proc.poll() is None,
                           pid=sidecar.proc.pid)  # fmt: skip
        finally:
            status = sidecar.stop()
        result["sidecar_exit"] = status
        if result["crashed"]:
            result["sidecar_log_tail"] = sidecar.lines[-20:]
    result["url"] = "started"
    return result


def run(args: argparse.Namespace) -> int:
    if args.pinger:
        print(json.dumps(pinger(args)))
        return 0
    if args.url is not None:
        result = _fuzz(args, args.url, args.http, alive=lambda: True)  # the PING after says
        result["url"] = args.url
        print(json.dumps(result))
        return 0 if result["ok"] else 1
    surfaces = list(SURFACES) if args.surface == "all" else args.surface.split(",")
    unknown = [s for s in surfaces if s not in SURFACES]
    if unknown:
        raise SystemExit(
            f"--surface: unknown {', '.join(unknown)} (choose from {', '.join(SURFACES)} or all)"
        )
    ok = True
    for surface in surfaces:  # one at a time, each against a fresh target
        if surface == "dataplane":
            result = _dataplane(args)
        elif surface in ("directory", "router"):
            from bench.fuzz_fleet import fleet_surface

            result = fleet_surface(args, surface)
        else:
            from bench.fuzz_kv import sidecar_surface

            result = sidecar_surface(args, surface)
        print(json.dumps(result), flush=True)
        ok = ok and bool(result["ok"])
    return 0 if ok else 1
