"""Wiring of the KV-event publisher (api/kvevents): built from `settings.kv_events` when its
endpoint is set, bound at build time (a bad endpoint is a ConfigError), its sockets watched from
the loop once the service runs, subscribed to the event bus, its figures in the registry and its
inventory on the control plane.

Primitives in call order: build_kv_events(settings, engine, deployment_key, registry) -> KvEvents
| None -> KvEvents.start() (on the loop) -> KvEvents.close().
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from api.kvevents.blocks import BlockNamer
from api.kvevents.config import KvEventsSettings
from api.kvevents.inventory import Inventory
from api.kvevents.metrics import KvEventsCollector
from api.kvevents.publisher import KvEventPublisher
from engine.facade import CacheEngine


@dataclass(frozen=True, slots=True)
class KvEvents:
    publisher: KvEventPublisher
    inventory: Inventory

    def start(self) -> None:
        self.publisher.start()

    def close(self) -> None:
        self.publisher.close()


def build_kv_events(
    settings: KvEventsSettings, engine: CacheEngine, deployment_key: bytes, registry: CollectorRegistry
) -> KvEvents | None:
    if settings.endpoint is None:
        return None

    layout_of = engine.engines.layout  # outlives the registration: removals come later
    namer = BlockNamer(
        salt_mode=settings.salt, deployment_key=deployment_key, layout_of=layout_of, medium=settings.medium
    )
    publisher = KvEventPublisher(settings, namer)
    publisher.bind()
    registry.register(KvEventsCollector(publisher))
    return KvEvents(publisher, Inventory(engine, namer, publisher))
