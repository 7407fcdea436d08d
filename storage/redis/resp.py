"""RESP2 over one blocking socket: the wire protocol of the Redis bulk lane (storage/redis/lane.py).

State: per Connection, its socket, a small receive buffer and the deadline of the command in
progress; one thread uses a Connection at a time. Nothing is shared.

Only what the lane sends is spoken: commands as arrays of bulk strings, and replies that are
simple strings, errors, integers and bulk strings (arrays only to skip them).

Primitives in call order:
  target_from_url(url)            host/port or unix socket, username, password, db; None for rediss://
  connect(target, timeout, dl)    TCP (TCP_NODELAY) or unix socket; AUTH [username] password and
                                  SELECT db, pipelined
  Connection.begin(deadline)      every later socket call waits at most timeout_s for progress and
                                  never past the deadline (TimeoutError)
  send(buffers)                   sendmsg of the buffers as they are, nothing joined
  readline / bulk_len / read_into / crlf / skip / skip_reply
                                  replies; read_into lands a bulk string's bytes straight in the
                                  caller's memory (recv_into), past the few bytes already buffered
  Window(conn, commands, depth)   commands sent ahead of their replies, at most `depth` unanswered
A reply that makes no sense raises ReplyMismatch; the connection is then to be closed.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.connection import parse_url

from storage.codec import blob_header

_SCRATCH_BYTES = 64 * 1024
_LINE_READ = 8 * 1024  # a line read takes at most this much (payload bytes past it are copied)
_MAX_LINE = 4 * 1024
CRLF = b"\r\n"


class ReplyMismatch(Exception):
    """A reply that makes no sense here: the connection cannot be trusted any more."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how to connect: host/port or a unix socket path, credentials, database."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    username: str | None = None
    password: str | None = None
    db: int = 0

    def describe(self) -> str:
        return self.path if self.path is not None else f"{self.host}:{self.port}"


def target_from_url(url: str) -> Target | None:
    """The target of a redis:// or unix:// URL; None for rediss:// (TLS is not spoken here)."""
    parts: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]  # redis-py's own parser
    connection_class = parts.get("connection_class")
    if connection_class is not None and "SSL" in connection_class.__name__:
        return None
    return Target(
        host=str(parts.get("host") or "127.0.0.1"),
        port=int(parts.get("port") or 6379),
        path=parts.get("path"),
        username=parts.get("username"),
        password=parts.get("password"),
        db=int(parts.get("db") or 0),
    )


def command(*args: bytes) -> bytes:
    """A RESP array of bulk strings (for small commands; values go as separate buffers)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


class Connection:
    """One blocking connection and its small receive buffer. One thread at a time."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.deadline = 0.0
        self.got_reply = False
        self._buf = bytearray(_SCRATCH_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def begin(self, deadline: float) -> None:
        self.deadline = deadline
        self.got_reply = False

    def close(self) -> None:
        self.sock.close()

    def _arm(self) -> None:
        remaining = min(self.timeout_s, self.deadline - time.monotonic())
        if remaining <= 0:
            raise TimeoutError("command ran past its deadline")
        self.sock.settimeout(remaining)

    def send(self, parts: Sequence[blob_header.Buffer]) -> None:
        views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
        while views:
            self._arm()
            sent = self.sock.sendmsg(views)
            while views and sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]

    def _recv(self, into: memoryview) -> int:
        self._arm()
        n = self.sock.recv_into(into)
        if n == 0:
            raise ConnectionError("connection closed by the server")
        self.got_reply = True
        return n

    def readline(self) -> bytes:
        while True:
            at = self._buf.find(CRLF, self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start : at])
                self._start = at + 2
                return line
            if self._end - self._start > _MAX_LINE:
                raise ReplyMismatch("reply line too long")
            if self._start:
                pending = self._end - self._start
                self._buf[:pending] = self._view[self._start : self._end]
                self._start, self._end = 0, pending
            self._end += self._recv(self._view[self._end : self._end + _LINE_READ])

    def read_into(self, dest: memoryview) -> None:
        """Exactly dest.nbytes bytes: what is buffered, then straight from the socket."""
        need = dest.nbytes
        have = min(self._end - self._start, need)
        if have:
            dest[:have] = self._view[self._start : self._start + have]
            self._start += have
        got = have
        while got < need:
            got += self._recv(dest[got:])

    def skip(self, count: int) -> None:
        while count:
            have = min(self._end - self._start, count)
            if have:
                self._start += have
                count -= have
                continue
            self._start = self._end = 0
            self._end = self._recv(self._view[: min(count, _SCRATCH_BYTES)])

    def crlf(self) -> None:
        if self.readline():
            raise ReplyMismatch("bulk string not followed by CRLF")

    def bulk_len(self) -> int:
        line = self.readline()
        if line[:1] != b"$":
            raise ReplyMismatch(f"expected a bulk string, got {line[:64]!r}")
        return int(line[1:])

    def skip_reply(self) -> bytes | None:
        """Consume one reply of any type; the message of an error reply, else None."""
        line = self.readline()
        kind = line[:1]
        if kind == b"-":
            return line[1:]
        if kind == b"$" and int(line[1:]) >= 0:
            self.skip(int(line[1:]) + 2)
        elif kind == b"*":
            for _ in range(max(0, int(line[1:]))):
                self.skip_reply()
        return None


def connect(target: Target, timeout_s: float, deadline: float) -> Connection:
    """A new connection, authenticated and on the URL's database, or OSError (ConnectionError
    when the server refuses the handshake)."""
    wait = max(0.001, min(timeout_s, deadline - time.monotonic()))
    if target.path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(wait)
            sock.connect(target.path)
        except BaseException:
            sock.close()
            raise
    else:
        sock = socket.create_connection((target.host, target.port), timeout=wait)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = Connection(sock, timeout_s)
    try:
        conn.begin(deadline)
        hello: list[bytes] = []
        if target.password is not None:
            credentials = [target.username.encode()] if target.username else []
            hello.append(command(b"AUTH", *credentials, target.password.encode()))
        if target.db:
            hello.append(command(b"SELECT", b"%d" % target.db))
        if hello:
            conn.send([b"".join(hello)])
            for _ in hello:
                line = conn.readline()
                if line != b"+OK":
                    raise ConnectionError(f"handshake refused: {error_text(line[:200])}")
    except BaseException:
        conn.close()
        raise
    return conn


class Window:
    """Commands sent ahead of their replies, at most `depth` unanswered: the server never holds
    more than that many replies for this connection."""

    def __init__(self, conn: Connection, commands: list[bytes], depth: int) -> None:
        self.conn = conn
        self.commands = commands
        self.depth = depth
        self.sent = 0
        self.answered = 0
        self._fill()

    def _fill(self) -> None:
        end = min(len(self.commands), self.answered + self.depth)
        if end > self.sent:
            self.conn.send([b"".join(self.commands[self.sent : end])])
            self.sent = end

    def next(self) -> None:
        """The caller starts reading the next reply; the window slides."""
        self.answered += 1
        self._fill()

    def add(self, *commands: bytes) -> None:
        self.commands.extend(commands)
        self._fill()

    def drain(self) -> None:
        """Send nothing more; consume the replies still owed (the connection stays usable)."""
        del self.commands[self.sent :]
        while self.answered < self.sent:
            self.answered += 1
            self.conn.skip_reply()


def error_text(message: bytes) -> str:
    return message.decode("utf-8", errors="replace")
