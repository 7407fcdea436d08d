"""Subscriptions: one task per known sidecar that keeps the directory's index equal to its holdings.

A task subscribes to the sidecar's KV-event PUB socket (ZMQ SUB), then resyncs from its
`GET /inventory`, then applies the live batches in sequence order, as the instance's StreamTracker
(fleet/stream.py) says. The inventory's bearer: the sidecars' admin token (`directory.sidecar_token`)
for a static instance only (its URL is the configuration's); a registered instance is sent its own
credential (fleet/credentials.py), which it presented to register: the URL a registrant names
learns nothing it did not hold. Bounds on what a registrant sends: frames past
`directory.max_event_bytes` drop the connection unread (ZMQ MAXMSGSIZE, on the SUB and the replay
DEALER); a listing line past 1 MiB fails the resync (lines are split once, linearly); chunks past
`max_chunks_per_instance` are dropped (fleet/ingest.py).

  - a gap in the sequence: the replay socket (DEALER, `("", start_seq)`) is asked for everything
    from the first missing batch; the replayed batches go through the tracker like live ones; a
    replay that starts after the missing batch (the sidecar's buffer let it go), times out or
    cannot be asked (no replay endpoint) falls back to the inventory;
  - a new incarnation (the sidecar restarted), an AllBlocksCleared (vLLM's has no medium: relearn
    the other tiers) or nothing known yet: the inventory replaces the holdings, its header says
    from which sequence on the live batches apply;
  - a heartbeat saying the sidecar published past what arrived (`nudge`, after a grace): a replay,
    or the inventory for an incarnation never seen;
  - the SUB connection dropped and came back (a socket monitor): the sidecar may have restarted
    and said nothing yet: the inventory;
  - a stream quiet for `directory.probe_s`: the replay socket is asked from the next sequence
    expected (a last batch lost on a quiet stream shows there; nothing newer: nothing to do).

While a task repairs, the live batches wait in its intake (fleet/http/intake.py: a reader task
drains the SUB socket into a queue bounded in bytes, all instances' together,
`directory.max_queued_event_bytes`); one that does not fit is dropped, counted (`events_dropped`)
and its instance resynced (`overflow`). Any failure (sidecar down, a listing cut short) restarts
the task after a backoff (0.2 s doubling to 5 s), from a fresh subscription and listing.

State: per task its sockets and pending nudge; the manager's task set (kept, discarded on done).
Event loop only.

Primitives in call order: Subscriptions(directory, config, instance_secret) -> start(instance id)
... nudge(id) ... stop(id) -> close().
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import msgspec
import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from app.complaints import Complaints
from fleet.credentials import instance_credential
from fleet.directory import Directory
from fleet.http.intake import Budget, Intake, rcvhwm
from fleet.ingest import Batch, BatchTokens, InventoryReader, apply_batch, batch_decoder, batch_tokens_decoder
from fleet.registry import Instance
from fleet.spec import DirectoryConfig
from fleet.stream import Action

log = structlog.get_logger("kvdepot.directory")

_END = -1
_YIELD_EVERY = 512
MAX_LINE_BYTES = 1 << 20
"""Longest inventory line taken (a chunk line is a few hundred bytes)."""


class ResyncFailed(Exception):
    pass


class Forgotten(Exception):
    """The instance was forgotten while its task ran: the task ends."""


class Subscription:
    def __init__(self, owner: Subscriptions, instance_id: str) -> None:
        self.owner = owner
        self.id = instance_id
        self.wake = asyncio.Event()
        self.nudged: Action | None = None
        self.failures = 0
        self.last_error = ""
        self.drops = Complaints(log, "directory_events_dropped")

    @property
    def directory(self) -> Directory:
        return self.owner.directory

    def _instance(self) -> Instance:
        inst = self.directory.registry.get(self.id)
        if inst is None:
            raise Forgotten(self.id)
        return inst

    async def run(self) -> None:
        backoff = 0.2
        while True:
            try:
                await self._run_once()
            except Forgotten:
                return
            except Exception as exc:  # any failure: a fresh subscription and listing after a pause
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                inst = self.directory.registry.get(self.id)
                if inst is not None:
                    inst.tracker.need_resync("reconnect")
                log.warning("directory_subscription_failed", instance=self.id, error=self.last_error)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _run_once(self) -> None:
        inst = self._instance()
        config = self.owner.config
        sub = self.owner.zctx.socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        intake = Intake(sub, self.owner.budget, self._dropped)
        try:
            sub.setsockopt(zmq.RCVHWM, rcvhwm(config.max_queued_event_bytes, config.max_event_bytes))
            sub.setsockopt(zmq.MAXMSGSIZE, config.max_event_bytes)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sub.connect(inst.spec.events_endpoint)
            intake.start()
            inst.tracker.need_resync(inst.tracker.resync_reason or "start")
            await self._resync(inst.tracker.resync_reason or "start")
            lost = False
            quiet_since = time.monotonic()
            while True:
                frames = await intake.get(wait_s=0.25)
                while await monitor.poll(0):
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        self.directory.stats.event_disconnects += 1
                        lost = True  # the sidecar went (or the network): anything may be missed
                    elif event == zmq.EVENT_CONNECTED and lost:
                        lost = False
                        await self._resync("reconnect")  # a restarted sidecar may have said nothing yet
                if intake.take_overflow():
                    inst.tracker.need_resync("overflow")
                    await self._resync("overflow")  # what was dropped is in the inventory
                if frames is not None:
                    await self._on_frames(frames)
                    quiet_since = time.monotonic()
                if self.nudged is not None:
                    action, self.nudged = self.nudged, None
                    if action is Action.RESYNC:
                        await self._resync(inst.tracker.resync_reason or "incarnation")
                    elif action is Action.REPLAY:
                        await self._replay(None, "catchup")
                elif time.monotonic() - quiet_since >= config.probe_s:
                    quiet_since = time.monotonic()
                    await self._replay(None, "probe")  # a last batch lost on a quiet stream
        finally:
            await intake.close()
            if monitor is not None:
                sub.disable_monitor()
                monitor.close(0)
            sub.close(0)

    def _dropped(self, nbytes: int) -> None:
        self.directory.stats.events_dropped += 1
        self.drops.note(instance=self.id, bytes=nbytes)

    async def _on_frames(self, frames: list[bytes]) -> None:
        d = self.directory
        if len(frames) != 3 or len(frames[1]) != 8:
            d.stats.bad_batches += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        try:
            batch = self.owner.decode(frames[2])
        except msgspec.DecodeError:
            d.stats.bad_batches += 1
            return
        inst = self._instance()
        action = inst.tracker.on_batch(seq, batch.incarnation)
        if action is Action.APPLY:
            self._apply(inst, batch)
        elif action is Action.SKIP:
            d.stats.duplicates += 1
        elif action is Action.REPLAY:
            await self._replay(seq, "gap")
        else:
            await self._resync(inst.tracker.resync_reason or "incarnation")

    def _apply(self, inst: Instance, batch: Batch | BatchTokens) -> None:
        d = self.directory
        chunks, cleared = apply_batch(d.registry, inst, batch, d.lora, d.matchers)
        d.stats.batches += 1
        d.stats.chunk_events += chunks
        if cleared:
            inst.tracker.need_resync("cleared")
            self.nudged = Action.RESYNC

    async def _replay(self, trigger: int | None, why: str) -> None:
        """Ask the replay socket for everything from the first missing batch. `trigger`: the live
        batch that showed the gap (None: a heartbeat said we are behind)."""
        d = self.directory
        inst = self._instance()
        tracker = inst.tracker
        start = tracker.expected
        if start is None:
            await self._resync(tracker.resync_reason or "start")
            return
        endpoint = inst.spec.replay_endpoint
        if endpoint is None:
            await self._resync("no_replay")
            return
        d.stats.replays += 1
        dealer = self.owner.zctx.socket(zmq.DEALER)
        try:
            config = self.owner.config
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, config.max_event_bytes)
            dealer.setsockopt(zmq.RCVHWM, rcvhwm(config.max_queued_event_bytes, config.max_event_bytes))
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            answered, first = await self._replayed(dealer, inst)
        finally:
            dealer.close(0)
        if not answered:
            return  # a resync answered it
        closed = tracker.expected is not None and (trigger is None or tracker.expected > trigger)
        if first is None and why == "probe":
            return  # nothing published since: up to date
        if first is None or tracker.gap_unfilled(first) or not closed:
            await self._resync("replay_short")
            return
        d.stats.gaps_replayed += 1
        log.info("directory_gap_replayed", instance=self.id, why=why, start=start, upto=tracker.expected)

    async def _replayed(self, dealer: zmq.asyncio.Socket, inst: Instance) -> tuple[bool, int | None]:
        """Take the replayed batches through the tracker until the end mark (or a first batch past
        the gap: the buffer let the missing one go): (True, the first sequence replayed, None for
        none); (False, None) when a resync was needed and done (a timeout, a new incarnation)."""
        d = self.directory
        tracker = inst.tracker
        timeout_ms = int(self.owner.config.replay_timeout_s * 1000)
        first: int | None = None
        while True:
            if not await dealer.poll(timeout_ms):
                log.warning("directory_replay_timeout", instance=self.id)
                await self._resync("replay_timeout")
                return False, None
            frames = await dealer.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                d.stats.bad_batches += 1
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == _END:
                return True, first
            if first is None:
                first = seq
                if tracker.gap_unfilled(first):
                    return True, first  # the buffer no longer has the first missing batch
            try:
                batch = self.owner.decode(frames[3])
            except msgspec.DecodeError:
                d.stats.bad_batches += 1
                continue
            action = tracker.on_batch(seq, batch.incarnation)
            if action is Action.APPLY:
                self._apply(inst, batch)
            elif action is Action.RESYNC:
                await self._resync(tracker.resync_reason or "incarnation")
                return False, None

    async def _resync(self, reason: str) -> None:
        """Replace the instance's holdings with its inventory."""
        d = self.directory
        inst = self._instance()
        if self.nudged is Action.RESYNC:
            self.nudged = None  # this one answers it
        d.count_resync(reason)
        headers = {}
        token = self.owner.inventory_token(inst)
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        started = time.monotonic()
        reader = InventoryReader(d.registry, inst)
        timeout = httpx.Timeout(self.owner.config.inventory_timeout_s, connect=5.0)
        async with self.owner.http.stream(
            "GET", inst.spec.url + "/inventory", headers=headers, timeout=timeout
        ) as resp:
            if resp.status_code != 200:
                raise ResyncFailed(f"GET /inventory answered {resp.status_code}")
            await _read_lines(resp, reader)
        done = reader.finish()
        if done is None:
            raise ResyncFailed("the inventory listing ended early")
        incarnation, seq = done
        inst.tracker.resynced(incarnation, seq)
        log.info(
            "directory_resynced", instance=self.id, reason=reason, chunks=reader.resync.listed,
            gone=reader.gone,
            seq=seq, ms=round((time.monotonic() - started) * 1000, 1),
        )  # fmt: skip


async def _read_lines(resp: httpx.Response, reader: InventoryReader) -> None:
    """Feed a listing's NDJSON lines to the reader: each piece split once (the unfinished line
    carried over), a line past MAX_LINE_BYTES a ResyncFailed."""
    rest = bytearray()
    lines = 0
    async for data in resp.aiter_bytes():
        parts = data.split(b"\n")
        if len(parts) == 1:
            rest += data
        else:
            rest += parts[0]
            parts[0] = bytes(rest)
            rest = bytearray(parts.pop())
            if max(map(len, parts)) > MAX_LINE_BYTES:
                raise ResyncFailed(f"an inventory line is longer than {MAX_LINE_BYTES} bytes")
            reader.feed_page([line for line in parts if line])
            lines += len(parts)
        if len(rest) > MAX_LINE_BYTES:
            raise ResyncFailed(f"an inventory line is longer than {MAX_LINE_BYTES} bytes")
        if lines >= _YIELD_EVERY:
            lines = 0
            await asyncio.sleep(0)
    if rest.strip():
        reader.feed(bytes(rest))


class Subscriptions:
    def __init__(
        self, directory: Directory, config: DirectoryConfig, instance_secret: str | None = None
    ) -> None:
        self.directory = directory
        self.config = config
        self.instance_secret = instance_secret
        """Derives a registered instance's credential (None: registered instances are sent none)."""
        self.zctx = zmq.asyncio.Context()
        self.budget = Budget(config.max_queued_event_bytes)
        """Bytes of received events waiting, all subscriptions together (fleet/http/intake.py)."""
        self.http = httpx.AsyncClient()
        self.subs: dict[str, tuple[Subscription, asyncio.Task[None]]] = {}
        # the matcher needs the token ids of stores; without it msgspec skips them unbuilt
        self.decode = batch_tokens_decoder.decode if directory.matchers is not None else batch_decoder.decode

    def inventory_token(self, inst: Instance) -> str | None:
        """The bearer for the instance's GET /inventory: the sidecars' token only to a URL of the
        configuration's; a registered instance's own credential otherwise."""
        if inst.static:
            token = self.config.sidecar_token
            return None if token is None else token.get_secret_value()
        if self.instance_secret is None:
            return None
        return instance_credential(self.instance_secret, inst.id)

    def start(self, instance_id: str) -> None:
        self.stop(instance_id)
        sub = Subscription(self, instance_id)
        task = asyncio.get_running_loop().create_task(sub.run(), name=f"subscription-{instance_id}")
        self.subs[instance_id] = (sub, task)
        task.add_done_callback(lambda t: self._done(instance_id, t))

    def _done(self, instance_id: str, task: asyncio.Task[None]) -> None:
        current = self.subs.get(instance_id)
        if current is not None and current[1] is task:
            del self.subs[instance_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("directory_subscription_crashed", instance=instance_id, error=repr(task.exception()))

    def nudge(self, instance_id: str, action: Action) -> None:
        current = self.subs.get(instance_id)
        if current is not None and action in (Action.REPLAY, Action.RESYNC):
            current[0].nudged = action

    def get(self, instance_id: str) -> Subscription | None:
        current = self.subs.get(instance_id)
        return None if current is None else current[0]

    def stop(self, instance_id: str) -> None:
        current = self.subs.pop(instance_id, None)
        if current is not None:
            current[1].cancel()

    async def close(self) -> None:
        tasks = [task for _, task in self.subs.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.subs.clear()
        await self.http.aclose()
        self.zctx.term()
