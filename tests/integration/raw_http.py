"""Raw client connections for the socket-budget tests (router, sidecar, directory): a TCP
connection that sends what it is told, a byte at a time if need be, and notes what came back and
whether the server closed it."""

from __future__ import annotations

import socket
from collections.abc import Callable

from tests.integration.waiting import wait_for


class Raw:
    """A raw client connection: what it was sent back, and whether the server closed it."""

    def __init__(self, port: int, first: bytes) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setblocking(False)
        self.got = b""
        self.closed = False
        if first:
            self.sock.send(first)

    def poll(self, trickle: bytes = b"") -> bool:
        """Read what arrived, send `trickle`; True once the server closed the connection."""
        if self.closed:
            return True
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    self.closed = True
                    return True
                self.got += data
        except BlockingIOError:
            pass
        except OSError:  # reset
            self.closed = True
            return True
        if trickle:
            try:
                self.sock.send(trickle)
            except BlockingIOError:
                pass
            except OSError:
                self.closed = True
        return self.closed

    def status(self) -> bytes:
        """The status code of the first answer it got (b"" when none)."""
        parts = self.got.split(b"\r\n", 1)[0].split(b" ")
        return parts[1] if len(parts) > 1 else b""

    def close(self) -> None:
        self.sock.close()


def trickle_until_closed(
    conns: list[Raw], timeout: float, what: str, meanwhile: Callable[[], None] = lambda: None
) -> None:
    """Send each open connection one more byte per round, until the server closed every one;
    `meanwhile()` runs each round (a real client's request: it must keep being answered)."""
    def all_closed() -> bool:
        meanwhile()
        return sum(r.poll(b"a") for r in conns) == len(conns)

    try:
        wait_for(all_closed, timeout=timeout, what=what)
    except AssertionError as exc:
        still = sum(not r.closed for r in conns)
        raise AssertionError(f"{exc}: {still} of {len(conns)} still open") from None
