"""PinTable: the prefix pins of every tenant, and which chunks they hold in which tier.

A pin names a tenant (cache_salt), a model, the chain hashes of the full chunks of a token prefix
(engine/keys.py), the tiers it holds them in (`l1`, adapter names) and when it runs out (None:
until it is deleted). It holds those chunks in every namespace of the model: every layout, kv rank
and object group, since a chunk hash depends on the tokens and the sidecar's chunk size alone.
Holding is a lookup where victims are chosen (engine/l1/room.py; storage/holdings.py for the
adapters that honour pins), nothing is marked on the chunk: a chunk stored after the pin was made
is held as soon as it arrives, and a released pin frees its chunks for eviction at once.

State (event loop only): pins by (salt, id); per tier, (model, salt, chunk hash) -> how many pins
hold that chunk (pins of one tenant may share chunks: a prefix and a longer one).

Primitives in call order:
  put(pin)                  add, or replace the pin of the same (salt, id) -> the replaced one
  has(salt, id) / get(salt, id) / pins([salt]) / __len__
  holds(tier, model, salt, chunk_hash)
  kept_in_l1(key)           for L1Cache.bind_pins: an ObjectKey a pin holds in L1
  kept_in(tier)             for an adapter's bind_pins: a serialized key a pin holds there
  remove(salt, id)          -> the pin (NotFound) / remove_tenant(salt) -> its pins
  expire(now)               -> the pins whose deadline passed, removed
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import unquote

from app.errors import NotFound
from engine.keys import KEY_VERSION, ObjectKey
from engine.tenants.quota import L1

ChunkId = tuple[str, str, bytes]
"""(model, cache_salt, chunk hash): what a pin holds, in every namespace of the model."""


@dataclass(frozen=True, slots=True)
class Pin:
    id: str
    salt: str
    model: str
    hashes: tuple[bytes, ...]
    """Chain hashes of the prefix's full chunks, first chunk first."""
    tiers: tuple[str, ...]
    ttl_s: int | None
    created_at: float
    """Wall-clock seconds (for answers)."""
    expires_at: float | None
    """Wall-clock seconds (for answers); None: until deleted."""
    deadline: float | None
    """On the table's clock (monotonic): the pin is released once it has passed."""
    chunk_bytes: dict[str, int]
    """Per tier: bytes one chunk of the prefix takes there, over the model's namespaces when the pin
    was made, as PinService counts them (at most pins.max_namespaces; L1: aligned arena bytes; an
    adapter: payload bytes)."""

    @property
    def chunks(self) -> int:
        return len(self.hashes)


class PinTable:
    def __init__(self) -> None:
        self._pins: dict[tuple[str, str], Pin] = {}
        self._held: dict[str, dict[ChunkId, int]] = {}

    def __len__(self) -> int:
        return len(self._pins)

    # --- reads ---------------------------------------------------------------------------------

    def has(self, salt: str, pin_id: str) -> bool:
        return (salt, pin_id) in self._pins

    def get(self, salt: str, pin_id: str) -> Pin:
        pin = self._pins.get((salt, pin_id))
        if pin is None:
            raise NotFound(f"no pin {pin_id!r} for this tenant")
        return pin

    def pins(self, salt: str | None = None) -> list[Pin]:
        """Every pin (of `salt` only, when given), by tenant, then creation."""
        found = [p for p in self._pins.values() if salt is None or p.salt == salt]
        return sorted(found, key=lambda p: (p.salt, p.created_at, p.id))

    def holds(self, tier: str, model: str, salt: str, chunk_hash: bytes) -> bool:
        held = self._held.get(tier)
        return held is not None and (model, salt, chunk_hash) in held

    def kept_in_l1(self, key: ObjectKey) -> bool:
        held = self._held.get(L1)
        return held is not None and (key.namespace.model, key.salt, key.chunk_hash) in held

    def kept_in(self, tier: str) -> Callable[[str], bool]:
        """A predicate over serialized keys (storage/base.py `Kept`) for the adapter `tier`."""

        def kept(key: str) -> bool:
            held = self._held.get(tier)
            if not held:
                return False
            found = _chunk_id(key)
            return found is not None and found in held

        return kept

    def held_chunks(self, tier: str, salt: str | None = None) -> dict[str, set[bytes]]:
        """Per model, the chunk hashes pins hold in `tier` (of `salt`, when given)."""
        out: dict[str, set[bytes]] = {}
        for model, owner, chunk_hash in self._held.get(tier, {}):
            if salt is None or owner == salt:
                out.setdefault(model, set()).add(chunk_hash)
        return out

    # --- changes -------------------------------------------------------------------------------

    def put(self, pin: Pin) -> Pin | None:
        """Add `pin`, or replace the pin of the same tenant and id (its tiers and deadline)."""
        previous = self._pins.pop((pin.salt, pin.id), None)
        if previous is not None:
            self._count(previous, -1)
        self._pins[pin.salt, pin.id] = pin
        self._count(pin, +1)
        return previous

    def remove(self, salt: str, pin_id: str) -> Pin:
        pin = self._pins.pop((salt, pin_id), None)
        if pin is None:
            raise NotFound(f"no pin {pin_id!r} for this tenant")
        self._count(pin, -1)
        return pin

    def remove_tenant(self, salt: str) -> list[Pin]:
        gone = [p for p in self._pins.values() if p.salt == salt]
        for pin in gone:
            self.remove(pin.salt, pin.id)
        return gone

    def expire(self, now: float) -> list[Pin]:
        """Release the pins whose deadline is `now` or earlier; returns them."""
        gone = [p for p in self._pins.values() if p.deadline is not None and p.deadline <= now]
        for pin in gone:
            self.remove(pin.salt, pin.id)
        return gone

    def restore(self, pins: Iterable[Pin]) -> None:
        for pin in pins:
            self.put(pin)

    # --- internals -----------------------------------------------------------------------------

    def _count(self, pin: Pin, delta: int) -> None:
        for tier in pin.tiers:
            held = self._held.setdefault(tier, {})
            for chunk_hash in pin.hashes:
                chunk = (pin.model, pin.salt, chunk_hash)
                left = held.get(chunk, 0) + delta
                if left > 0:
                    held[chunk] = left
                else:
                    held.pop(chunk, None)
            if not held:
                del self._held[tier]


def _chunk_id(serialized: str) -> ChunkId | None:
    """(model, salt, chunk hash) of a serialized ObjectKey (engine/keys.py), without building the
    key; None for a string that is not one."""
    parts = serialized.split("/")
    if len(parts) != 7 or parts[0] != KEY_VERSION:
        return None
    model, salt, chunk = parts[1], parts[5], parts[6]
    if not (model.startswith("m=") and salt.startswith("s=") and chunk.startswith("h=")):
        return None
    try:
        chunk_hash = bytes.fromhex(chunk[2:])
    except ValueError:
        return None
    return unquote(model[2:]), unquote(salt[2:]), chunk_hash
