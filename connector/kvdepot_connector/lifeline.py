"""The lifeline: a unix socket per client process that the sidecar watches, and its wire format.

ZMQ reports neither disconnects nor peer processes and cannot pass file descriptors, so each
client process also holds a plain unix SOCK_STREAM connection to `<data_dir>/lifeline.sock`. The
sidecar reads the peer's credentials from it, learns at once when the process is gone (the kernel
closes the socket), and exchanges file descriptors over it (SCM_RIGHTS): the sidecar hands out the
arena's sealed memfd, the engine hands in the sealed memfds of the KV regions it shares.

Pure: the standard library and msgspec only, so the sidecar's server (api/lifeline.py) imports the
same message types and framing. State: `LifelineClient` owns one blocking socket and the
descriptors it received; it is used from one thread, except its sends, which hold a lock so that
the `Heartbeats` thread can send too (only the owning thread reads).

Wire format: each frame is a 4-byte big-endian body length, then a msgpack body (a tagged union on
`op`). Descriptors ride on the frame's bytes (SCM_RIGHTS); a frame carries exactly as many as it
names (`Welcome.names`, `Share.names`), and no other frame carries any.

  client -> Hello(token)                 server checks SO_PEERCRED and the token
  server -> Welcome(names) + fds         descriptors the sidecar offers: "arena" (one read-write
                                         memfd) or "arena:<i>" (segment i, read-only)
            or Refused(reason), then closes
  server -> Grant(names) + fds           at any time after Welcome: "write:<i>", segment i
                                         read-write (its engine instance now writes there);
                                         sent before any STORE reply naming an offset in it
  client -> Share(names, sizes) + fds    sealed regions of the engine's memory
  server -> Shared(names) | Refused(reason)
  client -> Heartbeat(seq)               every `heartbeat_s` the HELLO reply named, from the
                                         client's `Heartbeats` thread; no answer
  ... the connection stays open for the life of the process; EOF means "gone".

A malformed frame (also a heartbeat with unknown fields) is refused and the lifeline closed.
"""

from __future__ import annotations

import array
import contextlib
import os
import select
import socket
import struct
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated

import msgspec

HEADER = struct.Struct(">I")
MAX_MESSAGE_BYTES = 64 * 1024
MAX_FDS_PER_MESSAGE = 64
LabelName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Names = Annotated[list[LabelName], msgspec.Meta(max_length=MAX_FDS_PER_MESSAGE)]


class Hello(msgspec.Struct, tag="hello", tag_field="op", forbid_unknown_fields=True, frozen=True):
    token: Annotated[bytes, msgspec.Meta(max_length=256)]


class Welcome(msgspec.Struct, tag="welcome", tag_field="op", forbid_unknown_fields=True, frozen=True):
    names: Names = msgspec.field(default_factory=list)


class Share(msgspec.Struct, tag="share", tag_field="op", forbid_unknown_fields=True, frozen=True):
    names: Names
    sizes: Annotated[list[Annotated[int, msgspec.Meta(ge=1, lt=1 << 48)]], msgspec.Meta(max_length=64)]


class Shared(msgspec.Struct, tag="shared", tag_field="op", forbid_unknown_fields=True, frozen=True):
    names: Names


class Refused(msgspec.Struct, tag="refused", tag_field="op", forbid_unknown_fields=True, frozen=True):
    reason: Annotated[str, msgspec.Meta(max_length=1024)]


class Grant(msgspec.Struct, tag="grant", tag_field="op", forbid_unknown_fields=True, frozen=True):
    names: Names


class Heartbeat(msgspec.Struct, tag="heartbeat", tag_field="op", forbid_unknown_fields=True, frozen=True):
    seq: Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)] = 0


Message = Hello | Welcome | Share | Shared | Refused | Heartbeat | Grant

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class LifelineError(Exception):
    """The sidecar refused the lifeline or a share, or the connection broke."""


def encode_frame(message: Message) -> bytes:
    body = _encoder.encode(message)
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> Message:
    """The message in one frame's body; msgspec.ValidationError/DecodeError if it is not one."""
    return _decoder.decode(body)


def fd_count(message: Message) -> int:
    """How many descriptors a frame carrying `message` must carry."""
    if isinstance(message, Welcome | Share | Grant):
        return len(message.names)
    return 0


def send_frame(sock: socket.socket, message: Message, fds: Sequence[int] = ()) -> None:
    """Send one frame on a blocking socket, `fds` attached to its first byte."""
    data = encode_frame(message)
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


def _take_fds(ancdata: list[tuple[int, int, bytes]], into: list[int]) -> None:
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            into.extend(fds)


class LifelineClient:
    """A client process's lifeline: connect, say hello with the token, then share descriptors."""

    def __init__(self, path: str | Path, token: bytes, *, timeout: float = 10.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout)
        self._buf = b""
        self._fds: list[int] = []
        self._send_lock = threading.Lock()
        self.received: dict[str, int] = {}
        #: descriptors of Grant frames not yet taken (name -> fd; the taker closes them)
        self.granted: dict[str, int] = {}
        try:
            self._sock.connect(str(path))
            send_frame(self._sock, Hello(token=token))
            reply, fds = self._read()
            if not isinstance(reply, Welcome):
                _close_all(fds)
                raise LifelineError(f"lifeline refused: {_reason(reply)}")
            self.received = dict(zip(reply.names, fds, strict=True))
        except OSError as exc:
            self.close()
            raise LifelineError(f"lifeline {path}: {exc}") from None
        except LifelineError:
            self.close()
            raise

    def share(self, regions: Sequence[tuple[str, int, int]]) -> None:
        """Hand the sidecar (name, fd, size) regions; returns once it accepted them all."""
        if not regions:
            return
        message = Share(names=[r[0] for r in regions], sizes=[r[2] for r in regions])
        try:
            with self._send_lock:
                send_frame(self._sock, message, [r[1] for r in regions])
            reply, fds = self._reply()
        except OSError as exc:
            raise LifelineError(f"lifeline broke: {exc}") from None
        _close_all(fds)
        if not isinstance(reply, Shared):
            raise LifelineError(f"share refused: {_reason(reply)}")

    def poll(self) -> None:
        """Take the frames already waiting (grants), without blocking."""
        while self._take_one(block=False):
            pass

    def wait_granted(self, name: str) -> int | None:
        """The descriptor of grant `name`, reading frames (up to the socket timeout each) until it
        came; None if the sidecar sent something else first (no such grant is coming)."""
        try:
            while name not in self.granted:
                if not self._take_one(block=True):
                    return None
        except (OSError, TimeoutError) as exc:
            raise LifelineError(f"lifeline broke: {exc}") from None
        return self.granted.pop(name)

    def _take_one(self, *, block: bool) -> bool:
        """Read one frame and keep what a Grant brings; False for any other frame (dropped) or
        when nothing complete is waiting and `block` is False."""
        if not block and not self._complete() and not select.select([self._sock], [], [], 0)[0]:
            return False
        message, fds = self._read()
        if isinstance(message, Grant):
            self.granted.update(zip(message.names, fds, strict=True))
            return True
        _close_all(fds)
        return False

    def _complete(self) -> bool:
        if len(self._buf) < HEADER.size:
            return False
        n: int = HEADER.unpack_from(self._buf)[0]
        return len(self._buf) >= HEADER.size + n

    def _reply(self) -> tuple[Message, list[int]]:
        """The next frame that is not a Grant (grants read meanwhile are kept)."""
        while True:
            message, fds = self._read()
            if not isinstance(message, Grant):
                return message, fds
            self.granted.update(zip(message.names, fds, strict=True))

    def heartbeat(self, seq: int) -> None:
        """Send one heartbeat (any thread); OSError when the lifeline broke."""
        with self._send_lock:
            send_frame(self._sock, Heartbeat(seq=seq))

    def take(self, name: str) -> int:
        """A descriptor the sidecar offered at welcome; the caller owns (and closes) it."""
        return self.received.pop(name)

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        _close_all(self.received.values())
        _close_all(self.granted.values())
        self.received = {}
        self.granted = {}
        _close_all(self._fds)
        self._fds = []
        self._sock.close()

    def _read(self) -> tuple[Message, list[int]]:
        space = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * array.array("i").itemsize)
        while True:
            if len(self._buf) >= HEADER.size:
                (n,) = HEADER.unpack_from(self._buf)
                if n > MAX_MESSAGE_BYTES:
                    raise LifelineError(f"lifeline frame of {n} bytes")
                if len(self._buf) >= HEADER.size + n:
                    body = self._buf[HEADER.size : HEADER.size + n]
                    self._buf = self._buf[HEADER.size + n :]
                    try:
                        message = decode_body(body)
                    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                        raise LifelineError(f"bad lifeline frame: {exc}") from None
                    count = fd_count(message)
                    if count > len(self._fds):
                        raise LifelineError("lifeline frame without its descriptors")
                    fds, self._fds = self._fds[:count], self._fds[count:]
                    return message, fds
            data, ancdata, _flags, _addr = self._sock.recvmsg(65536, space, socket.MSG_CMSG_CLOEXEC)
            _take_fds(ancdata, self._fds)
            if not data:
                raise LifelineError("the sidecar closed the lifeline")
            self._buf += data


class Heartbeats:
    """A daemon thread sending `line.heartbeat` every `interval_s` until `stop()` or until the
    lifeline breaks (the sidecar then knows the process is gone or broken anyway). Its own thread,
    so an engine step that takes seconds does not silence the process."""

    def __init__(self, line: LifelineClient, interval_s: float) -> None:
        self.line = line
        self.interval_s = interval_s
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvdepot-heartbeat", daemon=True)

    def start(self) -> Heartbeats:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop and wait for the thread (a send in progress ends within the socket timeout)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.line.heartbeat(self.sent)
            except OSError:
                return
            self.sent += 1


def _reason(message: Message) -> str:
    return message.reason if isinstance(message, Refused) else f"unexpected {type(message).__name__}"


def _close_all(fds: Iterable[int]) -> None:
    for fd in list(fds):
        with contextlib.suppress(OSError):
            os.close(fd)
