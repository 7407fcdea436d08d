"""EngineRegistry: the engines registered on the data plane, each a namespace of cache keys,
owned by the engine instance that registered it.

State: engine id -> Registration (in least recently used order, with when each was last used),
and (instance, namespace) -> engine id. Owned by the event loop. Ids are random per process: an
id from before a restart is unknown here, so a client that reconnects must register again (and
re-map the new arena) before touching offsets.

Ownership: an engine id belongs to the instance (the nonce an engine's processes share, see the
protocol) that registered it. Two instances registering the same model get different engine ids,
so their requests, locks and KV planes never mix, but the same namespace: the instance is not
part of any cache key, and both hit what either stored.

Bounds: at most `max_per_instance` registrations per instance and `max_total` in all. When the
table is full, the least recently used registration idle for `idle_s` is dropped (its instance,
if still alive, is told `not_registered` and registers again; `on_drop` lets the KV planes go);
otherwise the registration is refused (Overloaded).

Primitives in call order:
  register(model, layout, kv_rank, group, instance) -> Registration (idempotent per instance and
                                              identity); InvalidInput for a bad model id, chunk
                                              size, rank or a chunk larger than L1; Overloaded
  get(engine_id[, now])                    -> Registration; NotRegistered for an unknown id
  all()                                    the registrations (for /status)
  drop_instance(instance)                  -> engine ids of the instance, dropped (it is gone)
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable

from app.errors import InvalidInput, NotRegistered, Overloaded
from engine.keys import KVLayout, Namespace
from engine.results import Registration

MAX_ID_LEN = 256


#: layouts remembered after their registrations went (`layout`)
LAYOUTS_KEPT = 1024


class EngineRegistry:
    def __init__(
        self,
        *,
        chunk_size: int,
        capacity: int,
        max_total: int = 1024,
        max_per_instance: int = 64,
        idle_s: float = 600.0,
    ) -> None:
        self.chunk_size = chunk_size
        self.capacity = capacity
        self.max_total = max_total
        self.max_per_instance = max_per_instance
        self.idle_s = idle_s
        #: called with the engine id of a registration dropped to make room
        self.on_drop: list[Callable[[int], None]] = []
        self._registrations: OrderedDict[int, Registration] = OrderedDict()
        self._last_used: dict[int, float] = {}
        self._by_identity: dict[tuple[str, Namespace], int] = {}
        self._per_instance: dict[str, int] = {}
        #: every layout registered since the start, by fingerprint (the most recent LAYOUTS_KEPT):
        #: events about a chunk outlive its engine's registration and still need its block size
        self._layouts: OrderedDict[bytes, KVLayout] = OrderedDict()
        #: every namespace registered since the start (the most recent LAYOUTS_KEPT), with its
        #: layout: what the sidecar tells a fleet directory it may hold
        self.namespaces_seen: OrderedDict[Namespace, KVLayout] = OrderedDict()

    def __len__(self) -> int:
        return len(self._registrations)

    def register(
        self, model: str, layout: KVLayout, kv_rank: int = 0, group: int = 0, *, instance: str = "",
        now: float = 0.0,
    ) -> Registration:  # fmt: skip
        if not model or len(model) > MAX_ID_LEN:
            raise InvalidInput(f"model id must be 1..{MAX_ID_LEN} characters")
        if layout.chunk_size != self.chunk_size:
            raise InvalidInput(
                f"chunk size mismatch: the sidecar uses {self.chunk_size} tokens per chunk, "
                f"the engine asked for {layout.chunk_size} (set l1.chunk_size or the connector's chunk_size)"
            )
        if not 0 <= kv_rank < 1 << 16 or not 0 <= group < 1 << 10:
            raise InvalidInput("kv_rank must be in 0..65535 and group in 0..1023")
        if layout.chunk_bytes > self.capacity:
            raise InvalidInput(
                f"one chunk ({layout.chunk_bytes} bytes) is larger than L1 ({self.capacity} bytes)"
            )
        ns = Namespace(model=model, layout_fp=layout.fingerprint, kv_rank=kv_rank, group=group)
        engine_id = self._by_identity.get((instance, ns))
        if engine_id is not None:
            return self.get(engine_id, now)
        if self._per_instance.get(instance, 0) >= self.max_per_instance:
            raise Overloaded(
                f"this engine instance has {self.max_per_instance} registrations "
                "(data_plane.max_registrations_per_instance)"
            )
        if len(self._registrations) >= self.max_total and not self._drop_idle(now):
            raise Overloaded(
                f"{self.max_total} engines are registered and none is idle (data_plane.max_registrations)"
            )
        engine_id = secrets.randbelow((1 << 31) - 1) + 1
        while engine_id in self._registrations:
            engine_id = secrets.randbelow((1 << 31) - 1) + 1
        reg = Registration(engine_id, ns, layout, layout.chunk_bytes, instance)
        self._layouts[layout.fingerprint] = layout
        self._layouts.move_to_end(layout.fingerprint)
        if len(self._layouts) > LAYOUTS_KEPT:
            self._layouts.popitem(last=False)
        self.namespaces_seen[ns] = layout
        self.namespaces_seen.move_to_end(ns)
        if len(self.namespaces_seen) > LAYOUTS_KEPT:
            self.namespaces_seen.popitem(last=False)
        self._registrations[engine_id] = reg
        self._last_used[engine_id] = now
        self._by_identity[(instance, ns)] = engine_id
        self._per_instance[instance] = self._per_instance.get(instance, 0) + 1
        return reg

    def get(self, engine_id: int, now: float | None = None) -> Registration:
        """The registration; `now` given: it counts as used (it will not be dropped as idle)."""
        reg = self._registrations.get(engine_id)
        if reg is None:
            raise NotRegistered(f"engine {engine_id} is not registered (REGISTER first)")
        if now is not None:
            self._registrations.move_to_end(engine_id)
            self._last_used[engine_id] = now
        return reg

    def layout(self, fingerprint: bytes) -> KVLayout | None:
        """A layout registered since the start (its registration may be gone), by fingerprint."""
        return self._layouts.get(fingerprint)

    def all(self) -> list[Registration]:
        return list(self._registrations.values())

    def drop_instance(self, instance: str) -> list[int]:
        """Drop every registration of `instance` (its processes are gone); `on_drop` runs for
        each. Returns their engine ids."""
        ids = [engine_id for engine_id, reg in self._registrations.items() if reg.instance == instance]
        for engine_id in ids:
            self._drop(engine_id)
        return ids

    def _drop_idle(self, now: float) -> bool:
        """Drop the least recently used registration if it was idle for `idle_s`."""
        engine_id = next(iter(self._registrations))
        if now - self._last_used[engine_id] < self.idle_s:
            return False
        self._drop(engine_id)
        return True

    def _drop(self, engine_id: int) -> None:
        reg = self._registrations.pop(engine_id)
        del self._last_used[engine_id]
        del self._by_identity[(reg.instance, reg.namespace)]
        left = self._per_instance[reg.instance] - 1
        if left:
            self._per_instance[reg.instance] = left
        else:
            del self._per_instance[reg.instance]
        for hook in self.on_drop:
            hook(engine_id)
