"""The data plane's read path: LOOKUP, QUERY_PREFETCH, RETRIEVE, RELEASE and the calls that drop a
request's read locks, answered from the engine facade on the sidecar's event loop.

State: none of its own (the facade holds the requests' read locks). Called by DataPlaneServer's
dispatch after the session and the engine id's owner were checked.

Primitives: `ReadPath(engine, max_tokens)`, then one method per message: lookup (an awaitable when
it waits for a prefetch; asked, its reply also carries what a RETRIEVE of its hits would),
query_prefetch, retrieve, release, free_lookup_locks, end_request;
`tokens(data)`, the token bytes of a request checked (the store path uses it too).
"""

from __future__ import annotations

from collections.abc import Awaitable

from api.dataplane.sessions import Session
from app.errors import InvalidInput
from engine.facade import CacheEngine
from engine.results import LookupResult
from kvdepot_connector import protocol as p


class ReadPath:
    def __init__(self, engine: CacheEngine, max_tokens: int) -> None:
        self.engine = engine
        self.max_token_bytes = max_tokens * p.TOKEN_BYTES

    def tokens(self, data: bytes) -> bytes:
        if len(data) % p.TOKEN_BYTES:
            raise InvalidInput(
                f"tokens must be uint32 little-endian: {len(data)} bytes is not a multiple of 4"
            )
        if len(data) > self.max_token_bytes:
            raise InvalidInput(
                f"{len(data) // p.TOKEN_BYTES} tokens exceed data_plane.max_tokens="
                f"{self.max_token_bytes // p.TOKEN_BYTES}"
            )
        return data

    def lookup(self, m: p.Lookup, s: Session) -> p.Reply | Awaitable[p.Reply]:
        engine = self.engine
        if m.uncacheable is not None:
            engine.registration(m.engine_id)  # only a registered engine is counted
            engine.note_uncacheable(m.uncacheable.value)
            total = len(self.tokens(m.tokens)) // (p.TOKEN_BYTES * engine.chunk_size)
            return p.LookupReply(id=m.id, hit_tokens=0, hit_chunks=0, total_chunks=total)
        tokens = self.tokens(m.tokens)
        r = engine.lookup(m.engine_id, m.request_id, tokens, m.cache_salt, m.extra_keys, holder=s.id)
        if m.wait and r.pending_chunks:
            return self._lookup_when_loaded(m, s)
        return self._located(m, s, lookup_reply(m.id, r))

    async def _lookup_when_loaded(self, m: p.Lookup, s: Session) -> p.Reply:
        r = await self.engine.wait_prefetch(m.engine_id, m.request_id)
        return self._located(m, s, lookup_reply(m.id, r))

    def _located(self, m: p.Lookup | p.QueryPrefetch, s: Session, reply: p.LookupReply) -> p.LookupReply:
        """The reply, naming the locked chunks as a RETRIEVE of them all would when `m.extents`
        asks and none is still coming from L2."""
        if not m.extents or not reply.hit_chunks or reply.pending_chunks:
            return reply
        located = self.retrieve(p.Retrieve(id=m.id, engine_id=m.engine_id, request_id=m.request_id,
                                           num_chunks=reply.hit_chunks), s)  # fmt: skip
        reply.extents, reply.fences, reply.epoch = located.extents, located.fences, located.epoch
        reply.arena = self.engine.arena.name
        return reply

    def query_prefetch(self, m: p.QueryPrefetch, s: Session) -> p.Reply:
        return self._located(m, s, lookup_reply(m.id, self.engine.query_prefetch(m.engine_id, m.request_id)))

    def retrieve(self, m: p.Retrieve, s: Session) -> p.RetrieveReply:
        engine = self.engine
        extents = engine.retrieve(m.engine_id, m.request_id, m.first_chunk, m.num_chunks, holder=s.id)
        fences = [p.Fence(i, word) for i, word in engine.fence_words(extents)]
        epoch = engine.lock_epoch(m.engine_id, m.request_id)
        return p.RetrieveReply(id=m.id, extents=[p.Extent(*e) for e in extents], fences=fences, epoch=epoch)

    def release(self, m: p.Release, s: Session) -> p.Reply:
        valid = self.engine.release(m.engine_id, m.request_id, m.oids, holder=s.id, epoch=m.epoch)
        return p.ReleaseReply(id=m.id, valid=valid)

    def free_lookup_locks(self, m: p.FreeLookupLocks, _: Session) -> p.Reply:
        return p.CountReply(id=m.id, count=self.engine.free_lookup_locks(m.engine_id, m.request_id))

    def end_request(self, m: p.EndRequest, _: Session) -> p.Reply:
        return p.CountReply(id=m.id, count=self.engine.end_request(m.engine_id, m.request_id))


def lookup_reply(rid: int, r: LookupResult) -> p.LookupReply:
    return p.LookupReply(
        id=rid, hit_tokens=r.hit_tokens, hit_chunks=r.hit_chunks, total_chunks=r.total_chunks,
        pending_chunks=r.pending_chunks,
    )  # fmt: skip
