"""RouterTransport: the data plane's ZMQ ROUTER socket on the sidecar's event loop: binding it,
reading frames from it in a reader callback, and sending replies, now or later.

State: the ZMQ context and socket, a closing flag, the future `serve` waits on, and the tasks that
send deferred replies (kept in a set, discarded when done). Touched only from the event loop.

Frames are read in a reader callback on the socket's file descriptor and answered inline, with no
task switch per message: each two-frame message (routing id, request) goes to `handle`, which
returns the reply bytes or an awaitable of them; anything else that arrives gets `malformed()`.
The descriptor is edge-triggered, so the reader drains the socket until it says nothing is left,
up to `READ_BUDGET` messages or `READ_SLICE_S` seconds per call before giving the loop a turn.
A deferred reply is sent from a task; sending touches the socket, which can consume the edge of
its descriptor, so a drain is scheduled right after. Drains are coalesced: at most one is queued
on the loop at a time, so a burst of deferred replies costs one slice a turn, not one each (a
hundred LOOKUPs answered at once would otherwise hold the loop for a hundred slices). A reply the
client's queue has no room for is dropped and logged. A socket that fails, or is closed under the reader, ends
`serve` with an error, so the supervisor marks the data plane dead.

Primitives in call order: `bind()` (errors are ConfigError), `serve()` (supervised task),
`stop()` (serve returns), `close()` (socket, context and ipc path go).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog
import zmq

from app.errors import ConfigError
from app.tasks import TaskSet

log = structlog.get_logger("kvdepot.dataplane")

#: messages handled per reader callback before other work on the loop gets a turn ...
READ_BUDGET = 64
#: ... or seconds spent on them (a flood of costly frames must not hold the loop: /health, the
#: lifelines and the L2 tasks each get a turn between slices)
READ_SLICE_S = 0.004
#: how often the serve task checks that its socket is still open
WATCHDOG_S = 0.5


class RouterTransport:
    def __init__(
        self,
        *,
        url: str,
        max_frame_bytes: int,
        handle: Callable[[bytes, bytes], bytes | Awaitable[bytes]],
        malformed: Callable[[], bytes],
    ) -> None:
        self.url = url
        self.max_frame_bytes = max_frame_bytes
        self._handle = handle
        self._malformed = malformed
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._closing = False
        self._done: asyncio.Future[None] | None = None
        self._deferred = TaskSet("dataplane-deferred-replies")
        self._drain_queued = False
        self.running = False

    @property
    def sock(self) -> zmq.Socket[bytes] | None:
        """The bound socket (None before `bind` and after `close`)."""
        return self._sock

    def bind(self) -> None:
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        if self.url.startswith("ipc://"):
            path = Path(self.url[len("ipc://") :])
            if len(str(path)) > 100:
                sock.close()
                raise ConfigError(f"data_plane.url: ipc path too long ({len(str(path))} > 100 characters)")
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # left by a dead predecessor; a live one is refused by the arena check
        try:
            sock.bind(self.url)
        except zmq.ZMQError as exc:
            sock.close()
            raise ConfigError(f"data_plane.url: cannot bind {self.url}: {exc}") from None
        if self.url.startswith("ipc://"):
            os.chmod(self.url[len("ipc://") :], 0o660)
        self._sock = sock
        log.info("dataplane_bound", url=self.url)

    async def serve(self) -> None:
        """Serve until `stop()`. Messages are read in a reader callback on the socket's file
        descriptor and answered inline (no task switch per message); a socket that fails under
        it ends this task with the error, so the supervisor marks the data plane dead."""
        sock = self._sock
        if sock is None:
            raise RuntimeError("bind() first")
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        fd = int(sock.getsockopt(zmq.FD))
        loop.add_reader(fd, self._on_fd)
        self.running = True
        self._queue_drain()  # messages that arrived before the reader was added
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(self._done), WATCHDOG_S)
                    return
                except TimeoutError:
                    # A socket closed under the reader gives no callback at all: look, now and then.
                    if self._sock is None or self._sock.closed:
                        raise RuntimeError("the data-plane socket was closed") from None
        finally:
            self.running = False
            with contextlib.suppress(Exception):
                loop.remove_reader(fd)

    def _queue_drain(self) -> None:
        """A drain on the loop's next turn, unless one is queued already."""
        if not self._drain_queued:
            self._drain_queued = True
            asyncio.get_running_loop().call_soon(self._queued_drain)

    def _on_fd(self) -> None:
        if not self._drain_queued:  # else the queued drain reads what made the descriptor ready
            self._on_readable()

    def _queued_drain(self) -> None:
        self._drain_queued = False
        self._on_readable()

    def _on_readable(self) -> None:
        """Drain the socket (its FD is edge-triggered: read until it says nothing is left), up to a
        budget per call so other work on the loop is not starved; then come back."""
        sock = self._sock
        if sock is None or self._done is None or self._done.done():
            return
        until = time.perf_counter() + READ_SLICE_S
        try:
            for _ in range(READ_BUDGET):
                if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return
                if time.perf_counter() > until:
                    break
                frames = sock.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 2:
                    if frames:
                        self._send(sock, [frames[0], self._malformed()])
                    continue
                reply = self._handle(frames[1], frames[0])
                if isinstance(reply, bytes):
                    self._send(sock, [frames[0], reply])
                else:  # answered later (a LOOKUP waiting for L2): the loop goes on meanwhile
                    self._spawn_reply(frames[0], reply)
            self._queue_drain()
        except zmq.ZMQError as exc:
            if not self._closing:
                self._done.set_exception(RuntimeError(f"the data-plane socket failed: {exc}"))

    @staticmethod
    def _send(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("dataplane_reply_dropped", reason="the client's queue is full")

    def _spawn_reply(self, ident: bytes, reply: Awaitable[bytes]) -> None:
        async def send_later() -> None:
            frames = [ident, await reply]
            if self._sock is not None:
                self._send(self._sock, frames)
                # Sending may have consumed the edge of the socket's descriptor: messages that
                # arrived meanwhile would wait for the next one. Drain on the next turn.
                self._queue_drain()

        self._deferred.spawn(send_later(), name="dataplane-deferred-reply")

    def stop(self) -> None:
        """Stop accepting: `serve` returns."""
        self._closing = True
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.url.startswith("ipc://"):
            with contextlib.suppress(FileNotFoundError):
                Path(self.url[len("ipc://") :]).unlink()
