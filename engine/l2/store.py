"""StoreController: writes committed L1 chunks behind to the L2 tiers; the engine never waits on it.

State: the bounded FIFO of pending chunks (engine/l2/store_queue.py, built first and given to L1
as its shedder), each pinned in L1 (`cache.pin`: not evicted or reused before it is written), a
bounded record of how often each chunk was seen (for the `seen_twice` policy), the bytes being
written per (tenant, tier) (engine/l2/store_quota.py), counters (shared with the queue). Owned by
the event loop; encoding
(a checksum over the whole chunk, optional FP8/lz4, and the MAC when a target tier authenticates:
one blob, signed with the deployment's first key, serves every tier) runs in the codec executor,
adapter I/O in the adapters.

Primitives in call order:
  note_seen(key, request)  lookups and stores report the chunks they saw (seen_twice policy: a
                           chunk is written once a second request saw it)
  submit(obj, reg)         after COMMIT: pin and queue the chunk if the policy wants it; when the
                           queue is full the OLDEST pending chunk is dropped (unpinned), counted
  run_worker()             supervised loop(s): take a batch, encode, store to the tiers the policy
                           chooses at that moment (each blob within its tenant's quota there),
                           unpin each chunk saying whether it reached L2 (if not, a later commit
                           or hit may queue it again)
  hold(salt) / settled(salt) / unhold(salt)
                           a purge (engine/purge.py): the tenant's chunks are refused and dropped
                           from the queue (engine/l2/store_holds.py), its batches in flight waited
                           for, then written behind again

Events: START/END "l2.store" (tier = the adapter, request_id = the request whose COMMIT queued the
chunks, END's detail = its chunks written) around each batch written to a tier, one pair per request
in the batch, then per chunk STORED (tier = the adapter) or ERROR (op "l2.store").

Tenant quotas in L2 (`l2_bytes`, a limit per adapter; the ledger is `tiers.ledger`, into which
each adapter reports what it holds; engine/l2/store_quota.py applies them). Before a blob of
tenant s is written to tier t, with L the limit of (s, t), H what s holds there and P the bytes of
s being written there by other batches:
- H + P + size <= L: written.
- otherwise s's own least recently used blobs in that adapter are evicted (`evict_salt`, never
  another tenant's) until it fits; if that cannot make it fit (the blob is larger than L, or P
  alone leaves no room), the blob is not written to t and a quota refusal is noted for (s, t);
  s is still brought down to L. Hence a lowered quota takes effect at the tenant's next write to
  that tier at the latest (the quota administration also meets it at once: engine/l2/enforce.py),
  quota 0 stores nothing, and in allowlist mode (limit 0 without a quota) neither do
  salts without a quota. A chunk whose tenant has limit 0 and holds nothing in every target tier
  is refused at `submit` (no pin, no encoding).
- Fleet ledger (an adapter with the `fleet` capability, storage/base.py: a fleet-scope Redis, its
  ledger in Redis itself): the blob's bytes are reserved there against the fleet quota (else this
  sidecar's limit) instead;
  refused, the tenant's oldest blobs fleet-wide are evicted and the reservation tried once more;
  the reservations of blobs written are committed after the batch.
- Bytes being written count against the limit until the write returns, so concurrent batches
  cannot overshoot it together; they are never evicted. The blobs of a batch are admitted in
  order, so when not all of a tenant's chunks in one batch fit, the first ones (the start of a
  chain, useful without the rest) are written and the rest refused. The check takes a blob written
  again (its key is held already) as new: it may evict a little more than needed.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor

import structlog

from app.errors import BackendError
from engine.events import ChunkOrigin, EventBus, Kind
from engine.keys import ObjectKey
from engine.l1.arena import SharedArena
from engine.l1.cache import L1Cache
from engine.l1.lifecycle import L1Object
from engine.l2.store_holds import TenantHolds
from engine.l2.store_queue import Pending, StoreQueue
from engine.l2.store_quota import QuotaAdmission, commit_fleet, reserve_batch
from engine.l2.tiers import L2Tiers, Tier
from engine.results import Registration
from storage import codec
from storage.auth import BlobKeys
from storage.base import OpResult

log = structlog.get_logger("kvdepot.l2.store")

SEEN_MEMORY = 1 << 17
BATCH = 8


class StoreController:
    def __init__(
        self,
        *,
        cache: L1Cache,
        arena: SharedArena,
        tiers: L2Tiers,
        queue: StoreQueue,
        policy: str,
        codec_options: Callable[[Registration], codec.CodecOptions],
        executor: Executor,
        keys: BlobKeys | None = None,
        events: EventBus | None = None,
    ) -> None:
        self.cache = cache
        self.arena = arena
        self.tiers = tiers
        self.events = events if events is not None else cache.events
        self.policy = policy
        self.queue = queue
        self.counters = queue.counters
        self._codec_options = codec_options
        self._executor = executor
        self._keys = keys
        #: key -> (requests that saw it, the last one): the bounded record of the seen_twice policy
        self._seen: OrderedDict[ObjectKey, tuple[int, tuple[int, str] | None]] = OrderedDict()
        self.quota = QuotaAdmission(tiers, queue.counters)
        self.holds = TenantHolds()

    @property
    def depth(self) -> int:
        return len(self.queue)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or being written. False on timeout."""
        return await self.queue.wait_idle(timeout_s)

    # --- called synchronously by the facade ----------------------------------------------------

    def note_seen(self, key: ObjectKey, request: tuple[int, str]) -> int:
        """`request` (engine id, request id) saw `key`: how many requests have seen it. The same
        request counts once however often it looks the chunk up and stores it (the connector
        looks a request up, then stores what missed)."""
        seen = self._seen
        count, last = seen.pop(key, (0, None))
        if last != request:
            count += 1
        seen[key] = (count, request)
        if len(seen) > SEEN_MEMORY:
            seen.popitem(last=False)
        return count

    def note_lookup(
        self, reg: Registration, keys: list[ObjectKey], found: list[L1Object], request: tuple[int, str]
    ) -> None:
        """`request` looked up `keys`, the first `len(found)` of them in L1 (`found`). Under
        `seen_twice` each is noted, and a found chunk seen by a second request is queued for
        write-behind."""
        if self.policy != "seen_twice":
            return
        for i, key in enumerate(keys):
            if self.note_seen(key, request) >= 2 and i < len(found):
                self.submit(found[i], reg)

    def wants(self, key: ObjectKey) -> bool:
        if not self.tiers.active():
            return False
        return self.policy != "seen_twice" or self._seen.get(key, (0, None))[0] >= 2

    def submit(
        self, obj: L1Object, reg: Registration, request_id: str = "", origin: ChunkOrigin | None = None
    ) -> bool:
        """Queue a ready chunk for write-behind (for `request_id`, whose COMMIT made it ready: its
        write-behind events name it, and say `origin` of the chunk). False when the policy does
        not want it."""
        if obj.in_l2 or not self.wants(obj.key):
            self.counters.skipped_policy += 1
            if not obj.in_l2 and self.policy == "seen_twice" and self.tiers.active():
                self.counters.not_admitted += 1
            return False
        if self.holds.held(obj.key.salt):
            self.counters.skipped_purge += 1
            return False
        if self.quota.refused_everywhere(obj.key.salt, self._targets()):
            return False
        # Queued once (in_l2 from now); a drop or a failed write unpins it as not copied, so a
        # later commit or hit queues it again.
        self.cache.pin(obj)
        self.counters.submitted += 1
        for old in self.queue.push(Pending(obj, reg, request_id, origin)):
            self.cache.unpin(old.obj, copied=False)
        return True

    # --- the workers ---------------------------------------------------------------------------

    async def run_worker(self) -> None:
        queue = self.queue
        while True:
            await queue.wait_work()
            batch = self._unheld(queue.take(BATCH))
            salts = [item.obj.key.salt for item in batch]
            self.holds.writing(salts)
            written = [False] * len(batch)
            try:
                written = await self._write(batch) if batch else written
            finally:
                for item, copied in zip(batch, written, strict=True):
                    self.cache.unpin(item.obj, copied=copied)
                self.holds.written(salts)
                queue.done()

    # --- purges: a tenant's write-behind held off ----------------------------------------------

    def hold(self, salt: str) -> None:
        """Write nothing more of `salt` until `unhold`: its queued chunks are dropped, new ones
        refused (`skipped_purge`); `await settled(salt)` then waits for its batches in flight."""
        self.holds.hold(salt)
        self._unheld(self.queue.remove_salt(salt))

    def unhold(self, salt: str) -> None:
        self.holds.unhold(salt)

    async def settled(self, salt: str) -> None:
        await self.holds.settled(salt)

    def _unheld(self, items: list[Pending]) -> list[Pending]:
        """`items` less the chunks of held tenants, which are unpinned (not copied) and counted."""
        keep = []
        for item in items:
            if self.holds.held(item.obj.key.salt):
                self.cache.unpin(item.obj, copied=False)
                self.counters.skipped_purge += 1
            else:
                keep.append(item)
        return keep

    def _targets(self) -> list[Tier]:
        active = self.tiers.active()
        return active[:1] if self.policy == "first" else active

    # --- tenant quotas -------------------------------------------------------------------------

    async def _write(self, batch: list[Pending]) -> list[bool]:
        """Encode and store the batch; per chunk, whether it was written to some tier."""
        targets = self._targets()
        if not targets:
            return [False] * len(batch)
        loop = asyncio.get_running_loop()
        sign = self._keys if any(tier.config.authenticate for tier in targets) else None
        blobs = await loop.run_in_executor(self._executor, self._encode, batch, sign)
        salts = [item.obj.key.salt for item in batch]
        requests = [item.request_id for item in batch]
        ok = [False] * len(batch)
        events = self.events
        for tier in targets:
            admitted, results = await self._store_to(tier, blobs, salts, requests)
            for i, result in zip(admitted, results, strict=True):
                if result.ok:
                    ok[i] = True
                    if events.enabled:
                        origin = batch[i].origin
                        events.emit(
                            Kind.STORED, tier=tier.name, key=batch[i].obj.key, op="l2.store",
                            **(origin.fields() if origin is not None else {}),
                        )  # fmt: skip
                else:
                    self.counters.failed += 1
                    if events.enabled:
                        events.emit(
                            Kind.ERROR, tier=tier.name, key=batch[i].obj.key, op="l2.store",
                            reason=result.status.value,
                        )  # fmt: skip
        for blob, written in zip(blobs, ok, strict=True):
            if written:
                self.counters.written += 1
                self.counters.written_bytes += blob.nbytes
        return ok

    async def _store_to(
        self, tier: Tier, blobs: list[codec.EncodedBlob], salts: list[str], requests: list[str]
    ) -> tuple[list[int], list[OpResult]]:
        """Write the blobs each tenant's quota admits to `tier`: their indices and results. One
        START/END "l2.store" pair per request among them (`requests`: each blob's)."""
        admitted: list[int] = []
        with tier.use():
            try:
                firsts = await reserve_batch(tier, self.tiers.ledger, blobs, salts)
                for i, blob in enumerate(blobs):
                    try:
                        if await self.quota.admit(tier, salts[i], blob.nbytes, blob.key, firsts[i]):
                            admitted.append(i)
                    except BackendError as exc:  # a fleet ledger that does not answer: not now
                        log.warning("l2_fleet_reserve_failed", adapter=tier.name, error=str(exc))
                        self.counters.failed += len(blobs) - i
                        break
                if not admitted:
                    return [], []
                events = self.events
                spans: dict[str, int] = {}
                if events.enabled:
                    for i in admitted:
                        rid = requests[i]
                        if rid not in spans:
                            spans[rid] = events.start("l2.store", rid, tier=tier.name)
                start = time.perf_counter()
                results: list[OpResult] | None = None
                try:
                    results = await tier.adapter.store([(blobs[i].key, blobs[i]) for i in admitted])
                finally:
                    reason = "cancelled" if results is None else "ok"
                    for rid, span in spans.items():
                        stored = 0
                        if results is not None:
                            pairs = zip(admitted, results, strict=True)
                            stored = sum(r.ok for i, r in pairs if requests[i] == rid)
                        events.end(span, "l2.store", rid, tier=tier.name, reason=reason, detail=stored)
                tier.adapter.latency.observe("store_batch", time.perf_counter() - start)
                await commit_fleet(tier, [blobs[i].key for i in admitted], salts, admitted, results)
                return admitted, results
            finally:
                for i in admitted:
                    self.quota.written(tier, salts[i], blobs[i].nbytes)

    def _encode(self, batch: list[Pending], sign: BlobKeys | None) -> list[codec.EncodedBlob]:
        """In the codec executor: header + checksum (+ FP8/lz4, + the MAC when `sign`) over the
        pinned L1 bytes."""
        out = []
        for item in batch:
            obj = item.obj
            payload = self.arena.view(obj.offset, obj.size)
            out.append(
                codec.encode(
                    obj.key.serialize(),
                    obj.key.namespace.layout_fp,
                    payload,
                    self._codec_options(item.reg),
                    sign,
                )
            )
        return out
