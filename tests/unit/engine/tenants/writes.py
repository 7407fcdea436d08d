"""What the tenant tests write: a page per chunk whose bytes name the tenant (`tag`), the sequence
and the chunk, stored and committed through the engine facade."""

from __future__ import annotations

import struct

from engine.facade import CacheEngine
from engine.results import SlotStatus, StoreSlot

PAGE = 4096  # a chunk of small_layout() (16 tokens) is one aligned page


def payload(tag: int, which: int, chunk: int) -> bytes:
    """What tenant `tag` writes for chunk `chunk` of sequence `which`: different per tenant."""
    head = struct.pack("<HHH", tag, which, chunk)
    return head + bytes([tag % 251 + 1]) * (PAGE - len(head))


def store(
    eng: CacheEngine, eid: int, toks: bytes, salt: str, tag: int = 0, which: int = 0, commit: bool = True
) -> list[StoreSlot]:
    """STORE `toks` for `salt`, write each reserved chunk's payload, COMMIT them (unless `commit`
    is false); the slots as the STORE answered."""
    slots = eng.store(eid, "w", toks, salt)
    reserved = [s for s in slots if s.status is SlotStatus.RESERVED]
    for s in reserved:
        with eng.arena.view(s.offset, s.size) as view:
            view[:] = payload(tag, which, s.chunk)
    if commit:
        assert all(eng.commit(eid, [s.oid for s in reserved]))
    return slots
