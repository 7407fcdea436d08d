"""KvEventPublisher: the EventBus subscriber that publishes KV events on ZMQ in vLLM's format.

Every batch the bus dispatcher hands over becomes one or more `KVEventBatch` messages (at most
`max_batch_events` events each, one model per message, since the topic names it): frames
(topic, 8-byte big-endian sequence number, msgpack batch), the sequence counting from 0 at each start
as vLLM's `ZmqEventPublisher` does (the incarnation id is in the inventory and heartbeats: wire.py).

Sending never blocks the loop: an XPUB socket with XPUB_NODROP answers EAGAIN when a subscriber's
queue (`sndhwm`) is full, and that batch is dropped for the live stream and counted; it stays in the
replay buffer, so a subscriber that sees a gap in the sequence asks the replay socket for it.

Budgets (guard.py): both sockets are read at most READ_BUDGET messages per reader callback (then
the loop gets a turn and the reading goes on from a callback), both have MAXMSGSIZE (a larger frame
drops its connection unread); the XPUB socket is XPUB_MANUAL and applies only subscriptions the
SubscriptionFilter admits (this sidecar's topics, a cap on distinct narrow filters); refused
subscriptions and malformed replay requests are counted and logged at a bounded rate; a peer past
REFUSED_PER_PEER refused filters is disconnected (peers.py: libzmq keeps every filter a connected
peer sent, and walks them all on the loop at each disconnection); ipc socket files are 0600.

Replay: a ROUTER socket; a request `(identity, "", start_seq 8 bytes big-endian)` is answered with
every buffered batch from `start_seq` as `(identity, "", topic, seq, payload)` and then the end
marker `(identity, "", "", -1, "")`, exactly as vLLM's publisher answers (a DEALER or REQ peer).
A replay is sent from a task, in slices, yielding between them; at most MAX_REPLAYS at once (a
request beyond, or a malformed one, is ignored and counted: the requester times out and asks again).

State (event loop only): the ZMQ context and sockets, the sequence counter, the replay buffer
(bounded by batches and by bytes), counters, the subscription filter, the replay tasks (kept in a
set), whether a reader's continuation is scheduled.

Primitives in call order: KvEventPublisher(settings, namer, deployment...) -> bind() (ConfigError)
-> start() (readers on the loop) -> on_events(events)... (the bus callback) -> close().
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable

import structlog
import zmq

from api.kvevents.blocks import BlockNamer
from api.kvevents.config import KvEventsSettings
from api.kvevents.curve import ZapHandler, socket_fd
from api.kvevents.guard import (
    MAX_REQUEST_BYTES,
    MAX_SUBSCRIPTION_BYTES,
    READ_BUDGET,
    REFUSED_PER_PEER,
    SUBSCRIPTION_BUDGET,
    SUBSCRIPTION_HWM,
    Complaints,
    SubscriptionFilter,
    bind_private,
)  # fmt: skip
from api.kvevents.peers import PeerDropper
from api.kvevents.wire import END_SEQ, AllBlocksCleared, KVEvent, KVEventBatch, encode_batch, seq_bytes
from app.tasks import TaskSet
from engine.events import Event, Kind

log = structlog.get_logger("kvdepot.kv_events")

#: replay batches sent per slice before the loop gets a turn
REPLAY_SLICE = 128
#: replays being sent at once; a request beyond is ignored (counted): its client asks again
MAX_REPLAYS = 8


class KvEventPublisher:
    def __init__(self, settings: KvEventsSettings, namer: BlockNamer) -> None:
        if settings.endpoint is None:
            raise ValueError("kv_events.endpoint is not set")
        self.settings = settings
        self.namer = namer
        self.incarnation = secrets.token_hex(8)
        self.host = settings.host or socket.gethostname()
        self.next_seq = 0
        self.sent = 0
        """Batches handed to the PUB socket."""
        self.dropped = 0
        """Batches a full subscriber queue refused (they stay in the replay buffer)."""
        self.events_sent: dict[str, int] = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.replays = 0
        self.replays_cut = 0
        self.replays_refused = 0
        self.bad_requests = Complaints(log, "kv_events_bad_replay_request")
        self.subscriptions = SubscriptionFilter(settings.topic, self.host, settings.max_subscriptions)
        self.refused_subscriptions = Complaints(log, "kv_events_subscription_refused")
        self._scheduled: set[str] = set()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque()
        self._buffer_bytes = 0
        self._models: dict[str, None] = {}
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self.peers: PeerDropper | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._zap: ZapHandler | None = None
        self._tasks = TaskSet("kv-events-replay")
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- sockets --------------------------------------------------------------------------------

    def _secure(self, sock: zmq.Socket[bytes]) -> None:
        s = self.settings
        if s.curve_secret_key is None or s.curve_public_key is None:
            return
        sock.curve_server = True
        sock.curve_secretkey = s.curve_secret_key.get_secret_value().encode()
        sock.curve_publickey = s.curve_public_key.encode()
        sock.zap_domain = b"kvdepot-kv-events"

    def bind(self) -> None:
        s = self.settings
        assert s.endpoint is not None
        self._ctx = zmq.Context()
        try:
            if s.curve_allowed_clients:
                self._zap = ZapHandler(self._ctx, [k.encode() for k in s.curve_allowed_clients])
            pub = self._pub = self._new_pub()
            bind_private(pub, s.endpoint, "kv_events.endpoint")
            self.peers = PeerDropper(self.endpoint, REFUSED_PER_PEER)
            if s.replay_endpoint is not None:
                replay = self._replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
                self._secure(replay)
                bind_private(replay, s.replay_endpoint, "kv_events.replay_endpoint")
        except BaseException:
            self.close()
            raise

    def _new_pub(self) -> zmq.Socket[bytes]:
        assert self._ctx is not None
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self.settings.sndhwm)
        pub.setsockopt(zmq.XPUB_NODROP, 1)
        pub.setsockopt(zmq.XPUB_MANUAL, 1)
        pub.setsockopt(zmq.RCVHWM, SUBSCRIPTION_HWM)
        pub.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
        self._secure(pub)
        return pub

    @property
    def endpoint(self) -> str:
        """The PUB socket's bound endpoint (the real port when 0 was asked)."""
        assert self._pub is not None
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def replay_endpoint(self) -> str | None:
        if self._replay is None:
            return None
        return str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def start(self) -> None:
        """Watch the sockets on the running loop (subscriptions, replay requests, ZAP requests)."""
        loop = self._loop = asyncio.get_running_loop()
        assert self._pub is not None
        loop.add_reader(socket_fd(self._pub), self._drain_pub)
        if self._replay is not None:
            loop.add_reader(socket_fd(self._replay), self._drain_replay)
        if self._zap is not None:
            self._zap.start(loop)
        self._drain_pub()
        self._drain_replay()

    def close(self) -> None:
        self._tasks.cancel()
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                if self._loop is not None and not self._loop.is_closed():
                    with contextlib.suppress(Exception):
                        self._loop.remove_reader(socket_fd(sock))
                sock.close(linger=0)
        if self._zap is not None:
            self._zap.close(self._loop)
            self._zap = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- the bus callback -----------------------------------------------------------------------

    def on_events(self, events: list[Event]) -> None:
        """Translate and publish (never blocks: drops are counted)."""
        model = ""
        pending: list[KVEvent] = []
        limit = self.settings.max_batch_events
        namer = self.namer
        for ev in events:
            out: KVEvent | None = None
            ev_model = model
            if ev.kind is Kind.STORED and ev.key is not None:
                out = namer.stored(ev)
                ev_model = ev.key.namespace.model
            elif ev.kind is Kind.REMOVED and ev.key is not None:
                out = namer.removed(ev.key, ev.tier)
                ev_model = ev.key.namespace.model
            elif ev.kind is Kind.CLEARED:
                self._flush(model, pending)
                pending = []
                for m in list(self._models) or ["*"]:
                    self._flush(m, [AllBlocksCleared()])
                continue
            if out is None:
                continue
            if ev_model != model or len(pending) >= limit:
                self._flush(model, pending)
                pending = []
                model = ev_model
            pending.append(out)
        self._flush(model, pending)

    def _flush(self, model: str, events: list[KVEvent]) -> None:
        if not events:
            return
        if model != "*" and model not in self._models:
            if len(self._models) >= 256:
                self._models.pop(next(iter(self._models)))
            self._models[model] = None
        topic = self.settings.topic.replace("{host}", self.host).replace("{model}", model).encode()
        batch = KVEventBatch(time.time(), events, data_parallel_rank=0)
        payload = encode_batch(batch)
        seq = self.next_seq
        self.next_seq += 1
        self._remember(seq, topic, payload)
        for ev in events:
            self.events_sent[type(ev).__name__] += 1
        self._send(topic, seq, payload)

    def _send(self, topic: bytes, seq: int, payload: bytes) -> None:
        pub = self._pub
        if pub is None:
            return
        try:
            pub.send_multipart((topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.dropped += 1
        self._drain_pub()  # a send can consume the descriptor's edge

    def _remember(self, seq: int, topic: bytes, payload: bytes) -> None:
        buf = self._buffer
        buf.append((seq, topic, payload))
        self._buffer_bytes += len(payload) + len(topic)
        s = self.settings
        while len(buf) > s.buffer or (self._buffer_bytes > s.buffer_max_bytes and len(buf) > 1):
            _, t, p = buf.popleft()
            self._buffer_bytes -= len(p) + len(t)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch published (-1: none yet)."""
        return self.next_seq - 1

    # -- readers --------------------------------------------------------------------------------

    @property
    def subscribers(self) -> int:
        return self.subscriptions.subscribers

    def _again(self, name: str, reader: Callable[[], None]) -> None:
        """Read on from a callback once the loop had a turn (one continuation per socket)."""
        if name not in self._scheduled and self._loop is not None and not self._loop.is_closed():
            self._scheduled.add(name)

            def go() -> None:
                self._scheduled.discard(name)
                reader()

            self._loop.call_soon(go)

    def _drain_pub(self) -> None:
        """Read XPUB's subscription messages (1 = subscribe, 0 = unsubscribe), READ_BUDGET at a time,
        and apply those the filter admits (XPUB_MANUAL: an unapplied one costs libzmq nothing)."""
        pub = self._pub
        if pub is None or pub.closed:
            return
        for _ in range(SUBSCRIPTION_BUDGET):
            try:
                frame = pub.recv(zmq.NOBLOCK, copy=False)  # no EVENTS per message: each takes in more
            except zmq.Again:
                if not int(pub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return  # the descriptor's edge is re-armed
                continue
            msg = frame.bytes
            flag, topic = msg[:1], msg[1:]
            if flag == b"\x01":
                if self.subscriptions.subscribe(topic):
                    pub.setsockopt(zmq.SUBSCRIBE, topic)
                else:
                    self.refused_subscriptions.note(filter_bytes=len(topic))
                    self._refused_from(frame)
            elif flag == b"\x00" and self.subscriptions.unsubscribe(topic):
                pub.setsockopt(zmq.UNSUBSCRIBE, topic)
        self._again("pub", self._drain_pub)

    def _refused_from(self, frame: zmq.Frame) -> None:
        """A refused filter, charged to its peer (dropped past its budget: peers.py)."""
        if self.peers is None:
            return
        try:
            address = frame.get("Peer-Address")
        except zmq.ZMQError:
            address = None
        self.peers.refused(address if isinstance(address, str) else None)

    def _drain_replay(self) -> None:
        sock = self._replay
        if sock is None or sock.closed:
            return
        for _ in range(READ_BUDGET):
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.bad_requests.note(frames=len(frames))
                continue
            if len(self._tasks) >= MAX_REPLAYS:
                self.replays_refused += 1
                continue
            start = int.from_bytes(frames[2], "big", signed=True)
            entries = self._from(start)
            self.replays += 1
            self._tasks.spawn(self._serve_replay(frames[0], entries))
        self._again("replay", self._drain_replay)

    def _from(self, start: int) -> list[tuple[int, bytes, bytes]]:
        """The buffered batches from sequence `start` on (the buffer's sequence numbers are consecutive)."""
        buf = self._buffer
        if not buf:
            return []
        skip = min(len(buf), max(0, start - buf[0][0]))
        return list(itertools.islice(buf, skip, None))

    async def _serve_replay(self, ident: bytes, entries: Iterable[tuple[int, bytes, bytes]]) -> None:
        sock = self._replay
        assert sock is not None
        try:
            for i, (seq, topic, payload) in enumerate(entries):
                sock.send_multipart((ident, b"", topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
                if i % REPLAY_SLICE == REPLAY_SLICE - 1:
                    self._drain_replay()
                    await asyncio.sleep(0)
            sock.send_multipart((ident, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.replays_cut += 1  # the requester stopped reading: it asks again
        except zmq.ZMQError as exc:
            self.replays_cut += 1
            log.warning("kv_events_replay_failed", error=str(exc))
        self._drain_replay()
