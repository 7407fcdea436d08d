"""L2Tiers: the ordered set of attached L2 adapters, changed at runtime without a restart.

State: name -> Tier (adapter, its config, active/draining, operations in flight), and the tenant
ledger the adapters report into (None: no accounting, as in tests of the controllers alone). Owned
by the event loop. Controllers take `active()` at the moment they start an operation and wrap it in
`tier.use()`, so a tier being detached is never chosen again and in-flight work is counted.

Tenant accounting: each adapter is given, before it starts, `keys.salt_of` and a hook that turns
every change of what it holds (storage.base: key, delta bytes, delta objects, evicted) into a
ledger charge or credit for (salt of the key, adapter name), and an eviction into
`note_eviction`. So the ledger's figures for a tier are, per tenant, the bytes of the blobs that
adapter holds (the disk adapter's start reports the blobs it found; Redis: what this sidecar wrote
and has not seen deleted). When the adapter is detached its hook is unbound first, then the
ledger forgets the tier, then the adapter closes: a new adapter of the same name starts from zero.

Events: every chunk an adapter reports gone is published as REMOVED (tier = the adapter's name,
reason "evicted" or "deleted"); a removed adapter as CLEARED of its tier.

Primitives in call order:
  bind_pins(kept_for)       prefix pins (engine/pins/): adapters that honour them skip what they hold
  add(config)               build, bind the accounting (and pins), start; Conflict on a duplicate name,
                            ConfigError (and nothing attached) when the adapter cannot start
  active()                  the tiers new work may use, in order
  tier.use()                context manager counting an operation in flight
  resize(name, bytes)       runtime capacity change (the adapter evicts when shrinking)
  remove(name, mode)        drain: no new work, wait for in-flight work (bounded), then close;
                            drop: close at once (in-flight operations end as errors = misses)
  close()
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import structlog

from app.errors import ConfigError, Conflict, NotFound
from engine.events import EventBus, Kind
from engine.keys import ObjectKey, salt_of
from engine.tenants.ledger import TierAccounting
from storage.base import HoldingsHook, Kept, L2Adapter
from storage.config import AdapterConfigBase

log = structlog.get_logger("kvdepot.l2")

RemoveMode = Literal["drain", "drop"]


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until `event` is set; False when `timeout_s` passed first."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


def _cannot_start(config: AdapterConfigBase, exc: Exception) -> ConfigError:
    return ConfigError(f"l2.adapters[{config.name}]: cannot start: {exc}")


@dataclass(eq=False)
class Tier:
    adapter: L2Adapter
    config: AdapterConfigBase
    draining: bool = False
    inflight: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def name(self) -> str:
        return self.adapter.name

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        self.inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        return await wait_set(self._idle, timeout_s)


class L2Tiers:
    def __init__(
        self,
        build: Callable[[AdapterConfigBase], L2Adapter],
        drain_timeout_s: float = 30.0,
        ledger: TierAccounting | None = None,
        events: EventBus | None = None,
    ) -> None:
        self._build = build
        #: REMOVED (tier = adapter name) from the adapters' holdings reports; CLEARED on removal
        self.events = events if events is not None else EventBus(enabled=False)
        self._tiers: dict[str, Tier] = {}
        self.drain_timeout_s = drain_timeout_s
        self.ledger = ledger
        #: tier name -> the keys prefix pins hold there (engine/pins/); None: no pins
        self._kept_for: Callable[[str], Kept] | None = None

    def __len__(self) -> int:
        return len(self._tiers)

    def active(self) -> list[Tier]:
        return [t for t in self._tiers.values() if not t.draining]

    def all(self) -> list[Tier]:
        return list(self._tiers.values())

    def get(self, name: str) -> Tier:
        tier = self._tiers.get(name)
        if tier is None:
            raise NotFound(f"no L2 adapter named {name!r}")
        return tier

    async def add(self, config: AdapterConfigBase) -> Tier:
        """Attach a new adapter. Conflict on a duplicate name; ConfigError when the adapter cannot be
        built or started (a directory it cannot write, a URL it cannot use), and then nothing of it
        stays attached."""
        if config.name in self._tiers:
            raise Conflict(f"an L2 adapter named {config.name!r} exists already")
        try:
            adapter = self._build(config)
        except (OSError, ValueError) as exc:
            raise _cannot_start(config, exc) from None
        tier = Tier(adapter, config)
        self._tiers[config.name] = tier  # reserve the name before awaiting
        if self.ledger is not None or self.events.enabled:
            adapter.bind_accounting(salt_of, self._hook(config.name, self.ledger, self.events))
        pins = adapter.capabilities().pins
        if self._kept_for is not None and pins is not None:
            pins.bind_pins(self._kept_for(config.name))
        try:
            await adapter.start()
        except BaseException as exc:
            del self._tiers[config.name]
            self._forget(adapter)
            await adapter.close()
            if isinstance(exc, (OSError, ValueError)):
                raise _cannot_start(config, exc) from None
            raise
        log.info("l2_adapter_added", name=config.name, type=adapter.kind)
        return tier

    async def resize(self, name: str, capacity_bytes: int) -> Tier:
        tier = self.get(name)
        await tier.adapter.set_capacity(capacity_bytes)
        tier.config = tier.config.model_copy(update={"capacity_gb": capacity_bytes / (1 << 30)})
        return tier

    async def remove(self, name: str, mode: RemoveMode) -> None:
        tier = self.get(name)
        if tier.draining:
            raise Conflict(f"L2 adapter {name!r} is already being removed")
        tier.draining = True
        if mode == "drain" and not await tier.wait_idle(self.drain_timeout_s):
            log.warning("l2_drain_timeout", name=name, inflight=tier.inflight)
        self._tiers.pop(name, None)
        self._forget(tier.adapter)
        await tier.adapter.close()
        self.events.emit(Kind.CLEARED, tier=name, op="l2.remove")
        log.info("l2_adapter_removed", name=name, mode=mode)

    async def close(self) -> None:
        for tier in list(self._tiers.values()):
            tier.draining = True
        for tier in list(self._tiers.values()):
            await tier.wait_idle(1.0)
            self._forget(tier.adapter)
            await tier.adapter.close()
        self._tiers.clear()

    def bind_pins(self, kept_for: Callable[[str], Kept] | None) -> None:
        """Prefix pins (engine/pins/): every adapter that honours them, attached now or later, is
        given `kept_for(its name)`; the others cannot hold pins (`honours_pins`)."""
        self._kept_for = kept_for
        for tier in self._tiers.values():
            pins = tier.adapter.capabilities().pins
            if pins is not None:
                pins.bind_pins(None if kept_for is None else kept_for(tier.name))

    # --- tenant accounting ---------------------------------------------------------------------

    @staticmethod
    def _hook(tier: str, ledger: TierAccounting | None, events: EventBus) -> HoldingsHook:
        def report(key: str, delta_bytes: int, delta_objects: int, evicted: bool) -> None:
            if delta_objects < 0 and events.enabled:
                _removed(events, tier, key, "evicted" if evicted else "deleted")
            if ledger is None:
                return
            salt = salt_of(key)
            if delta_bytes >= 0 and delta_objects >= 0:
                ledger.charge(salt, tier, delta_bytes, delta_objects)
                return
            ledger.credit(salt, tier, -delta_bytes, -delta_objects)
            if evicted:
                ledger.note_eviction(salt, tier, -delta_bytes)

        return report

    def _forget(self, adapter: L2Adapter) -> None:
        adapter.unbind_accounting()
        if self.ledger is not None:
            self.ledger.forget_tier(adapter.name)


def honours_pins(adapter: L2Adapter) -> bool:
    """Whether eviction in `adapter` can skip the keys prefix pins hold (its `pins` capability)."""
    return adapter.capabilities().pins is not None


def is_shared(adapter: L2Adapter) -> bool:
    """Whether other sidecars use `adapter`'s blobs (Redis): a blob failing its check there is a
    miss, never deleted (storage/base.py)."""
    return adapter.shared


def _removed(events: EventBus, tier: str, key: str, reason: str) -> None:
    """REMOVED from `tier` of the chunk an adapter names `key` (its serialized ObjectKey)."""
    try:
        parsed: ObjectKey | None = ObjectKey.parse(key)
    except ValueError:
        parsed = None  # not a key of ours: announced without one
    events.emit(Kind.REMOVED, tier=tier, key=parsed, reason=reason)
