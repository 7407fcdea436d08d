"""What one registrant may do to the registry: move no other instance's endpoints (a live or static
one), index no more than its cap (live stores and listings alike), and hold no place once silent
`forget_after` timeouts; the per-instance credential binds an id; the inventory's lines are split
once, a line past the cap refused."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from app.errors import Conflict, Overloaded
from fleet.credentials import credential_ok, instance_credential
from fleet.http.subscriptions import MAX_LINE_BYTES, ResyncFailed, _read_lines
from fleet.index import ChunkIndex
from fleet.ingest import InventoryReader, LoraBook, apply_batch, batch_decoder
from fleet.registry import InstanceRegistry, Registered
from fleet.spec import InstanceSpec


def spec(name: str, url: str = "http://a", events: str = "tcp://127.0.0.1:1") -> InstanceSpec:
    return InstanceSpec(id=name, url=url, events_endpoint=events)


def registry(**kw: float) -> InstanceRegistry:
    return InstanceRegistry(ChunkIndex(), timeout_s=1.0, max_instances=int(kw.pop("max_instances", 8)), **kw)  # type: ignore[arg-type]


def test_endpoints_move_only_under_the_instances_own_credential() -> None:
    r = registry()
    assert r.register(spec("a"), 0.0) is Registered.NEW
    with pytest.raises(Conflict):
        r.register(spec("a", url="http://evil"), 0.5, own=False)  # live: the admin token moves nothing
    assert r.get("a").spec.url == "http://a"  # type: ignore[union-attr]
    assert r.register(spec("a"), 0.6, own=False) is Registered.REFRESHED  # same endpoints: a heartbeat
    assert r.register(spec("a", url="http://a2"), 0.7, own=True) is Registered.UPDATED
    assert r.register(spec("a", url="http://a3"), 5.0, own=False) is Registered.UPDATED  # silent: free
    r.register(spec("s", url="http://static"), 0.0, static=True)
    for own in (True, False):
        with pytest.raises(Conflict):
            r.register(spec("s", url="http://evil"), 0.1, own=own)


def test_silent_instances_are_swept_and_free_their_place() -> None:
    r = registry(max_instances=2, forget_after=3.0)
    r.register(spec("s"), 0.0, static=True)
    r.register(spec("x"), 0.0)
    with pytest.raises(Overloaded):
        r.register(spec("y"), 1.0)
    assert r.sweep(2.9) == [] and r.sweep(3.1) == ["x"] and r.forgotten == 1
    assert r.register(spec("y"), 3.2) is Registered.NEW
    assert r.sweep(100.0) == ["y"] and set(r.instances) == {"s"}  # static: never


def _batch(hashes: list[int]) -> bytes:
    events = [{"type": "BlockStored", "block_hashes": [h]} for h in hashes]
    return msgspec.msgpack.encode([0.0, events, None, "i"])


def test_live_stores_and_listings_capped_per_instance() -> None:
    r = registry(max_chunks=10)
    r.register(spec("a"), 0.0)
    inst = r.get("a")
    assert inst is not None
    apply_batch(r, inst, batch_decoder.decode(_batch(list(range(25)))), LoraBook())
    assert r.room(inst) == 0 and r.capped == 15 and len(r.index) == 10
    reader = InventoryReader(r, inst)
    lines = [b'{"kind":"header","incarnation":"i","seq":-1}']
    lines += [b'{"kind":"chunk","medium":"CPU","block_hashes":[%d]}' % h for h in range(100, 130)]
    reader.feed_page([*lines, b'{"kind":"end"}'])
    assert reader.finish() == ("i", -1)
    assert sorted(r.index.masks) == list(range(100, 110)) and r.capped == 35


def test_credentials_bind_the_id() -> None:
    c = instance_credential("secret", "a")
    assert len(c) == 64 and credential_ok("secret", "a", c)
    assert not credential_ok("secret", "b", c) and not credential_ok("other", "a", c)
    assert not credential_ok("secret", "a", None) and not credential_ok("secret", "a", "")


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for p in self.pieces:
            yield p


def _read(pieces: list[bytes]) -> InventoryReader:
    r = registry()
    r.register(spec("a"), 0.0)
    inst = r.get("a")
    assert inst is not None
    reader = InventoryReader(r, inst)
    asyncio.run(_read_lines(httpx.Response(200, stream=_Chunks(pieces)), reader))
    return reader


def test_inventory_lines_split_across_pieces_and_a_line_past_the_cap_refused() -> None:
    text = b'{"kind":"header","incarnation":"i","seq":4}\n'
    text += b'{"kind":"chunk","block_hashes":[7]}\n{"kind":"end"}'  # no medium: L1's
    reader = _read([text[i : i + 5] for i in range(0, len(text), 5)])  # lines cut anywhere
    assert reader.finish() == ("i", 4) and reader.resync.listed == 1
    assert list(reader.inst.holders) == ["CPU"] and reader.registry.index.get(7)
    with pytest.raises(ResyncFailed, match="longer than"):
        _read([b"x" * 4096] * (MAX_LINE_BYTES // 4096 + 2))
    with pytest.raises(ResyncFailed, match="longer than"):
        _read([b"y" * (MAX_LINE_BYTES + 1) + b"\n{}"])
