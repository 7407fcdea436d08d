"""LifelineServer: the sidecar's end of the per-process lifelines (kvdepot_connector.lifeline).

Each client process connects a plain unix stream socket to `<data_dir>/lifeline.sock` (mode
0660, like the data-plane socket). The server reads the peer's credentials (SO_PEERCRED) and
refuses any uid but its own (or root), and any connection past `max_connections_per_uid` of its
uid (a lifeline holds a data-plane session: this caps the sessions of one uid, the only peer
identity the sidecar learns: ZMQ ipc peers have none); the first frame must be a Hello whose token
`authenticate(token)` knows (it returns the holder the token stands for, or None), else the
connection is closed. Then the server sends the descriptors `offer(holder)` names (the arena's
memfd), accepts the sealed regions a client shares (`on_fds`, which owns the descriptors from
then on, and may raise LifelineRefused), and calls `on_closed(line)` as soon as the peer is gone
(EOF, ECONNRESET, or a protocol error). `on_hello(line)` runs once a lifeline is authenticated,
`on_heartbeat(line)` for each heartbeat frame after it (no answer is sent).

State: the listening socket and one `Lifeline` per connection (buffers, received descriptors not
yet claimed by a frame, the handshake timer). Owned by the event loop: sockets are non-blocking
and served with `loop.add_reader` / `add_writer` (no threads). Every connection is bounded:
connections, accepts per wake, frame size, descriptors per frame and per connection, output
buffer, a handshake timeout (a silent peer is closed); refusals counted, logged rate-bounded.

Primitives in call order: `start()`, `Lifeline.send(names, fds)`, `Lifeline.grant(items)` (Grant
frames: arena segments the peer may now write), `close()`.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog

from app.complaints import Complaints
from kvdepot_connector.lifeline import (
    HEADER,
    MAX_FDS_PER_MESSAGE,
    Grant,
    Heartbeat,
    Hello,
    Message,
    Refused,
    Share,
    Shared,
    Welcome,
    decode_body,
    encode_frame,
    fd_count,
)

log = structlog.get_logger("kvdepot.lifeline")

#: a connection that has not said a good hello this long after it connected is closed
HANDSHAKE_TIMEOUT_S = 5.0
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_INT = array.array("i").itemsize


@dataclass(frozen=True, slots=True)
class LifelineLimits:
    max_connections: int = 1024
    #: lifelines (so held data-plane sessions) of one peer uid at once
    max_connections_per_uid: int = 512
    max_message_bytes: int = 64 * 1024
    max_fds_per_message: int = MAX_FDS_PER_MESSAGE
    max_fds_per_connection: int = 4096
    max_output_bytes: int = 1 << 20
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    #: bytes read from one lifeline per wake of the loop: a peer flooding frames (heartbeats)
    #: gets its turn like every other socket and cannot starve the loop
    max_read_per_wake: int = 16 * 1024
    max_accepts_per_wake: int = 64  # a connection flood waits in the listen backlog, not the loop


class LifelineRefused(Exception):
    """Raised by `on_fds` to refuse a share; the client is told `reason`. `on_fds` owns (closes)
    the descriptors it was given whether it returns or raises."""


@dataclass(frozen=True, slots=True)
class SharedRegion:
    name: str
    fd: int
    size: int  # bytes the client declares


class Lifeline:
    """One client process's connection: its credentials and, once authenticated, its holder."""

    def __init__(self, server: LifelineServer, sock: socket.socket, pid: int, uid: int, gid: int) -> None:
        self.pid, self.uid, self.gid = pid, uid, gid
        self.holder: object | None = None
        self.closed = False
        self.fds_received = 0
        self._server = server
        self._sock = sock
        self._inbuf = bytearray()
        self._fds: list[int] = []
        self._out: list[tuple[bytes, list[int]]] = []
        self._out_bytes = 0
        self._writing = False
        self._timer: asyncio.TimerHandle | None = None

    def send(self, message: Message, fds: Sequence[int] = ()) -> None:
        """Queue a frame; `fds` are duplicated now, so the caller keeps its own."""
        if self.closed:
            return
        data = encode_frame(message)
        if self._out_bytes + len(data) > self._server.limits.max_output_bytes:
            self._close("output buffer full")
            return
        self._out.append((data, [os.dup(fd) for fd in fds]))
        self._out_bytes += len(data)
        self._flush()

    def grant(self, items: Sequence[tuple[str, int]]) -> None:
        """Hand the peer (name, descriptor) pairs in Grant frames (at most MAX_FDS_PER_MESSAGE
        each): the segments of the arena its engine instance may now write (app/wiring.py)."""
        items = list(items)
        for at in range(0, len(items), MAX_FDS_PER_MESSAGE):
            part = items[at : at + MAX_FDS_PER_MESSAGE]
            self.send(Grant(names=[n for n, _ in part]), [fd for _, fd in part])

    def refuse(self, reason: str) -> None:
        self.send(Refused(reason=reason[:1024]))
        self._close(reason)

    # -- the loop's callbacks ---------------------------------------------------------------------

    def _readable(self) -> None:
        """One bounded read per wake (`max_read_per_wake`): what is left waits for the next one."""
        limits = self._server.limits
        space = socket.CMSG_SPACE(limits.max_fds_per_message * _INT)
        if self.closed:
            return
        try:
            data, ancdata, flags, _ = self._sock.recvmsg(
                limits.max_read_per_wake, space, socket.MSG_CMSG_CLOEXEC
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(f"connection error: {exc.strerror}")
            return
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % _INT])
                self._fds.extend(fds)
                self.fds_received += len(fds)
        if flags & socket.MSG_CTRUNC:
            self.refuse(f"more than {limits.max_fds_per_message} descriptors in one message")
            return
        if self.fds_received > limits.max_fds_per_connection:
            self.refuse(f"more than {limits.max_fds_per_connection} descriptors on one lifeline")
            return
        if not data:
            self._close("closed by peer")
            return
        self._inbuf += data
        self._frames()

    def _frames(self) -> None:
        limits = self._server.limits
        while not self.closed and len(self._inbuf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._inbuf)
            if n > limits.max_message_bytes:
                self.refuse(f"frame of {n} bytes (limit {limits.max_message_bytes})")
                return
            if len(self._inbuf) < HEADER.size + n:
                break
            body = bytes(self._inbuf[HEADER.size : HEADER.size + n])
            del self._inbuf[: HEADER.size + n]
            try:
                message = decode_body(body)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                self.refuse(f"bad frame: {exc}")
                return
            count = fd_count(message) if isinstance(message, Share) else 0
            if count > len(self._fds):
                self.refuse("a frame without the descriptors it names")
                return
            fds, self._fds = self._fds[:count], self._fds[count:]
            self._handle(message, fds)
        if not self.closed and not self._inbuf and self._fds:
            self.refuse("descriptors on a frame that names none")

    def _handle(self, message: Message, fds: list[int]) -> None:
        if self.holder is None:
            if not isinstance(message, Hello):
                _close_fds(fds)
                self.refuse("the first frame must be a hello")
                return
            holder = self._server.authenticate(message.token)
            if holder is None:
                self.refuse("unknown token")
                return
            self.holder = holder
            if self._timer is not None:
                self._timer.cancel()
            offered = list(self._server.offer(holder)) if self._server.offer else []
            self.send(Welcome(names=[name for name, _ in offered]), [fd for _, fd in offered])
            if self._server.on_hello is not None:
                self._server.on_hello(self)
            return
        if isinstance(message, Heartbeat):
            if self._server.on_heartbeat is not None:
                self._server.on_heartbeat(self)
            return
        if not isinstance(message, Share):
            _close_fds(fds)
            self.refuse(f"unexpected {type(message).__name__} frame")
            return
        if len(message.sizes) != len(message.names):
            _close_fds(fds)
            self.refuse("a share needs one size per name")
            return
        regions = [SharedRegion(n, fd, s) for n, fd, s in zip(message.names, fds, message.sizes, strict=True)]
        try:
            self._server.on_fds(self, regions)  # owns the descriptors from here, even if it raises
        except LifelineRefused as exc:
            self.send(Refused(reason=str(exc)[:1024]))
            return
        except Exception:
            log.exception("lifeline_share_failed", pid=self.pid)
            self.refuse("the sidecar could not take the share")
            return
        self.send(Shared(names=list(message.names)))

    def _flush(self) -> None:
        while self._out and not self.closed:
            data, fds = self._out[0]
            try:
                if fds:
                    sent = self._sock.sendmsg(
                        [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    )
                else:
                    sent = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._close(f"send failed: {exc.strerror}")
                return
            _close_fds(fds)
            self._out_bytes -= sent
            self._out[0] = (data[sent:], [])
            if sent < len(data):
                break
            self._out.pop(0)
        loop = self._server.loop
        if self._out and not self._writing and not self.closed:
            loop.add_writer(self._sock.fileno(), self._flush)
            self._writing = True
        elif not self._out and self._writing:
            loop.remove_writer(self._sock.fileno())
            self._writing = False

    def _handshake_expired(self) -> None:
        if self.holder is None:
            self._close("no hello within the handshake timeout")

    def _close(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        loop = self._server.loop
        loop.remove_reader(self._sock.fileno())
        if self._writing:
            loop.remove_writer(self._sock.fileno())
        if self._timer is not None:
            self._timer.cancel()
        _close_fds(self._fds)
        for _, fds in self._out:
            _close_fds(fds)
        self._fds, self._out = [], []
        self._sock.close()
        self._server._closed(self, why)


class LifelineServer:
    def __init__(
        self,
        path: Path,
        *,
        authenticate: Callable[[bytes], object | None],
        on_fds: Callable[[Lifeline, list[SharedRegion]], None],
        on_closed: Callable[[Lifeline], object],
        offer: Callable[[object], Sequence[tuple[str, int]]] | None = None,
        limits: LifelineLimits = LifelineLimits(),
        on_hello: Callable[[Lifeline], None] | None = None,
        on_heartbeat: Callable[[Lifeline], None] | None = None,
    ) -> None:
        self.path = path
        self.on_hello = on_hello
        self.on_heartbeat = on_heartbeat
        self.authenticate = authenticate
        self.on_fds = on_fds
        self.on_closed = on_closed
        self.offer = offer
        self.limits = limits
        self.lines: set[Lifeline] = set()
        # refused at accept (uid, limits) / closed before a good hello: counted, rate-bounded lines
        self.refusals, self.drops = Complaints(log, "lifeline_refused"), Complaints(log, "lifeline_dropped")
        self._per_uid: dict[int, int] = {}
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def refused(self) -> int:  # refused at accept or dropped before a good hello
        return self.refusals.count + self.drops.count

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "start() first"
        return self._loop

    def start(self) -> None:
        """Bind and listen (on the running loop); a stale socket file is replaced."""
        self._loop = asyncio.get_running_loop()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o660)
            sock.listen(min(self.limits.max_connections, socket.SOMAXCONN))
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        self._loop.add_reader(sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting and close every lifeline (each gets its `on_closed`)."""
        if self._listener is not None:
            self.loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        for line in list(self.lines):
            line._close("server closing")

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(self.limits.max_accepts_per_wake):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.refusals.note(error=exc.strerror)
                return
            sock.setblocking(False)
            pid, uid, gid = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
            mine = self._per_uid.get(uid, 0)
            if (
                uid not in (os.getuid(), 0)
                or len(self.lines) >= self.limits.max_connections
                or mine >= self.limits.max_connections_per_uid
            ):
                self.refusals.note(pid=pid, uid=uid, connections=len(self.lines), of_uid=mine)
                sock.close()
                continue
            line = Lifeline(self, sock, pid, uid, gid)
            self.lines.add(line)
            self._per_uid[uid] = mine + 1
            line._timer = self.loop.call_later(self.limits.handshake_timeout_s, line._handshake_expired)
            self.loop.add_reader(sock.fileno(), line._readable)

    def _closed(self, line: Lifeline, why: str) -> None:
        self.lines.discard(line)
        left = self._per_uid.get(line.uid, 1) - 1
        if left > 0:
            self._per_uid[line.uid] = left
        else:
            self._per_uid.pop(line.uid, None)
        if line.holder is None:
            self.drops.note(pid=line.pid, reason=why)
            return
        log.info("lifeline_closed", pid=line.pid, reason=why)
        try:
            self.on_closed(line)
        except Exception:
            log.exception("lifeline_on_closed_failed", pid=line.pid)


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
