"""StoreAnnouncer: what the STORED event of a chunk a client stores says, kept from STORE to COMMIT.

A client's chunk becomes readable at COMMIT, which names only oids; the event says what the STORE
knew: the chunk's tokens (uint32 little-endian), the hash of the chunk before it, its extra key,
the request id and the LoRA adapter's name. `reserved` keeps that per reservation (only while the
bus is enabled), `committed` publishes STORED (tier L1), forgets it and answers it (the chunk's
write-behind announces the same origin), `dropped` forgets it
(abort), `prune` forgets reservations that are gone otherwise (reaped, quarantined, their session
gone), so what is kept is bounded by the live reservations.

State: oid -> the announcement's fields. Event loop only.

Primitives in call order: reserved(oid, ...) -> committed(obj) | dropped(oid) ... prune(live).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.events import L1_TIER, ChunkOrigin, EventBus, Kind
from engine.l1.lifecycle import L1Object

_Pending = tuple[str, ChunkOrigin]
"""(request id, what the STORE said of the chunk)."""


class StoreAnnouncer:
    def __init__(self, events: EventBus, chunk_size: int) -> None:
        self.events = events
        self._chunk_bytes = chunk_size * 4
        self._pending: dict[int, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def reserved(
        self, oid: int, request_id: str, tokens: bytes, chunk: int, *, hashes: Sequence[bytes],
        extras: Sequence[bytes], lora_name: str,
    ) -> None:  # fmt: skip
        """Chunk `chunk` of `tokens` (hashes: the chain's) was reserved as `oid`."""
        step = self._chunk_bytes
        self._pending[oid] = (
            request_id,
            ChunkOrigin(
                tokens[chunk * step : (chunk + 1) * step],
                hashes[chunk - 1] if chunk else b"",
                extras[chunk] if chunk < len(extras) else b"",
                lora_name,
            ),
        )

    def committed(self, obj: L1Object) -> tuple[str, ChunkOrigin | None]:
        """Publish STORED for `obj`; answer the request id its STORE named ("" unknown) and what the
        event said of the chunk (None: nothing known)."""
        pending = self._pending.pop(obj.oid, None)
        if pending is None or not obj.visible:
            return "", None
        request_id, origin = pending
        self.events.emit(
            Kind.STORED, tier=L1_TIER, key=obj.key, op="commit", request_id=request_id, tokens=origin.tokens,
            parent=origin.parent, extra=origin.extra, lora_name=origin.lora_name,
        )  # fmt: skip
        return request_id, origin

    def dropped(self, oid: int) -> None:
        self._pending.pop(oid, None)

    def prune(self, live: Callable[[int], bool]) -> int:
        """Forget the oids `live` says are no longer reservations. Answers how many."""
        gone = [oid for oid in self._pending if not live(oid)]
        for oid in gone:
            del self._pending[oid]
        return len(gone)
