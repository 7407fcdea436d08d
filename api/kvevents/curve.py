"""ZapHandler: the ZMQ authentication (ZAP) handler that admits only listed CURVE client keys.

Sockets with `curve_server` set ask the handler of their context (a REP socket at
`inproc://zeromq.zap.01`) about every connecting client; it answers 200 for a CURVE client whose
public key is listed and 400 otherwise. Served from a reader on the event loop (requests are tiny).

State (event loop only): the REP socket and the allowed keys (32-byte binary).
Primitives in call order: ZapHandler(ctx, keys_z85) (before the sockets it guards bind) ->
start(loop) -> close(loop).
"""

from __future__ import annotations

import asyncio
import contextlib

import zmq
from zmq.utils import z85

ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class ZapHandler:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], allowed_z85: list[bytes]) -> None:
        self.allowed = frozenset(z85.decode(k) for k in allowed_z85)
        self.refused = 0
        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(socket_fd(self._sock), self._drain)
        self._drain()

    def _drain(self) -> None:
        sock = self._sock
        while not sock.closed and int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            version, request_id = [*frames, b"", b""][:2]
            ok = len(frames) >= 7 and frames[5] == b"CURVE" and frames[6] in self.allowed
            if not ok:
                self.refused += 1
            code, text = (b"200", b"OK") if ok else (b"400", b"client key not allowed")
            sock.send_multipart([version, request_id, code, text, b"", b""])

    def close(self, loop: asyncio.AbstractEventLoop | None) -> None:
        if self._sock.closed:
            return
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                loop.remove_reader(socket_fd(self._sock))
        self._sock.close(linger=0)


def socket_fd(sock: zmq.Socket[bytes]) -> int:
    """The socket's (edge-triggered) descriptor, for a reader on the loop."""
    return int(sock.getsockopt(zmq.FD))
