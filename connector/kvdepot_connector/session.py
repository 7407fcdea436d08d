"""What both data-plane clients share: the handshake state, the arena mapping and the copy steps
between the caller's tensors and the arena (each operation's request and the reading of its reply
are `kvdepot_connector.calls`). No I/O here: the clients (`client.KVDepotClient`,
`aio.AsyncKVDepotClient`) only send and receive.

State (`Session`): the engine's identity (model, layout, kv rank, group), the engine instance
nonce it says HELLO with (shared by an engine's processes: they own their requests and
reservations together), the engine id the sidecar gave it (0 until the handshake), the request id
counter, the lifeline and the mapped arena. Touched by one client, under its lock (blocking) or on
its event loop (asyncio).

The lifeline (kvdepot_connector.lifeline): right after each HELLO the client connects it with the
token the reply handed out, and keeps it open for the life of the client (a new HELLO connects a
new one, then closes the old). The arena's sealed memfds come over it and are mapped from the
descriptors (kvdepot_connector.shm), never by name: every segment read-only, and read-write only
the segments the sidecar grants this engine instance (write domains). Before copying into a slot
in a segment not yet granted, the client reads the grant the sidecar sent before its STORE reply;
after each commit it takes the grants already waiting (segments granted ahead of their first
write) and maps them in the arena mapping's thread, off the next store's path (`map_ahead`); the
grant handling is kvdepot_connector.grants.
It is how the sidecar knows the client is alive: when it closes (the process died, or `close()`),
the sidecar drops the session's reservations and, with the last session of the engine instance,
the instance's read locks and registrations. When the HELLO reply asks for heartbeats
(`heartbeat_s`), a thread of the session's own (`lifeline.Heartbeats`) sends them over the
lifeline, so a stalled process is told from a busy one; the session's `role` and `rank` (HELLO)
name it in the sidecar's worker registry.

Primitives:
  Session.handshake()                   the handshake's calls (hello: the lifeline; register)
  Session.message(call)                 a call's message, with a fresh id and the engine id
  Session.recovery(call, reply)         the calls to make before resending: the sidecar no longer
                                         knows this connection (it restarted, or closed an idle
                                         session: hello and register) or engine (register)
  Session.share(regions)                sealed KV regions to the sidecar, over the lifeline
  Session.close()                       the lifeline and the arena mapping go
  Session.copy_in / copy_out / outcome  the copies of a store or a retrieve and their result
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Sequence

import torch

from kvdepot_connector import grants
from kvdepot_connector import protocol as p
from kvdepot_connector.calls import Call, T, check_reply
from kvdepot_connector.errors import ProtocolMismatch, SidecarError, SidecarUnavailable
from kvdepot_connector.fences import Fences
from kvdepot_connector.lifeline import Heartbeats, LifelineClient, LifelineError
from kvdepot_connector.outcomes import Locked, StoreOutcome
from kvdepot_connector.shm import ArenaMapping, identity


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("chunk tensors must be contiguous")
    return t.view(torch.uint8).reshape(-1) if t.dtype != torch.uint8 else t.reshape(-1)


def _nbytes(t: torch.Tensor) -> int:
    if not t.is_contiguous():
        raise ValueError("chunk tensors must be contiguous")
    return t.numel() * t.element_size()


class Session:
    """What both clients share: the handshake state, the arena, the copy steps."""

    def __init__(
        self, model: str, layout: p.Layout, kv_rank: int, group: int, *, name: str, map_arena: bool,
        instance: str, timeout_s: float = 5.0, role: p.Role = "", rank: int | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.role = role
        self.rank = rank
        self.instance = instance
        self.layout = layout
        self.kv_rank = kv_rank
        self.group = group
        self.name = name
        self.map_arena = map_arena
        self.engine_id = 0
        self.chunk_bytes = layout.chunk_bytes
        self.arena: ArenaMapping | None = None
        self.fences: Fences | None = None
        self.lifeline: LifelineClient | None = None
        self.heartbeats: Heartbeats | None = None
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)

    def message(self, call: Call[T]) -> p.Request:
        return call.build(next(self._ids), self.engine_id)

    def recovery(self, call: Call[T], reply: p.Reply) -> list[Call[None]]:
        """What to call before resending `call`, after `reply`: nothing (the reply stands), the
        whole handshake (the sidecar no longer knows this connection), or a register (it no
        longer knows the engine id; the session, its lifeline and reservations stay)."""
        if not isinstance(reply, p.ErrorReply):
            return []
        if reply.code == p.ErrorCode.HELLO_REQUIRED:
            return self.handshake()
        if call.registered and reply.code == p.ErrorCode.NOT_REGISTERED:
            return [self.register()]
        return []

    def handshake(self) -> list[Call[None]]:
        return [self.hello(), self.register()]

    def share(self, regions: Sequence[tuple[str, int, int]]) -> None:
        """Hand the sidecar sealed regions (name, fd, bytes) over this client's lifeline."""
        if self.lifeline is None:
            raise SidecarUnavailable("no lifeline to the sidecar (connect first)")
        try:
            self.lifeline.share(regions)
        except LifelineError as exc:
            raise SidecarError("refused", str(exc), False) from None

    def close(self) -> None:
        """Close the lifeline (the sidecar drops this session's state) and unmap the arena."""
        self._stop_heartbeats()
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None
        self.close_arena()

    def _stop_heartbeats(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.stop()
            self.heartbeats = None

    def close_arena(self) -> None:
        self._map_fences(None)
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    # --- handshake -----------------------------------------------------------------------------

    def hello(self) -> Call[None]:
        build = lambda i, _: p.Hello(  # noqa: E731
            id=i,
            version=p.PROTOCOL_VERSION,
            client=self.name,
            instance=self.instance,
            role=self.role,
            rank=self.rank,
        )
        return Call(build, lambda r: self._accept_hello(check_reply(r, p.HelloReply)), registered=False)

    def _accept_hello(self, reply: p.HelloReply) -> None:
        if reply.version != p.PROTOCOL_VERSION:
            raise ProtocolMismatch(f"sidecar speaks protocol {reply.version}, client {p.PROTOCOL_VERSION}")
        if reply.chunk_size != self.layout.chunk_size:
            raise ProtocolMismatch(
                f"chunk size mismatch: sidecar {reply.chunk_size} tokens, engine {self.layout.chunk_size}"
            )
        self._connect_lifeline(reply)
        self._map_arena(reply)

    def _map_arena(self, reply: p.HelloReply) -> None:
        """Map the arena from the descriptors the lifeline brought (never by name), unless the
        same arena is mapped already; the descriptors themselves are closed either way."""
        received = self.lifeline.received if self.lifeline is not None else {}
        fences = received.pop("fences", None)
        fd = received.pop("arena", None)
        segments = sorted((int(k.split(":")[1]), v) for k, v in received.items() if k.startswith("arena:"))
        for k, _ in segments:
            received.pop(f"arena:{k}")
        fds = [v for _, v in segments]
        try:
            first = fds[0] if fds else fd  # the same arena only if the same memfd (names repeat)
            if self.arena is not None and first is not None and self.arena.identity == identity(first):
                return
            self.close_arena()
            if not self.map_arena:
                return
            try:
                if fds and [k for k, _ in segments] == list(range(len(fds))):
                    self.arena = ArenaMapping.from_segments(fds, reply.arena_size)
                elif fd is not None:
                    self.arena = ArenaMapping.from_fd(fd, reply.arena_size)
            except (OSError, ValueError) as exc:
                raise SidecarUnavailable(f"cannot map the arena: {exc}") from None
        finally:
            for f in fds if fd is None else [*fds, fd]:
                os.close(f)
            self._map_fences(fences)  # after close_arena, which unmaps the old ones
        self._take_grants()

    def _map_fences(self, fd: int | None) -> None:
        """Map the release fences the lifeline brought (closing `fd`); none: every RELEASE asks."""
        if self.fences is not None:
            self.fences.close()
            self.fences = None
        if fd is not None:
            try:
                self.fences = Fences.open(fd) if self.map_arena else None
            except (OSError, ValueError):
                self.fences = None  # the RELEASEs ask the sidecar, as without fences
            finally:
                os.close(fd)

    def unmoved(self, fences: Sequence[p.Fence]) -> bool:
        """The copies made since the RETRIEVE that named `fences` are valid, without asking."""
        return self.fences is not None and self.engine_id != 0 and self.fences.unmoved(fences)

    def _take_grants(self, wait_for: int | None = None, *, soon: bool = False) -> None:
        grants.take(self.lifeline, self.arena, wait_for, soon=soon)

    def _writable(self, offset: int, size: int) -> ArenaMapping:
        """The arena, once this process may write `[offset, offset+size)` (kvdepot_connector.grants)."""
        arena = self._mapped()
        grants.writable(self.lifeline, arena, offset, size)
        return arena

    def _connect_lifeline(self, reply: p.HelloReply) -> None:
        """Connect this session's lifeline (the new one first, then the old one goes: the
        engine instance keeps a live session throughout), and its heartbeats when asked."""
        self._stop_heartbeats()
        old, self.lifeline = self.lifeline, None
        try:
            if reply.lifeline_path:
                try:
                    self.lifeline = LifelineClient(
                        reply.lifeline_path, reply.lifeline_token, timeout=self.timeout_s
                    )
                except LifelineError as exc:
                    raise SidecarUnavailable(f"cannot connect the lifeline: {exc}") from None
                if reply.heartbeat_s > 0:
                    self.heartbeats = Heartbeats(self.lifeline, max(reply.heartbeat_s, 0.05)).start()
        finally:
            if old is not None:
                old.close()

    def register(self) -> Call[None]:
        def build(i: int, _: int) -> p.Request:
            return p.Register(
                id=i, model=self.model, layout=self.layout, kv_rank=self.kv_rank, group=self.group
            )

        return Call(build, lambda r: self._accept_register(check_reply(r, p.RegisterReply)), registered=False)

    def _accept_register(self, reply: p.RegisterReply) -> None:
        self.engine_id = reply.engine_id
        self.chunk_bytes = reply.chunk_bytes

    # --- copies --------------------------------------------------------------------------------

    def region(self, offset: int, size: int) -> torch.Tensor:
        if self.arena is None:
            raise SidecarUnavailable("the arena is not mapped")
        return self.arena.region(offset, size)

    def writable_region(self, offset: int, size: int) -> torch.Tensor:
        """`region`, once this process may write it (write domains: the grant read)."""
        return self._writable(offset, size).region(offset, size)

    def _mapped(self) -> ArenaMapping:
        if self.arena is None:
            raise SidecarUnavailable("the arena is not mapped")
        return self.arena

    def copy_in(self, reply: p.StoreReply, chunks: Sequence[torch.Tensor], first_chunk: int) -> list[int]:
        """Copy the chunks into their reserved slots (CPU tensors: one memmove each); the oids
        to commit."""
        oids = []
        for slot in reply.slots:
            if slot.status is not p.SlotStatus.RESERVED:
                continue
            src = chunks[slot.chunk - first_chunk]
            size = _nbytes(src)
            if size != slot.size:
                raise ValueError(f"chunk {slot.chunk} has {size} bytes, the slot {slot.size}")
            arena = self._writable(slot.offset, slot.size)
            if src.device.type == "cpu":
                arena.write(slot.offset, src.data_ptr(), size)
            else:
                arena.region(slot.offset, slot.size).copy_(_as_u8(src))
            oids.append(slot.oid)
        return oids

    def map_ahead(self) -> None:
        """Map the segments granted so far (ahead of their first write) in the arena mapping's
        thread: called after each commit, off the path of the store that will write them (a
        broken lifeline is the next call's to report)."""
        with contextlib.suppress(SidecarUnavailable):
            self._take_grants(soon=True)

    def locked(self, reply: p.RetrieveReply | p.LookupReply, first: int = 0, count: int = -1) -> Locked:
        """Views of chunks `first..first+count` (-1: all) of a RETRIEVE's or LOOKUP's extents; a
        LOOKUP's only when they are that many, in the arena mapped here (else ValueError)."""
        ext = reply.extents[first:] if count < 0 else reply.extents[first : first + count]
        if isinstance(reply, p.LookupReply):
            mapped = self.arena.name if self.arena is not None else None
            if reply.arena != mapped or first < 0 or len(ext) != count:
                raise ValueError("the lookup names no such extents in the arena this client maps")
        views = [self.region(e.offset, e.size) for e in ext]
        return Locked(views, [e.oid for e in ext], reply.fences, reply.epoch)

    @staticmethod
    def oids(reply: p.RetrieveReply) -> list[int]:
        """The objects a retrieve's copies come from (what RELEASE checks)."""
        return [ext.oid for ext in reply.extents if ext.oid]

    def copy_out(self, reply: p.RetrieveReply, outs: Sequence[torch.Tensor]) -> None:
        """Copy the locked chunks into `outs` (CPU tensors: one memmove each)."""
        for ext, dst in zip(reply.extents, outs, strict=True):
            size = _nbytes(dst)
            if size != ext.size:
                raise ValueError(f"output of {size} bytes for a chunk of {ext.size}")
            if dst.device.type == "cpu":
                self._mapped().read(ext.offset, dst.data_ptr(), size)
            else:
                _as_u8(dst).copy_(self.region(ext.offset, ext.size))

    @staticmethod
    def reserved(reply: p.StoreReply) -> list[int]:
        """The oids of the slots reserved by a store (what an abort gives back)."""
        return [s.oid for s in reply.slots if s.status is p.SlotStatus.RESERVED]

    @staticmethod
    def outcome(reply: p.StoreReply, committed: Sequence[bool]) -> StoreOutcome:
        counts = {s: 0 for s in p.SlotStatus}
        for slot in reply.slots:
            counts[slot.status] += 1
        expired = sum(1 for ok in committed if not ok)
        return StoreOutcome(
            stored=counts[p.SlotStatus.RESERVED] - expired,
            existing=counts[p.SlotStatus.EXISTS],
            no_space=counts[p.SlotStatus.NO_SPACE],
            quota=counts[p.SlotStatus.QUOTA],
            expired=expired,
        )

