"""DataPlaneServer: what the engine-side clients ask over the data plane and how it is answered,
on the sidecar's event loop.

State: the transport (api/dataplane/transport.py: the ROUTER socket, its reader, the tasks sending
deferred replies) and the sessions (api/dataplane/sessions.py: routing id -> session, made by
HELLO). Cache state lives in the engine facade; handlers are short synchronous calls into it, run
inline in arrival order: a COMMIT's reply goes once the objects are visible to every LOOKUP.

Every frame is decoded against the protocol's tagged union with bounds on every field; anything that
fails (garbage, unknown op, wrong types, absurd sizes) gets an ErrorReply and changes nothing; it is
made in one place, `_error`: the error's class gives its wire code (api/dataplane/errors.py) and
the error counter counts it. An unexpected exception in a handler is logged and answered with code
`internal`; the loop goes on. A handler that has to wait returns an awaitable, answered later (by
the transport, from a task); its latency is observed and its log context bound until it is done.

Identity: every connection says HELLO first (anything else before it: `hello_required`); its
session names the engine instance it acts for. A message naming an engine id of another instance
is refused with `not_owner` before its handler runs; reservations are checked by the facade. CLEAR
of every tenant is refused (`unauthorized`: an administrator's act; api/dataplane/clear.py).
The HELLO reply hands the session its lifeline token (api/dataplane/sessions.py): a session whose
lifeline closed is gone, and takes its reservations with it (`engine.end_holder`); the last session
of an instance takes the instance's read locks and registrations (`engine.end_instance`). Until its
lifeline is held (the process proved it is alive and mapped the arena from the descriptor the
lifeline brought) a session may not register, reserve, commit or have the sidecar copy
(`_NEEDS_LIFELINE`: `unauthorized`), and one not held within the lifeline handshake timeout
expires (checked on every frame), its instance with it when it was the instance's last session.

The read path (LOOKUP, QUERY_PREFETCH, RETRIEVE, RELEASE, FREE_LOOKUP_LOCKS, END_REQUEST) is
answered by `reads` (api/dataplane/reads.py), which also checks every message's token bytes.

The sidecar's own KV copies (REGISTER_KV_CACHE, LOAD_BLOCKS, SAVE_BLOCKS) are answered by
`copies` (api/dataplane/copies.py: the transfers given built, or made when first needed, so that a
sidecar no engine asks to copy never imports torch); `prepare_transfers` starts making them early.

Primitives in call order: `bind()` (errors are ConfigError), `serve()` (supervised task), both the
transport's, `handle(frame, peer) -> reply bytes` (what the transport calls for each frame; also
what tests and the fuzzer drive), `stop()`, `close()`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from api.audit import AuditLog
from api.dataplane.clear import clear_tenant
from api.dataplane.copies import SidecarCopies
from api.dataplane.errors import wire_code
from api.dataplane.reads import ReadPath
from api.dataplane.sessions import Session, SessionTable
from api.dataplane.transport import RouterTransport
from api.dataplane.workers import WorkerWatch
from api.lifeline import HANDSHAKE_TIMEOUT_S
from api.metrics import DataPlaneMetrics
from app import __version__
from app.errors import (
    InvalidInput,
    KVDepotError,
    ProtocolError,
    Unauthorized,
    UnsupportedVersion,
)
from engine.events import Kind
from engine.facade import CacheEngine
from engine.keys import KVLayout
from engine.results import SlotStatus
from engine.workers import WorkerRegistry
from kvdepot_connector import protocol as p

if TYPE_CHECKING:
    from engine.transfers import KVTransfers

log = structlog.get_logger("kvdepot.dataplane")

_TAGS: dict[type, str] = {cls: cls.__struct_config__.tag for cls in p.Request.__args__}
#: what only a session held by its lifeline may ask: a connection that never opened one (so never
#: mapped the arena) must not make unwritten memory look valid, nor register or have copies made
_NEEDS_LIFELINE = (p.Register, p.Store, p.Commit, p.RegisterKVCache, p.LoadBlocks, p.SaveBlocks)
_WIRE_STATUS = {s: p.SlotStatus(s.value) for s in SlotStatus}


class DataPlaneServer:
    def __init__(
        self,
        engine: CacheEngine,
        *,
        url: str,
        max_frame_bytes: int,
        max_tokens: int,
        metrics: DataPlaneMetrics | None = None,
        transfers: KVTransfers | None = None,
        make_transfers: Callable[[], Coroutine[Any, Any, KVTransfers]] | None = None,
        max_sessions: int = 4096,
        session_idle_s: float = 600.0,
        lifeline_path: str = "",
        handshake_s: float = HANDSHAKE_TIMEOUT_S,
        workers: WorkerRegistry | None = None,
        audit: AuditLog | None = None,
    ) -> None:
        """`workers`: the worker registry every HELLO registers into (its `heartbeat_s` is what the
        HELLO reply asks clients for; None: no heartbeats asked). `audit`: where a CLEAR is recorded.
        `handshake_s`: a session not held by its lifeline this long after its HELLO expires."""
        self.engine = engine
        self.audit = audit
        #: START/END around every operation and ERROR for every error reply go to the engine's bus
        self.events = engine.events
        self.copies = SidecarCopies(engine, transfers, make_transfers)
        self.url = url
        self.max_frame_bytes = max_frame_bytes
        self.reads = ReadPath(engine, max_tokens)
        self.metrics = metrics
        self.sessions = SessionTable(
            max_sessions=max_sessions, idle_s=session_idle_s,
            handshake_s=handshake_s if lifeline_path else 0.0,  # without lifelines none is ever held
        )  # fmt: skip
        # A session that is gone takes its reservations with it; an instance, its locks and engines.
        self.sessions.on_session_closed.append(lambda s: engine.end_holder(s.id))
        self.sessions.on_instance_gone.append(engine.end_instance)
        self.lifeline_path = lifeline_path
        self.workers = None if workers is None else WorkerWatch(engine, self.sessions, workers)
        self.transport = RouterTransport(
            url=url, max_frame_bytes=max_frame_bytes, handle=self.handle,
            malformed=lambda: self._error(-1, "malformed", ProtocolError("expected exactly one frame")),
        )  # fmt: skip
        self._handlers = self._handler_table()

    def _handler_table(self) -> dict[type, Callable[[Any, Session], p.Reply | Awaitable[p.Reply]]]:
        """Each message type and the method that answers it."""
        return {
            p.Register: self._register,
            p.Lookup: self.reads.lookup,
            p.QueryPrefetch: self.reads.query_prefetch,
            p.Retrieve: self.reads.retrieve,
            p.Release: self.reads.release,
            p.Store: self._store,
            p.Commit: self._commit,
            p.Abort: self._abort,
            p.FreeLookupLocks: self.reads.free_lookup_locks,
            p.EndRequest: self.reads.end_request,
            p.Ping: self._ping,
            p.Clear: self._clear,
            p.RegisterKVCache: self._register_kv_cache,
            p.LoadBlocks: self._load_blocks,
            p.SaveBlocks: self._save_blocks,
        }

    # --- lifecycle -----------------------------------------------------------------------------

    def bind(self) -> None:
        self.transport.bind()

    async def serve(self) -> None:
        """Serve until `stop()` (see api/dataplane/transport.py); a socket that fails under it ends
        this task with the error, so the supervisor marks the data plane dead."""
        await self.transport.serve()

    @property
    def running(self) -> bool:
        return self.transport.running

    def stop(self) -> None:
        """Stop accepting: `serve` returns."""
        self.transport.stop()

    def close(self) -> None:
        self.transport.close()

    # --- dispatch ------------------------------------------------------------------------------

    def handle(self, frame: bytes, peer: bytes = b"") -> bytes | Awaitable[bytes]:
        """The reply to one frame from connection `peer` (its routing id); an awaitable when the
        answer has to wait (LOOKUP with wait, LOAD_BLOCKS, SAVE_BLOCKS). Latency is observed, and
        the operation's END published, when the reply is ready, awaited or not."""
        start = time.perf_counter()
        op = "malformed"
        rid = -1
        pending: Awaitable[p.Reply] | None = None
        events = self.events
        span = 0
        request_id = ""
        outcome = "ok"
        try:
            if len(frame) > self.max_frame_bytes:
                raise InvalidInput(f"frame of {len(frame)} bytes exceeds {self.max_frame_bytes}")
            try:
                msg = p.request_decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                rid = p.salvage_id(frame)
                raise ProtocolError(str(exc)[:300]) from None
            rid = msg.id
            op = _TAGS[type(msg)]
            if events.enabled:
                request_id = getattr(msg, "request_id", "")
                span = events.start(op, request_id, trace=getattr(msg, "traceparent", ""))
            with structlog.contextvars.bound_contextvars(op=op, rid=rid):
                if isinstance(msg, p.Hello):
                    return p.encode(self._hello(msg, peer))
                now = time.monotonic()
                self.sessions.expire(now)
                session = self.sessions.get(peer, now)
                if not session.held and isinstance(msg, _NEEDS_LIFELINE):
                    raise Unauthorized(
                        f"{op} needs this connection's lifeline: connect it with the token of the HELLO "
                        "reply first (the connector does, right after HELLO)"
                    )
                engine_id = getattr(msg, "engine_id", None)
                if engine_id is not None:
                    self.engine.owned(engine_id, session.instance)
                reply = self._handlers[type(msg)](msg, session)
            if isinstance(reply, msgspec.Struct):
                return p.encode(reply)
            pending = reply
            return self._finish_later(rid, op, pending, start, span=span, request_id=request_id)
        except Exception as exc:
            outcome = _code(exc).value
            return self._error(rid, op, exc, request_id)
        finally:
            if pending is None:
                if self.metrics is not None:
                    self.metrics.observe(op, time.perf_counter() - start)
                if span:
                    events.end(span, op, request_id, reason=outcome)

    async def _finish_later(
        self, rid: int, op: str, pending: Awaitable[p.Reply], start: float, *, span: int, request_id: str
    ) -> bytes:
        """The awaited part of a handler, under the same log context, timed from the frame's arrival."""
        outcome = "ok"
        try:
            with structlog.contextvars.bound_contextvars(op=op, rid=rid):
                return p.encode(await pending)
        except Exception as exc:
            outcome = _code(exc).value
            return self._error(rid, op, exc, request_id)
        finally:
            if self.metrics is not None:
                self.metrics.observe(op, time.perf_counter() - start)
            if span:
                self.events.end(span, op, request_id, reason=outcome)

    def _error(self, rid: int, op: str, exc: Exception, request_id: str = "") -> bytes:
        """The one way an error becomes a reply: the class's data-plane code, counted (and published
        as an ERROR event). Anything but a KVDepotError is a bug: logged, answered with `internal`,
        and the loop goes on."""
        code = _code(exc)
        if isinstance(exc, KVDepotError):
            message, retryable = exc.message, exc.retryable
        else:
            log.error("dataplane_handler_failed", op=op, exc_info=exc)
            message, retryable = f"{type(exc).__name__}: {exc}"[:300], False
        if self.metrics is not None:
            self.metrics.error(op, code)
        events = self.events
        if events.enabled:
            events.emit(Kind.ERROR, op=op, request_id=request_id, reason=code.value)
        return p.encode(p.ErrorReply(id=rid, code=code.value, message=message, retryable=retryable))

    # --- handlers ------------------------------------------------------------------------------

    def _hello(self, m: p.Hello, peer: bytes) -> p.Reply:
        if m.version != p.PROTOCOL_VERSION:
            raise UnsupportedVersion(
                f"protocol version mismatch: the sidecar speaks {p.PROTOCOL_VERSION}, "
                f"the client {m.version}; upgrade the older side"
            )
        session = self.sessions.hello(peer, m.instance, time.monotonic())
        if self.workers is not None:
            self.workers.hello(session, m.role, m.rank)
        arena = self.engine.arena
        return p.HelloReply(
            id=m.id, version=p.PROTOCOL_VERSION, server=f"kvdepot/{__version__}",
            chunk_size=self.engine.chunk_size, arena_name=arena.name, arena_size=arena.size,
            max_frame_bytes=self.max_frame_bytes, session=session.id, lifeline_path=self.lifeline_path,
            lifeline_token=session.token if self.lifeline_path else b"",
            heartbeat_s=self.workers.registry.heartbeat_s if self.workers and self.lifeline_path else 0.0,
        )  # fmt: skip

    def _register(self, m: p.Register, s: Session) -> p.Reply:
        lay = m.layout
        try:
            layout = KVLayout(
                dtype=lay.dtype, num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
                head_dim=lay.head_dim, block_size=lay.block_size, kind=lay.kind, chunk_size=lay.chunk_size,
            )  # fmt: skip
        except ValueError as exc:
            raise InvalidInput(f"layout: {exc}") from None
        reg = self.engine.register(m.model, layout, m.kv_rank, m.group, instance=s.instance)
        log.info(
            "engine_registered",
            engine_id=reg.engine_id,
            session=s.id,
            model=m.model,
            kv_rank=m.kv_rank,
            layout=lay.kind,
            chunk_bytes=reg.chunk_bytes,
        )
        return p.RegisterReply(
            id=m.id,
            engine_id=reg.engine_id,
            chunk_bytes=reg.chunk_bytes,
            layout_fingerprint=layout.fingerprint,
        )

    def _store(self, m: p.Store, s: Session) -> p.Reply:
        slots = self.engine.store(
            m.engine_id, m.request_id, self.reads.tokens(m.tokens), m.cache_salt, m.first_chunk, holder=s.id,
            extras=m.extra_keys, prompt_tokens=m.prompt_tokens, lora_name=m.lora_name,
        )  # fmt: skip
        return p.StoreReply(
            id=m.id,
            slots=[p.Slot(s.chunk, _WIRE_STATUS[s.status], s.oid, s.offset, s.size) for s in slots],
        )

    def _commit(self, m: p.Commit, s: Session) -> p.Reply:
        return p.CommitReply(id=m.id, ok=self.engine.commit(m.engine_id, m.oids, holder=s.id))

    def _abort(self, m: p.Abort, s: Session) -> p.Reply:
        return p.CountReply(id=m.id, count=self.engine.abort(m.engine_id, m.oids, holder=s.id))

    def _ping(self, m: p.Ping, _: Session) -> p.Reply:
        return p.Pong(id=m.id, server_time=time.time())

    def _clear(self, m: p.Clear, s: Session) -> p.Reply:
        return clear_tenant(self.engine, self.audit, s.instance, m)

    # --- copies done by the sidecar (engines that share their KV cache): api/dataplane/copies.py

    @property
    def transfers(self) -> KVTransfers | None:
        return self.copies.transfers

    def prepare_transfers(self) -> None:
        """See SidecarCopies.prepare: an engine shared memory, its REGISTER_KV_CACHE is coming."""
        self.copies.prepare()

    def _register_kv_cache(self, m: p.RegisterKVCache, _: Session) -> p.Reply | Awaitable[p.Reply]:
        return self.copies.register(m)

    async def _load_blocks(self, m: p.LoadBlocks, _: Session) -> p.Reply:
        return await self.copies.load(m)

    async def _save_blocks(self, m: p.SaveBlocks, _: Session) -> p.Reply:
        return await self.copies.save(m, self.reads.tokens(m.tokens))


def _code(exc: Exception) -> p.ErrorCode:
    return wire_code(exc) if isinstance(exc, KVDepotError) else p.ErrorCode.INTERNAL
