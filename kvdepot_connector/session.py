"""What both data-plane clients share: the handshake state, the arena mapping, the copy steps
between the caller's tensors and the arena, and reply checking. No I/O here: the clients
(`client.KVDepotClient`, `aio.AsyncKVDepotClient`) send and receive."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import torch

from kvdepot_connector import protocol as p
from kvdepot_connector.errors import ProtocolMismatch, SidecarError, SidecarUnavailable
from kvdepot_connector.shm import ArenaMapping

R = TypeVar("R", bound=msgspec.Struct)


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    stored: int
    existing: int
    no_space: int
    quota: int
    expired: int

    @property
    def complete(self) -> bool:
        """Every requested chunk is now in L1 (stored now or already there)."""
        return self.no_space == 0 and self.quota == 0 and self.expired == 0


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("chunk tensors must be contiguous")
    return t.view(torch.uint8).reshape(-1) if t.dtype != torch.uint8 else t.reshape(-1)


class Session:
    """What both clients share: the handshake state, the arena, and the copy steps."""

    def __init__(self, model: str, layout: p.Layout, kv_rank: int, group: int) -> None:
        self.model = model
        self.layout = layout
        self.kv_rank = kv_rank
        self.group = group
        self.engine_id = 0
        self.chunk_bytes = layout.chunk_bytes
        self.arena: ArenaMapping | None = None
        self.hello: p.HelloReply | None = None

    def accept_hello(self, reply: p.HelloReply, map_arena: bool) -> None:
        if reply.version != p.PROTOCOL_VERSION:
            raise ProtocolMismatch(f"sidecar speaks protocol {reply.version}, client {p.PROTOCOL_VERSION}")
        if reply.chunk_size != self.layout.chunk_size:
            raise ProtocolMismatch(
                f"chunk size mismatch: sidecar {reply.chunk_size} tokens, engine {self.layout.chunk_size}"
            )
        if self.arena is None or self.arena.name != reply.arena_name:
            if self.arena is not None:
                self.arena.close()
                self.arena = None
            if map_arena:
                self.arena = ArenaMapping(reply.arena_name, reply.arena_size)
        self.hello = reply

    def register_msg(self, rid: int) -> p.Register:
        return p.Register(
            id=rid, model=self.model, layout=self.layout, kv_rank=self.kv_rank, group=self.group
        )

    def region(self, offset: int, size: int) -> torch.Tensor:
        if self.arena is None:
            raise SidecarUnavailable("the arena is not mapped")
        return self.arena.region(offset, size)

    def copy_in(self, reply: p.StoreReply, chunks: Sequence[torch.Tensor], first_chunk: int) -> list[int]:
        oids = []
        for slot in reply.slots:
            if slot.status is not p.SlotStatus.RESERVED:
                continue
            src = _as_u8(chunks[slot.chunk - first_chunk])
            if src.numel() != slot.size:
                raise ValueError(f"chunk {slot.chunk} has {src.numel()} bytes, the slot {slot.size}")
            self.region(slot.offset, slot.size).copy_(src)
            oids.append(slot.oid)
        return oids

    def copy_out(self, reply: p.RetrieveReply, outs: Sequence[torch.Tensor]) -> None:
        for ext, dst in zip(reply.extents, outs, strict=True):
            view = _as_u8(dst)
            if view.numel() != ext.size:
                raise ValueError(f"output of {view.numel()} bytes for a chunk of {ext.size}")
            view.copy_(self.region(ext.offset, ext.size))

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


def check_reply(reply: p.Reply, expected: type[R]) -> R:
    if isinstance(reply, p.ErrorReply):
        raise SidecarError(reply.code, reply.message, reply.retryable)
    if not isinstance(reply, expected):
        raise SidecarError("internal", f"expected {expected.__name__}, got {type(reply).__name__}", False)
    return reply


class ClientBase:
    """Identity and handshake state common to both clients; each adds its own transport."""

    def __init__(
        self,
        url: str,
        *,
        model: str,
        layout: p.Layout,
        kv_rank: int = 0,
        group: int = 0,
        timeout_s: float = 5.0,
        map_arena: bool = True,
        name: str = "",
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.name = name
        self._map_arena = map_arena
        self._session = Session(model, layout, kv_rank, group)
        self._ids = itertools.count(1)
        self._open_transport()

    def _open_transport(self) -> None:
        """The subclass's sockets and locks (nothing connects yet)."""
        raise NotImplementedError

    @property
    def engine_id(self) -> int:
        return self._session.engine_id

    @property
    def chunk_bytes(self) -> int:
        return self._session.chunk_bytes

    @property
    def chunk_size(self) -> int:
        return self._session.layout.chunk_size

    def _hello(self) -> p.Hello:
        return p.Hello(id=next(self._ids), version=p.PROTOCOL_VERSION, client=self.name)
