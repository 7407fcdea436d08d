"""DirectoryMember: the sidecar's registration with a fleet directory (`fleet.directory_url`).

A supervised task posts the sidecar's InstanceSpec (fleet/spec.py) to `<directory>/v1/instances`
every `fleet.directory_heartbeat_s`: its id, HTTP URL, KV-event endpoints, the namespaces its
engines registered (every one since the start: chunks outlive their engine's registration), its
salt mode and the id of the deployment key hashing tenants, its L2 tiers (a Redis tier is shared, named by a
fingerprint of its address: host, port, database and key prefix, never the password), its L1 usage,
queue depth (requests holding read locks) and KV-event incarnation and last sequence (so the
directory notices a lost batch on a quiet stream).

Its bearer is `fleet.directory_token`: this sidecar's own credential, HMAC-SHA256 of the
directory's secret and its instance id (fleet/credentials.py), never the directory's admin token;
it registers this id only, and the directory presents it back on this sidecar's `GET /inventory`
(which accepts it beside the admin token), so the directory needs no sidecar's admin token.

The data plane never waits on it: a directory that is down or slow costs a failed POST (timeout
`fleet.directory_timeout_s`), retried with backoff (heartbeat, doubling to 30 s), logged once per
outage; the task itself never ends on an error.

State: the namespaces seen (bounded), the HTTP client, the outage flag. Event loop only.

Primitives in call order: DirectoryMember(settings, engine, kv_events, key_id, http_port) ->
spec() -> await run() (supervised; cancelled at shutdown).
"""

from __future__ import annotations

import asyncio
import socket
from collections import OrderedDict

import blake3
import httpx
import structlog

from app.kv_events import KvEvents
from app.settings import Settings
from engine.facade import CacheEngine
from fleet.spec import InstanceSpec, NamespaceSpec, TierSpec
from storage.config import AdapterConfigBase

log = structlog.get_logger("kvdepot.fleet")

_NAMESPACES_KEPT = 64


def shared_fingerprint(config: AdapterConfigBase) -> str | None:
    """Which shared backend a tier is (Redis: its nodes, database and key prefix; never
    credentials: `config.shared_location()`), 8 bytes of hash; None for a tier of its own."""
    location = config.shared_location()
    if location is None:
        return None
    return blake3.blake3(location.encode()).hexdigest(length=8)


class DirectoryMember:
    def __init__(
        self, settings: Settings, engine: CacheEngine, kv_events: KvEvents, key_id: str, http_port: int
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.kv_events = kv_events
        self.key_id = key_id
        f = settings.fleet
        host = settings.http.host
        self.id = f.instance_id or f"{socket.gethostname()}:{http_port}"
        self.url = f.advertise_url or f"http://{host if ':' not in host else f'[{host}]'}:{http_port}"
        self._namespaces: OrderedDict[tuple[str, str, int, int], NamespaceSpec] = OrderedDict()
        self.posts = 0
        self.failures = 0
        self._down = False

    def spec(self) -> InstanceSpec:
        for ns, layout in self.engine.engines.namespaces_seen.items():
            key = (ns.model, ns.layout_fp.hex(), ns.kv_rank, ns.group)
            if key not in self._namespaces:
                self._namespaces[key] = NamespaceSpec(
                    model=ns.model, layout_fp=ns.layout_fp.hex(), kv_rank=ns.kv_rank, group=ns.group,
                    block_size=layout.block_size, chunk_size=layout.chunk_size,
                )  # fmt: skip
                while len(self._namespaces) > _NAMESPACES_KEPT:
                    self._namespaces.popitem(last=False)
            self._namespaces.move_to_end(key)
        kv = self.settings.kv_events
        tiers = []
        if self.engine.l2 is not None:
            for tier in self.engine.l2.tiers.active():
                shared = shared_fingerprint(tier.config)
                tiers.append(TierSpec(medium=kv.medium(tier.name), shared=shared))
        alloc = self.engine.cache.allocator
        pub = self.kv_events.publisher
        return InstanceSpec(
            id=self.id, url=self.url, events_endpoint=str(kv.endpoint),
            replay_endpoint=kv.replay_endpoint, namespaces=list(self._namespaces.values()),
            salt_mode=kv.salt, salt_key_id=self.key_id if kv.salt == "hashed" else None, tiers=tiers,
            l1_medium=kv.medium("l1"),
            engine_url=self.settings.fleet.engine_url,
            l1_usage=min(1.0, alloc.used / alloc.capacity) if alloc.capacity else 0.0,
            queue_depth=self.engine.locked_requests(), incarnation=pub.incarnation,
            events_seq=pub.last_seq,
        )  # fmt: skip

    async def run(self) -> None:
        f = self.settings.fleet
        assert f.directory_url is not None
        target = f.directory_url.rstrip("/") + "/v1/instances"
        headers = {}
        if f.directory_token is not None:
            headers["Authorization"] = f"Bearer {f.directory_token.get_secret_value()}"
        delay = f.directory_heartbeat_s
        async with httpx.AsyncClient(timeout=f.directory_timeout_s) as client:
            while True:
                try:
                    spec = self.spec()
                    # l1_medium only when not the default: a directory from before it takes the rest
                    left_out = {"l1_medium"} if spec.l1_medium == "CPU" else None
                    body = spec.model_dump(mode="json", exclude=left_out)
                    resp = await client.post(target, json=body, headers=headers)
                    self.posts += 1
                    if resp.status_code >= 400:
                        raise RuntimeError(f"answered {resp.status_code}: {resp.text[:200]}")
                    if self._down:
                        log.info("directory_reachable", url=target)
                    self._down = False
                    delay = f.directory_heartbeat_s
                except Exception as exc:  # never ends the task: the next try comes after a pause
                    self.failures += 1
                    if not self._down:
                        log.warning("directory_unreachable", url=target, error=f"{type(exc).__name__}: {exc}")
                    self._down = True
                    delay = min(max(delay * 2, f.directory_heartbeat_s), 30.0)
                await asyncio.sleep(delay)
