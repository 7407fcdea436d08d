"""PeerDropper: disconnects a peer of the XPUB socket that keeps sending filters the publisher refuses.

Why: libzmq's XPUB (XPUB_MANUAL included) stores every filter a connected peer sends, applied or
not, in a trie it frees only when that peer disconnects, and every disconnection walks that whole
trie on the socket's thread (the event loop). A peer streaming unique filters would grow the
process without bound and make each disconnection cost more; libzmq offers no call to drop one
peer, so this module does it from below: the connection's socket is `shutdown()` (never closed:
libzmq still owns the descriptor and closes it itself once it sees the end of the stream).

Who: a subscription message carries its connection's `Peer-Address` (libzmq metadata): for ipc
`<host>:<uid>:<gid>:<pid>` (SO_PEERCRED), for tcp the peer's IP. A peer (that key: one local
process, or one remote address) whose refused filters reach `budget` has every connection to this
endpoint shut down (found among the process's descriptors: bound to the endpoint's address, with
that peer on the other end). A peer that reconnects starts again from zero; an honest subscriber
(this sidecar's topics only) is never refused, so never dropped, unless it shares the key.

State (event loop only): refused filters per peer key (bounded), connections dropped.
Primitives: PeerDropper(endpoint, budget) (the bound endpoint) -> refused(peer_address) -> dropped.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct

#: peer keys tracked at once; past it the counts start again (a peer is then dropped later, not never)
MAX_TRACKED = 4096
_UCRED = struct.Struct("iII")  # pid, uid, gid


class PeerDropper:
    def __init__(self, endpoint: str, budget: int) -> None:
        self.budget = budget
        self.ipc = endpoint.startswith("ipc://")
        self._path: str | bytes | None = None
        self._port = 0
        if self.ipc:
            name = endpoint[len("ipc://") :]
            self._path = b"\0" + name[1:].encode() if name.startswith("@") else name
        elif endpoint.startswith("tcp://"):
            self._port = int(endpoint.rsplit(":", 1)[1])
        self.dropped = 0
        """Connections shut down."""
        self.peers_dropped = 0
        """Times a peer reached the budget."""
        self._refused: dict[str, int] = {}

    def refused(self, peer_address: str | None) -> None:
        """Count one refused filter from that peer; past the budget, drop its connections."""
        key = self._key(peer_address)
        if key is None:
            return
        n = self._refused.get(key, 0) + 1
        if n < self.budget:
            if len(self._refused) >= MAX_TRACKED and key not in self._refused:
                self._refused.clear()
            self._refused[key] = n
            return
        self._refused.pop(key, None)
        self.peers_dropped += 1
        self.dropped += self._drop(key)

    def _key(self, peer_address: str | None) -> str | None:
        if not peer_address:
            return None
        if self.ipc:
            parts = peer_address.rsplit(":", 3)
            return ":".join(parts[1:]) if len(parts) == 4 else None
        return peer_address.strip("[]")

    def _drop(self, key: str) -> int:
        try:
            fds = [int(n) for n in os.listdir("/proc/self/fd")]
        except OSError:
            return 0  # no /proc: counted, not dropped
        shut = 0
        for fd in fds:
            with contextlib.suppress(OSError, ValueError):
                if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    continue
                with socket.socket(fileno=os.dup(fd)) as sock:  # the duplicate is closed, not the fd
                    if self._ours(sock) and self._peer_key(sock) == key:
                        sock.shutdown(socket.SHUT_RDWR)
                        shut += 1
        return shut

    def _ours(self, sock: socket.socket) -> bool:
        """An accepted connection on this endpoint (not the listener, not an outgoing socket)."""
        if self.ipc:
            return sock.getsockname() == self._path and sock.getpeername() in ("", b"")
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.getsockname()[1] != self._port:
            return False
        sock.getpeername()  # the listener has none (OSError)
        return True

    def _peer_key(self, sock: socket.socket) -> str:
        if self.ipc:
            pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            return f"{uid}:{gid}:{pid}"
        return str(sock.getpeername()[0])
