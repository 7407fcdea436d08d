"""PinService: prefix pins as the control plane asks for them: checked, bounded, persisted, released.

Role: `PUT /pins/{cache_salt}` becomes `put(salt, model, token_ids, ttl_s, tiers)`: the tokens'
full chunks are hashed as lookups hash them (engine/keys.py, the sidecar's chunk size) and the pin
goes into the PinTable (engine/pins/table.py), which L1 (L1Cache.bind_pins) and every adapter that
honours pins (L2Tiers.bind_pins: the disk adapter) consult where they choose victims. A pin is
refused, with the reason, when it cannot be honoured (Conflict, 409):
  - a tier is an adapter that cannot honour pins (Redis, slab: their own eviction), or detached;
  - no engine of the model registered since the start: the bytes of its chunks are unknown;
  - what the tenant's pins would hold in a tier (the union of their chunks, times the bytes one
    chunk takes over the model's namespaces, `_namespaces`) passes its `pinned_bytes` quota or its
    quota of that tier (pinned chunks count against it like any other);
  - what all pins would hold in a tier passes `max_share` of its capacity, or `max_pins` pins.
Bad input (an unknown tier, no full chunk, too many chunks, a ttl out of bounds) is InvalidInput.

A model's namespaces, as a pin counts and checks them (`_namespaces`): those of the engines
registered now (distinct namespaces, not registrations; the most recently used first), else those
registered since the start (the most recent first); at most `pins.max_namespaces`. Data-plane
clients (no admin token) may register many namespaces of a model: they then inflate a pin's size
at most `max_namespaces` times, and a listing costs O(pins x chunks x max_namespaces) whatever the
number of registrations.

State (event loop only): the table, the file `<data_dir>/pins.json` (engine/state_file.py; None:
memory only) with the executor that writes it and its writer lock (checks and file writes in
order), the clocks. A change is written to the file first, then applied (as quotas are): one whose
write failed is not made.

Primitives in call order:
  PinService(engine, settings, path=, executor=)   binds the table to L1 and the L2 tiers
  restore(path)            start-up: the pins the file holds (expired ones dropped)
  put(...) -> PinAnswer / delete(salt[, pin_id]) -> released count / pins([salt]) -> PinList
  summary(salt)            a tenant's pins in a few fields (the audit log)
  run_sweeper()            a supervised task: releases expired pins every `sweep_s`
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path

import blake3
import structlog

from app.errors import Conflict, InvalidInput
from engine.answers import PinAnswer, PinList
from engine.facade import CacheEngine
from engine.keys import KVLayout, Namespace, ObjectKey
from engine.l2.tiers import honours_pins
from engine.pins.config import PinSettings
from engine.pins.table import Pin, PinTable
from engine.registry import MAX_ID_LEN
from engine.state_file import StateFile, render_json
from engine.tenants.quota import L1, check_salt
from kvdepot_connector.protocol import encode_tokens
from storage.base import L2Adapter

log = structlog.get_logger("kvdepot.pins")

PIN_FILE = "pins.json"
FORMAT_VERSION = 1
TOKEN_MAX = (1 << 32) - 1


class PinService:
    def __init__(
        self, engine: CacheEngine, settings: PinSettings, *, path: Path | None = None,
        executor: Executor | None = None, clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.settings = settings
        self.table = PinTable()
        self.path = path
        self.released = 0
        self._file = StateFile(path, executor, kind="pin", area="pins")
        self._clock = clock
        self._wall = wall
        engine.cache.bind_pins(self.table.kept_in_l1)
        if engine.l2 is not None:
            engine.l2.tiers.bind_pins(self.table.kept_in)

    # --- changes -------------------------------------------------------------------------------

    async def put(
        self, salt: str, model: str, token_ids: Sequence[int], ttl_s: int | None, tiers: Sequence[str]
    ) -> PinAnswer:
        """Pin the full chunks of `token_ids` of `model` for tenant `salt` in `tiers` (replacing
        the pin of the same prefix). See the module docstring for what is refused."""
        check_salt(salt)
        if not model or len(model) > MAX_ID_LEN:
            raise InvalidInput(f"model must be 1..{MAX_ID_LEN} characters")
        names = self._tiers(tiers)
        limits = self.settings
        if ttl_s is not None and (type(ttl_s) is not int or not 1 <= ttl_s <= limits.max_ttl_s):
            raise InvalidInput(f"ttl_s must be an integer in 1..{limits.max_ttl_s} (pins.max_ttl_s) or null")
        hashes = self._hashes(token_ids)
        pin_id = blake3.blake3(model.encode() + b"\0" + hashes[-1]).hexdigest(length=16)
        chunk_bytes = self._chunk_bytes(model, names)
        now, wall = self._clock(), self._wall()
        pin = Pin(
            id=pin_id, salt=salt, model=model, hashes=tuple(hashes), tiers=names, ttl_s=ttl_s,
            created_at=wall, expires_at=None if ttl_s is None else wall + ttl_s,
            deadline=None if ttl_s is None else now + ttl_s, chunk_bytes=chunk_bytes,
        )  # fmt: skip
        async with self._file.writing:  # checked, saved and added with no other change in between
            if not self.table.has(salt, pin_id) and len(self.table) >= limits.max_pins:
                raise Conflict(f"{len(self.table)} pins exist, the most pins.max_pins allows")
            self._check_room(pin)
            others = [p for p in self.table.pins() if (p.salt, p.id) != (salt, pin_id)]
            await self._save([*others, pin])  # durable first: a pin whose write failed is not made
            self.table.put(pin)
        log.info("pin_set", pin=pin_id, chunks=pin.chunks, tiers=list(names), ttl_s=ttl_s)  # no salts in logs
        return await self.answer(pin)

    async def delete(self, salt: str, pin_id: str | None = None) -> int:
        """Release one pin (NotFound when there is none) or, `pin_id` None, every pin of the tenant.
        Returns how many were released; their chunks are evictable at once."""
        check_salt(salt)
        async with self._file.writing:
            mine = self.table.pins(salt) if pin_id is None else [self.table.get(salt, pin_id)]
            gone = {(p.salt, p.id) for p in mine}
            await self._save([p for p in self.table.pins() if (p.salt, p.id) not in gone])
            for pin in mine:
                self.table.remove(pin.salt, pin.id)
        self.released += len(mine)
        return len(mine)

    def expire(self) -> list[Pin]:
        """Release the pins whose ttl ran out (the sweeper; also called before every listing)."""
        gone = self.table.expire(self._clock())
        for pin in gone:
            log.info("pin_expired", pin=pin.id)
        self.released += len(gone)
        return gone

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_s)
            if self.expire():
                async with self._file.writing:
                    await self._save_quietly()

    # --- reads ---------------------------------------------------------------------------------

    async def pins(self, salt: str | None = None) -> PinList:
        self.expire()
        out = []
        namespaces: dict[str, list[Namespace]] = {}  # per model, looked up once per listing
        for pin in self.table.pins(salt):
            if pin.model not in namespaces:
                namespaces[pin.model] = [ns for ns, _ in self._namespaces(pin.model)]
            out.append(await self.answer(pin, namespaces[pin.model]))
            await asyncio.sleep(0)  # a long listing lets the data plane in between pins
        return PinList(pins=out)

    async def answer(self, pin: Pin, namespaces: Sequence[Namespace] | None = None) -> PinAnswer:
        """The pin as the control plane shows it, with how many of its chunks each tier holds now
        (over the model's namespaces, `_namespaces`, unless given)."""
        present: dict[str, int] = {}
        if namespaces is None:
            namespaces = [ns for ns, _ in self._namespaces(pin.model)]
        keys = [ObjectKey(ns, pin.salt, h) for ns in namespaces for h in pin.hashes]
        for tier in pin.tiers:
            if tier == L1:
                present[tier] = sum(1 for k in keys if self.engine.cache.peek(k) is not None)
                continue
            adapter = self._adapter(tier)
            if adapter is None:
                present[tier] = 0
                continue
            results = await adapter.contains([k.serialize() for k in keys])
            present[tier] = sum(1 for r in results if r.ok)
        return PinAnswer(
            id=pin.id, cache_salt=pin.salt, tenant=self.engine.tenants.name_of(pin.salt), model=pin.model,
            chunks=pin.chunks, tokens=pin.chunks * self.engine.chunk_size, tiers=list(pin.tiers),
            ttl_s=pin.ttl_s, created_at=pin.created_at, expires_at=pin.expires_at,
            pinned_bytes={t: pin.chunks * pin.chunk_bytes[t] for t in pin.tiers}, present_chunks=present,
        )  # fmt: skip

    def summary(self, salt: str) -> list[dict[str, object]]:
        """A tenant's pins in a few fields (the audit log's before/after)."""
        return [
            {"id": p.id, "chunks": p.chunks, "tiers": list(p.tiers), "expires_at": p.expires_at}
            for p in self.table.pins(salt)
        ]

    def pinned_bytes(self, tier: str, salt: str | None = None, extra: Pin | None = None) -> int:
        """What pins hold in `tier` (of `salt`, when given), their shared chunks counted once; with
        `extra` as if it were in the table (replacing the pin of its id)."""
        pins = [p for p in self.table.pins(salt) if tier in p.tiers]
        if extra is not None:
            pins = [p for p in pins if (p.salt, p.id) != (extra.salt, extra.id)] + [extra]
        chunks: dict[tuple[str, str], set[bytes]] = {}
        per_chunk: dict[tuple[str, str], int] = {}
        for pin in pins:
            group = (pin.salt, pin.model)
            chunks.setdefault(group, set()).update(pin.hashes)
            per_chunk[group] = max(per_chunk.get(group, 0), pin.chunk_bytes.get(tier, 0))
        return sum(len(hashes) * per_chunk[group] for group, hashes in chunks.items())

    # --- checks --------------------------------------------------------------------------------

    def _tiers(self, tiers: Sequence[str]) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(tiers))
        if not names:
            raise InvalidInput("tiers must name at least one tier (l1 or an L2 adapter)")
        known = {L1} | ({t.name for t in self.engine.l2.tiers.active()} if self.engine.l2 else set())
        unknown = [n for n in names if n not in known]
        if unknown:
            raise InvalidInput(
                f"unknown tier(s) {', '.join(repr(n[:64]) for n in unknown[:4])}; "
                f"tiers are {', '.join(sorted(known))}"
            )
        for name in names:
            adapter = None if name == L1 else self._adapter(name)
            if adapter is not None and not honours_pins(adapter):
                raise Conflict(
                    f"L2 adapter {name!r} ({adapter.kind}) cannot honour pins: it evicts by its own "
                    "policy; pin in l1 or a disk adapter"
                )
        return names

    def _hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        size = self.engine.chunk_size
        full = len(token_ids) // size
        if full == 0:
            raise InvalidInput(f"token_ids must hold at least one full chunk of {size} tokens")
        if full > self.settings.max_chunks:
            raise InvalidInput(
                f"token_ids hold {full} chunks; a pin holds at most {self.settings.max_chunks} "
                "(pins.max_chunks)"
            )
        tokens = token_ids[: full * size]
        for t in tokens:
            if type(t) is not int or not 0 <= t <= TOKEN_MAX:
                raise InvalidInput(f"token ids must be integers in 0..{TOKEN_MAX}")
        return self.engine.hasher.chunk_hashes(encode_tokens(tokens))

    def _namespaces(self, model: str) -> list[tuple[Namespace, KVLayout]]:
        """The namespaces of `model` a pin accounts for and checks, with their layouts: those of
        the engines registered now (each namespace once, the most recently used first), else those
        registered since the start (the most recent first); at most `pins.max_namespaces`."""
        engines, limit = self.engine.engines, self.settings.max_namespaces
        live: dict[Namespace, KVLayout] = {}
        for reg in reversed(engines.all()):
            if reg.namespace.model == model:
                live.setdefault(reg.namespace, reg.layout)
                if len(live) == limit:
                    break
        if live:
            return list(live.items())
        seen = [(ns, layout) for ns, layout in reversed(engines.namespaces_seen.items()) if ns.model == model]
        return seen[:limit]

    def _chunk_bytes(self, model: str, tiers: tuple[str, ...]) -> dict[str, int]:
        layouts = [layout for _, layout in self._namespaces(model)]
        if not layouts:
            raise Conflict(
                f"no engine of model {model[:64]!r} has registered with this sidecar since it started: the "
                "size of its chunks is unknown; pin once an engine of the model has registered"
            )
        aligned = self.engine.cache.allocator.aligned
        return {
            t: sum(aligned(layout.chunk_bytes) if t == L1 else layout.chunk_bytes for layout in layouts)
            for t in tiers
        }

    def _check_room(self, pin: Pin) -> None:
        ledger = self.engine.tenants
        quota = ledger.quota(pin.salt)
        for tier in pin.tiers:
            mine = self.pinned_bytes(tier, pin.salt, extra=pin)
            limit = None if quota is None else quota.pinned_bytes
            if limit is not None and mine > limit:
                raise Conflict(
                    f"pinned_bytes: the tenant's pins would hold {mine} bytes in {tier}, its pinned_bytes "
                    f"quota is {limit}"
                )
            tier_limit = ledger.limit(pin.salt, tier)
            if tier_limit is not None and mine > tier_limit:
                raise Conflict(
                    f"quota: the tenant's pins would hold {mine} bytes in {tier}, its quota there is "
                    f"{tier_limit}"
                )
            capacity = self._capacity(tier)
            everyone = self.pinned_bytes(tier, extra=pin)
            if everyone > self.settings.max_share * capacity:
                raise Conflict(
                    f"capacity: pins would hold {everyone} bytes of {tier}'s {capacity}, more than "
                    f"pins.max_share ({self.settings.max_share})"
                )

    def _capacity(self, tier: str) -> int:
        if tier == L1:
            return self.engine.cache.allocator.capacity
        adapter = self._adapter(tier)
        return 0 if adapter is None else adapter.usage().capacity_bytes

    def _adapter(self, name: str) -> L2Adapter | None:
        l2 = self.engine.l2
        if l2 is None:
            return None
        for tier in l2.tiers.active():
            if tier.name == name:
                return tier.adapter
        return None

    # --- persistence ---------------------------------------------------------------------------

    def restore(self) -> int:
        """Start-up (blocking): the pins saved in the file, those not expired; ConfigError naming
        the file when it is not valid. Returns how many."""
        if self.path is None:
            return 0
        now, wall = self._clock(), self._wall()
        none: list[Pin] = []
        pins = StateFile.load(self.path, lambda text: parse(text, now, wall), none, kind="pin", area="pins")
        self.table.restore(pins)
        return len(pins)

    async def _save(self, pins: list[Pin]) -> None:
        """`pins` to the file (before they are applied: BackendError, and nothing changes, when it
        cannot be written)."""
        await self._file.save(render(pins))

    async def _save_quietly(self) -> None:
        try:
            await self._save(self.table.pins())
        except Exception as exc:
            log.warning("pin_file_not_written", error=str(exc))


def render(pins: list[Pin]) -> bytes:
    body = {
        "version": FORMAT_VERSION,
        "pins": [
            {
                "id": p.id, "cache_salt": p.salt, "model": p.model, "hashes": [h.hex() for h in p.hashes],
                "tiers": list(p.tiers), "ttl_s": p.ttl_s, "created_at": p.created_at,
                "expires_at": p.expires_at, "chunk_bytes": p.chunk_bytes,
            }
            for p in pins
        ],
    }  # fmt: skip
    return render_json(body)


def parse(text: str, now: float, wall: float) -> list[Pin]:
    """The pins of a pin file's text not yet expired at `wall`, their deadlines on the clock whose
    reading is `now`. ConfigError-free: ValueError saying what is wrong."""
    try:
        body = json.loads(text)
        if body.get("version") != FORMAT_VERSION or not isinstance(body.get("pins"), list):
            raise ValueError(f'expected {{"version": {FORMAT_VERSION}, "pins": [...]}}')
        out: list[Pin] = []
        for e in body["pins"]:
            expires = e["expires_at"]
            if expires is not None and float(expires) <= wall:
                continue
            out.append(Pin(
                id=str(e["id"]), salt=check_salt(str(e["cache_salt"])), model=str(e["model"]),
                hashes=tuple(bytes.fromhex(h) for h in e["hashes"]), tiers=tuple(str(t) for t in e["tiers"]),
                ttl_s=None if e["ttl_s"] is None else int(e["ttl_s"]), created_at=float(e["created_at"]),
                expires_at=None if expires is None else float(expires),
                deadline=None if expires is None else now + float(expires) - wall,
                chunk_bytes={str(k): int(v) for k, v in e["chunk_bytes"].items()},
            ))  # fmt: skip
        return out
    except (ValueError, KeyError, TypeError, AttributeError, InvalidInput) as exc:
        raise ValueError(f"not a valid pin file: {type(exc).__name__}: {exc}") from None
