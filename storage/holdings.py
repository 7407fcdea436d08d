"""Holdings: what one L2 adapter holds, key -> (value, size), in recency order overall and per
tenant, and the one place where every change of it is reported to the owner's accounting hook.

Role: each adapter keeps its index here (disk: key -> file path; mock: key -> blob bytes; redis:
the keys it wrote, no value), so what the owner is told cannot drift from what the adapter holds:
every put, pop and clear reports (key, delta_bytes, delta_objects, evicted) to the hook before it
returns. Putting a key that is held reports the size difference and no new object.

Keys are opaque strings. The owner says which tenant a key belongs to (`salt_of`) when it binds
its hook, so that `oldest(salt, nbytes)` lists one tenant's keys without a scan. Unbound (storage
used on its own), every key belongs to the tenant "" and nothing is reported.

State (event loop only): the entries in recency order (least recently used first), the same
entries per tenant in the same order, the bytes held, the tenant function and the hook.

Primitives in call order:
  bind(salt_of, hook) / unbind()   attach the owner's accounting, once (what is held already is
                                   reported at once) / detach it (later changes are not reported)
  put(key, value, size)            add or replace, as the most recently used -> the previous entry
  get(key) / entry(key) / touch(key)
  oldest(salt, nbytes[, kept])     the tenant's (None: anyone's) least recently used keys, enough
                                   to free `nbytes`, skipping those `kept` says are held by a pin
  pop(key, evicted) / discard(key, entry, evicted) / pop_oldest() / clear()

Pins (engine/pins/): an adapter that honours them is given a `Kept` predicate (a key held by a pin
of this tier) and passes it to `oldest`, so eviction for capacity or quota never picks such a key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from storage.base import HoldingsHook, Kept, SaltOf

V = TypeVar("V")


def _one_tenant(key: str) -> str:
    del key
    return ""


@dataclass(eq=False, slots=True)
class Held(Generic[V]):
    value: V
    size: int
    salt: str


class Holdings(Generic[V]):
    def __init__(self) -> None:
        self._entries: OrderedDict[str, Held[V]] = OrderedDict()
        self._by_salt: dict[str, OrderedDict[str, Held[V]]] = {}
        self._salt_of: SaltOf = _one_tenant
        self._hook: HoldingsHook | None = None
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        """Keys, least recently used first. Nothing may be put or popped meanwhile."""
        return iter(self._entries)

    def keys(self) -> list[str]:
        """Keys, least recently used first."""
        return list(self._entries)

    def per_salt(self) -> dict[str, tuple[int, int]]:
        """Per tenant: (bytes, objects). A scan, for tests and checks."""
        out: dict[str, tuple[int, int]] = {}
        for salt, entries in self._by_salt.items():
            out[salt] = (sum(h.size for h in entries.values()), len(entries))
        return out

    # --- accounting ----------------------------------------------------------------------------

    def bind(self, salt_of: SaltOf, hook: HoldingsHook) -> None:
        self._salt_of = salt_of
        by_salt: dict[str, OrderedDict[str, Held[V]]] = {}
        for key, held in self._entries.items():
            held.salt = salt_of(key)
            by_salt.setdefault(held.salt, OrderedDict())[key] = held
        self._by_salt = by_salt
        self._hook = hook
        for key, held in self._entries.items():
            hook(key, held.size, 1, False)

    def unbind(self) -> None:
        self._hook = None

    def _report(self, key: str, delta_bytes: int, delta_objects: int, evicted: bool) -> None:
        if self._hook is not None and (delta_bytes or delta_objects):
            self._hook(key, delta_bytes, delta_objects, evicted)

    # --- reads ---------------------------------------------------------------------------------

    def entry(self, key: str) -> Held[V] | None:
        return self._entries.get(key)

    def get(self, key: str) -> V | None:
        held = self._entries.get(key)
        return None if held is None else held.value

    def touch(self, key: str) -> None:
        """`key` was used: it becomes the most recently used (of all, and of its tenant)."""
        held = self._entries.get(key)
        if held is not None:
            self._entries.move_to_end(key)
            self._by_salt[held.salt].move_to_end(key)

    def oldest(self, salt: str | None, nbytes: int, kept: Kept | None = None) -> list[str]:
        """`salt`'s (None: any tenant's) least recently used keys whose sizes add up to `nbytes`
        (all of them if less), leaving out the keys `kept` holds (pinned). Those it passed over
        become the most recently used: they do not sit at the head of every later scan."""
        out: list[str] = []
        passed: list[str] = []
        freed = 0
        source = self._entries if salt is None else self._by_salt.get(salt, OrderedDict())
        for key, held in source.items():
            if freed >= nbytes:
                break
            if kept is not None and kept(key):
                passed.append(key)
                continue
            out.append(key)
            freed += held.size
        for key in passed:
            self.touch(key)
        return out

    # --- changes -------------------------------------------------------------------------------

    def put(self, key: str, value: V, size: int) -> Held[V] | None:
        """Hold `key` (replacing what was held under it) as the most recently used."""
        previous = self._unlink(key)
        salt = previous.salt if previous is not None else self._salt_of(key)
        self._link(key, Held(value, size, salt))
        if previous is None:
            self._report(key, size, 1, False)
        else:
            self._report(key, size - previous.size, 0, False)
        return previous

    def pop(self, key: str, *, evicted: bool = False) -> Held[V] | None:
        held = self._unlink(key)
        if held is not None:
            self._report(key, -held.size, -1, evicted)
        return held

    def discard(self, key: str, held: Held[V], *, evicted: bool = False) -> bool:
        """Pop `key` if `held` is still its entry (not replaced by a newer write meanwhile)."""
        if self._entries.get(key) is not held:
            return False
        self.pop(key, evicted=evicted)
        return True

    def pop_oldest(self) -> tuple[str, Held[V]] | None:
        """Evict the least recently used key of any tenant."""
        if not self._entries:
            return None
        key = next(iter(self._entries))
        held = self.pop(key, evicted=True)
        assert held is not None
        return key, held

    def clear(self) -> None:
        for key in list(self._entries):
            self.pop(key)

    # --- internals -----------------------------------------------------------------------------

    def _link(self, key: str, held: Held[V]) -> None:
        self._entries[key] = held
        self._by_salt.setdefault(held.salt, OrderedDict())[key] = held
        self.bytes += held.size

    def _unlink(self, key: str) -> Held[V] | None:
        held = self._entries.pop(key, None)
        if held is None:
            return None
        per_salt = self._by_salt[held.salt]
        del per_salt[key]
        if not per_salt:
            del self._by_salt[held.salt]
        self.bytes -= held.size
        return held
