"""Redis Cluster routing for the Redis adapter: seed URLs, the slot map, redirections.

Role: pure logic, no I/O. The adapter (storage/redis/adapter.py) asks CLUSTER SLOTS itself and
hands the reply to `SlotMap.from_reply`; every key is routed by `SlotMap.node_for` (CRC16 of the
key, or of its {hash tag}, modulo 16384, as Redis computes it); a MOVED reply moves one slot
(`SlotMap.move`) until the next full refresh replaces the map.

State: a SlotMap is owned by the adapter and touched by the event loop only.

Primitives in call order: seed_urls(url) (the URL's seed nodes, each as a URL of its own),
node_url(url, node), SlotMap.from_reply(reply), node_for(key), move(slot, node),
parse_redirect(message) (for the bulk lane, whose error replies are text).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from redis.crc import key_slot

from app.redact import redact_url

SLOTS = 16384

_REDIRECT = re.compile(r"^(MOVED|ASK) (\d+) (\S+):(\d+)$")


@dataclass(frozen=True, slots=True, order=True)
class Node:
    host: str
    port: int

    def describe(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Redirect:
    """A MOVED (the slot lives at `node` now) or ASK (this one command goes to `node`, after
    ASKING) reply."""

    ask: bool
    slot: int
    node: Node


def seed_urls(url: str) -> list[str]:
    """`redis://[user:pass@]h1:p1,h2:p2/0?opts` -> one URL per seed node (credentials, database
    and options kept); a URL with one host -> [url]."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or "," not in parts.netloc:
        return [url]
    auth, _, hosts = parts.netloc.rpartition("@")
    urls = []
    for hostport in hosts.split(","):
        if not hostport.strip():
            raise ValueError(f"an empty seed node in {redact_url(url)}")
        netloc = f"{auth}@{hostport.strip()}" if auth else hostport.strip()
        urls.append(urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)))
    return urls


def url_db(url: str) -> int:
    """The database a redis:// URL selects (its path, or ?db=), 0 when none."""
    parts = urlsplit(url)
    path = parts.path.strip("/")
    for item in parts.query.split("&"):
        name, _, value = item.partition("=")
        if name == "db" and value:
            path = value
    if not path:
        return 0
    try:
        return int(path)
    except ValueError:
        raise ValueError(f"not a database number: {path!r}") from None


def node_url(url: str, node: Node) -> str:
    """`url` (a seed's URL) pointed at `node`: same scheme, credentials, database, options."""
    parts = urlsplit(url)
    auth, at, _ = parts.netloc.rpartition("@")
    host = f"[{node.host}]" if ":" in node.host else node.host
    netloc = f"{auth}{at}{host}:{node.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def parse_redirect(message: str) -> Redirect | None:
    """'MOVED 3999 127.0.0.1:7102' / 'ASK 3999 127.0.0.1:7102' (a "redis: " prefix allowed)."""
    match = _REDIRECT.match(message.removeprefix("redis: "))
    if match is None:
        return None
    kind, slot, host, port = match.groups()
    return Redirect(kind == "ASK", int(slot), Node(host, int(port)))


class SlotMap:
    """slot -> the node that serves it (None: no node serves it; its keys are misses)."""

    __slots__ = ("_owners",)

    def __init__(self, owners: Sequence[Node | None]) -> None:
        if len(owners) != SLOTS:
            raise ValueError(f"a slot map has {SLOTS} slots, not {len(owners)}")
        self._owners = list(owners)

    @classmethod
    def from_reply(cls, reply: object, default_host: str) -> SlotMap:
        """From a CLUSTER SLOTS reply: [[start, end, [host, port, id, ...], replicas...], ...].
        An empty host (the node does not know its own address) is `default_host`."""
        owners: list[Node | None] = [None] * SLOTS
        if not isinstance(reply, list | tuple):
            raise ValueError(f"CLUSTER SLOTS answered {type(reply).__name__}")
        for entry in reply:
            start, end, master = int(entry[0]), int(entry[1]), entry[2]
            host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
            node = Node(host or default_host, int(master[1]))
            if not 0 <= start <= end < SLOTS:
                raise ValueError(f"CLUSTER SLOTS: bad range {start}-{end}")
            owners[start : end + 1] = [node] * (end - start + 1)
        return cls(owners)

    @staticmethod
    def slot(key: bytes) -> int:
        return int(key_slot(key))

    def node_for(self, key: bytes) -> Node | None:
        return self._owners[key_slot(key)]

    def owner(self, slot: int) -> Node | None:
        return self._owners[slot]

    def move(self, slot: int, node: Node) -> None:
        self._owners[slot] = node

    @property
    def nodes(self) -> list[Node]:
        return sorted({n for n in self._owners if n is not None})
