"""A registrant of the directory that is no sidecar: an HTTP server answering `GET /inventory` with
whatever the test says (chunks, a line without end), recording every Authorization header it is
sent, and a KV-event PUB socket the test publishes hand-made batches (or oversized frames) on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import zmq

from tests.ports import free_port


def listing(hashes: list[int], incarnation: str = "hostile") -> Iterator[bytes]:
    """An inventory listing: the header, one chunk line per hash, the end."""
    yield msgspec.json.encode({"kind": "header", "incarnation": incarnation, "seq": -1}) + b"\n"
    for h in hashes:
        yield msgspec.json.encode({"kind": "chunk", "block_hashes": [h]}) + b"\n"
    yield msgspec.json.encode({"kind": "end", "chunks": len(hashes)}) + b"\n"


def endless_line(total: int, piece: int = 1 << 16) -> Iterator[bytes]:
    """`total` bytes of one listing line that never ends (no newline)."""
    yield b'{"kind": "header", "incarnation": "'
    for _ in range(total // piece):
        yield b"x" * piece


class HostileRegistrant:
    def __init__(self, name: str, hashes: list[int] | None = None, sndhwm: int = 10) -> None:
        self.name = name
        self.body: Callable[[], Iterator[bytes]] = lambda: listing(hashes or [])
        self.authorizations: list[str | None] = []
        self.inventory_sent = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.authorizations.append(self.headers.get("Authorization"))
                if self.path != "/inventory":
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-ndjson")
                self.end_headers()
                try:
                    for piece in owner.body():
                        self.wfile.write(piece)
                except OSError:
                    return  # the directory hung up
                owner.inventory_sent += 1

            def log_message(self, *_args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self._ctx = zmq.Context()
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, sndhwm)  # before the bind: 0 keeps every frame published
        port = free_port()
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.events_endpoint = f"tcp://127.0.0.1:{port}"

    def spec(self, instance_id: str | None = None, url: str | None = None) -> dict[str, Any]:
        return {
            "id": instance_id or self.name, "url": url or self.url, "events_endpoint": self.events_endpoint,
        }  # fmt: skip

    def publish(self, seq: int, hashes: list[int], incarnation: str = "hostile") -> None:
        events = [{"type": "BlockStored", "block_hashes": [h], "block_size": 0} for h in hashes]
        payload = msgspec.msgpack.encode([time.time(), events, None, incarnation])
        self.pub.send_multipart([b"", seq.to_bytes(8, "big", signed=True), payload])

    def publish_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames, copy=False)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.pub.close(0)
        self._ctx.term()


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")
