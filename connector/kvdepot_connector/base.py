"""ClientBase: what both data-plane clients (`client.KVDepotClient`, `aio.AsyncKVDepotClient`)
hold beside their transport: the engine's identity and instance nonce, its `Session`
(kvdepot_connector.session: handshake state, arena mapping, copy steps) and the counters of the
calls sent without waiting.

State: the session and those counters. Touched by one client, under its lock (blocking) or on its
event loop (asyncio).

Primitives: ClientBase(url, model=..., layout=...) (the subclass opens its transport in
`_open_transport`); `_posted_reply(op, reply)`, a late reply to a call sent without waiting, counted.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from kvdepot_connector import protocol as p
from kvdepot_connector.outcomes import late_reply
from kvdepot_connector.session import Session


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
        instance: str | None = None,
        role: p.Role = "",
        rank: int | None = None,
    ) -> None:
        """`instance`: the engine instance nonce (lowercase hex, 16..128 characters) this client
        acts for; the clients of one engine (scheduler, workers) give the same one, since they own
        its requests and reservations together. None: a fresh random one, this client's alone.
        `role` ("scheduler" or "worker") and `rank`: how the sidecar's worker registry names it."""
        self.url = url
        self.timeout_s = timeout_s
        self.name = name
        self.instance = secrets.token_hex(16) if instance is None else instance
        self._session = Session(
            model, layout, kv_rank, group, name=name, map_arena=map_arena, instance=self.instance,
            timeout_s=timeout_s, role=role, rank=rank,
        )  # fmt: skip
        #: sent without waiting: RELEASEs the fences answered, chunks committed (`wait=False`); among
        #: the late replies, errors and chunks refused (write lease expired), counted when read
        self.released_unasked = self.commits_posted = self.posted_errors = self.commits_refused = 0
        self._open_transport()

    def _posted_reply(self, op: str, reply: p.Reply) -> None:
        errors, refused = late_reply(op, reply)
        self.posted_errors += errors
        self.commits_refused += refused

    def _open_transport(self) -> None:
        """The subclass's sockets and locks (nothing connects yet)."""
        raise NotImplementedError

    @property
    def engine_id(self) -> int:
        return self._session.engine_id

    @property
    def kv_rank(self) -> int:
        return self._session.kv_rank

    def share(self, regions: Sequence[tuple[str, int, int]]) -> None:
        """Hand the sidecar sealed memfd regions (name, fd, bytes; e.g. `SharedTensor.region()`)
        over this client's lifeline, so it can copy into and out of them (`register_kv_cache`).
        They stay shared while the engine instance has a live client."""
        self._session.share(regions)

    @property
    def chunk_bytes(self) -> int:
        return self._session.chunk_bytes

    @property
    def chunk_size(self) -> int:
        return self._session.layout.chunk_size
