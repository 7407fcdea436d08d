"""EngineRegistry: the engines registered on the data plane, each a namespace of cache keys.

State: engine id -> Registration, and the identity (model, layout fingerprint, kv rank, group) ->
engine id. Owned by the event loop. Ids are random per process: an id from before a restart is
unknown here, so a client that reconnects must register again (and re-map the new arena) before
touching offsets.

Primitives in call order:
  register(model, layout, kv_rank, group)  -> Registration (idempotent per identity); InvalidInput
                                              for a bad model id, chunk size, rank or a chunk larger
                                              than L1
  get(engine_id)                           -> Registration; NotRegistered for an unknown id
  all()                                    the registrations (for /status)
"""

from __future__ import annotations

import secrets

from app.errors import InvalidInput, NotRegistered
from engine.keys import KVLayout, Namespace
from engine.results import Registration

MAX_ID_LEN = 256


class EngineRegistry:
    def __init__(self, *, chunk_size: int, capacity: int) -> None:
        self.chunk_size = chunk_size
        self.capacity = capacity
        self._registrations: dict[int, Registration] = {}
        self._by_identity: dict[Namespace, int] = {}

    def register(self, model: str, layout: KVLayout, kv_rank: int = 0, group: int = 0) -> Registration:
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
        engine_id = self._by_identity.get(ns)
        if engine_id is None:
            engine_id = secrets.randbelow((1 << 31) - 1) + 1
            while engine_id in self._registrations:
                engine_id = secrets.randbelow((1 << 31) - 1) + 1
            self._registrations[engine_id] = Registration(engine_id, ns, layout, layout.chunk_bytes)
            self._by_identity[ns] = engine_id
        return self._registrations[engine_id]

    def get(self, engine_id: int) -> Registration:
        reg = self._registrations.get(engine_id)
        if reg is None:
            raise NotRegistered(f"engine {engine_id} is not registered (REGISTER first)")
        return reg

    def all(self) -> list[Registration]:
        return list(self._registrations.values())
