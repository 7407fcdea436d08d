"""KeyIndex: the L1 objects by key, and by (namespace, salt) then chunk hash for chain lookups.

Role: L1Cache's (engine/l1/cache.py) two indexes of what each key names now: every object not in a
terminal state, from reservation until it is freed, quarantined or replaced. The second index lets
`L1Cache.find_chain` walk a chain of chunk hashes without building an ObjectKey per chunk.

State: key -> object; (namespace, salt) -> chunk hash -> object (the same objects; an empty inner
map is dropped). Owned by the event loop, through L1Cache only.

Primitives in call order: add(obj), get(key) / chain(ns, salt) / values(), forget(obj).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.keys import Namespace, ObjectKey
from engine.l1.lifecycle import L1Object


class KeyIndex:
    def __init__(self) -> None:
        self._objects: dict[ObjectKey, L1Object] = {}
        self._chains: dict[tuple[Namespace, str], dict[bytes, L1Object]] = {}

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: ObjectKey) -> bool:
        return key in self._objects

    def get(self, key: ObjectKey) -> L1Object | None:
        return self._objects.get(key)

    def values(self) -> Iterable[L1Object]:
        """The live view of every indexed object (copy it before changing the cache)."""
        return self._objects.values()

    def chain(self, ns: Namespace, salt: str) -> dict[bytes, L1Object] | None:
        """Chunk hash -> object for one namespace and tenant (None: it holds none)."""
        return self._chains.get((ns, salt))

    def add(self, obj: L1Object) -> None:
        key = obj.key
        self._objects[key] = obj
        self._chains.setdefault((key.namespace, key.salt), {})[key.chunk_hash] = obj

    def forget(self, obj: L1Object) -> None:
        """`obj` is no longer what its key names (both indexes); nothing if it is not."""
        key = obj.key
        if self._objects.get(key) is obj:
            del self._objects[key]
            chain = self._chains[key.namespace, key.salt]
            del chain[key.chunk_hash]
            if not chain:
                del self._chains[key.namespace, key.salt]
