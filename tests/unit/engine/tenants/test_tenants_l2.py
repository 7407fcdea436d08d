"""Tenant quotas and usage in the L2 tiers, through the engine as app/main wires it (L1 cache,
tiers accounted in the tenant ledger, write-behind, in-memory adapters): usage per adapter, a
tenant over its quota evicting only its own blobs in that adapter, refusals, quota 0, lowered
quotas, allowlist mode, detached adapters, concurrent write-behind, metrics."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.metrics import TenantCollector
from engine.facade import CacheEngine
from engine.keys import ObjectKey
from engine.results import SlotStatus
from engine.tenants.ledger import TenantLedger
from engine.tenants.quota import L1, Quota
from storage.codec import blob_header
from storage.mock.adapter import MockAdapter
from storage.mock.config import MockAdapterConfig
from tests.factories import admin, l2_engine, seq, small_layout
from tests.unit.engine.tenants.writes import PAGE, store

pytestmark = pytest.mark.anyio

CHUNK = 16  # tokens per chunk; a chunk of small_layout() is 4 KiB
R, Q = SlotStatus.RESERVED, SlotStatus.QUOTA
TWO_MOCKS = [MockAdapterConfig(name="m1"), MockAdapterConfig(name="m2")]


async def settle(eng: CacheEngine) -> None:
    """Wait until everything committed so far was written behind (or refused)."""
    assert eng.l2 is not None
    assert await eng.l2.store.wait_idle(10)


def names(eng: CacheEngine, eid: int, toks: bytes, salt: str) -> list[str]:
    """The L2 keys of the chunks of `toks` for `salt`."""
    ns = eng.registration(eid).namespace
    return [ObjectKey(ns, salt, h).serialize() for h in eng.hasher.chunk_hashes(toks)]


def blob_bytes(eng: CacheEngine, eid: int, salt: str) -> int:
    """The size of one chunk's blob for `salt` (header with the key, then the raw payload)."""
    return blob_header.header_size(names(eng, eid, seq(1, 0), salt)[0]) + PAGE


def mock(eng: CacheEngine, name: str) -> MockAdapter:
    assert eng.l2 is not None
    adapter = eng.l2.tiers.get(name).adapter
    assert isinstance(adapter, MockAdapter)
    return adapter


async def assert_l2_ledger_true(eng: CacheEngine) -> None:
    """Per adapter and tenant, the ledger's bytes and objects are the sums over the blobs the adapter
    holds (read back: every held key is loaded, in its recency order, which keeps that order)."""
    assert eng.l2 is not None
    for tier in eng.l2.tiers.all():
        adapter = tier.adapter
        assert isinstance(adapter, MockAdapter)
        keys = adapter.keys_lru()
        truth: dict[str, list[int]] = {}
        for key, result in zip(keys, await adapter.load(keys), strict=True):
            assert result.ok and result.data is not None
            t = truth.setdefault(ObjectKey.parse(key).salt, [0, 0])
            t[0] += len(result.data)
            t[1] += 1
        for salt in set(truth) | set(eng.tenants.tenants()):
            acct = eng.tenants.account(salt)
            usage = None if acct is None else acct.tiers.get(tier.name)
            got = [0, 0] if usage is None else [usage.bytes, usage.objects]
            assert got == truth.get(salt, [0, 0]), (tier.name, salt)


# --- usage ---------------------------------------------------------------------------------------


async def test_l2_usage_is_in_the_ledger_per_adapter_and_storing_again_counts_once() -> None:
    async with l2_engine(64 * PAGE, TWO_MOCKS) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        store(eng, eid, seq(3, 0), "a", tag=1)
        store(eng, eid, seq(2, 0), "tenant/b", tag=2)
        await settle(eng)
        ba, bb = blob_bytes(eng, eid, "a"), blob_bytes(eng, eid, "tenant/b")
        assert ba != bb  # the salt is part of the key, which is part of the header
        for name in ("m1", "m2"):
            assert (eng.tenants.held("a", name), eng.tenants.held("tenant/b", name)) == (3 * ba, 2 * bb)
        eng.clear()  # L1 only: the same chunks stored again are written behind again
        store(eng, eid, seq(3, 0), "a", tag=1)
        await settle(eng)
        assert eng.l2 is not None and eng.l2.store.counters.written == 8
        assert eng.tenants.held("a", "m1") == 3 * ba
        assert asdict(admin(eng).quota("a"))["tiers"] == {
            "l1": {"limit_bytes": None, "bytes": 3 * PAGE, "objects": 3, "hits": 0, "misses": 0,
                   "evictions": 0, "evicted_bytes": 0, "quota_refusals": 0},
            "m1": {"limit_bytes": None, "bytes": 3 * ba, "objects": 3, "hits": 0, "misses": 0,
                   "evictions": 0, "evicted_bytes": 0, "quota_refusals": 0},
            "m2": {"limit_bytes": None, "bytes": 3 * ba, "objects": 3, "hits": 0, "misses": 0,
                   "evictions": 0, "evicted_bytes": 0, "quota_refusals": 0},
        }  # fmt: skip
        await mock(eng, "m2").delete(names(eng, eid, seq(2, 0), "a"))
        assert eng.tenants.held("a", "m2") == ba
        await assert_l2_ledger_true(eng)


# --- per-tenant eviction -------------------------------------------------------------------------


async def test_over_quota_evicts_the_tenants_own_lru_blobs_in_that_adapter_only() -> None:
    async with l2_engine(64 * PAGE, TWO_MOCKS) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        ba = blob_bytes(eng, eid, "a")
        eng.tenants.set_quota("a", Quota(l2_bytes=4 * ba))
        store(eng, eid, seq(3, 0), "b", tag=2)
        store(eng, eid, seq(4, 1), "a", tag=1, which=1)  # a is at its quota in both adapters
        await settle(eng)
        old = names(eng, eid, seq(4, 1), "a")
        await mock(eng, "m1").load(old[:2])  # in m1, a's least recently used are now chunks 2, 3
        store(eng, eid, seq(2, 2), "a", tag=1, which=2)
        await settle(eng)
        new = names(eng, eid, seq(2, 2), "a")
        of_b = names(eng, eid, seq(3, 0), "b")
        assert mock(eng, "m1").keys_lru() == [*of_b, old[0], old[1], *new]
        assert mock(eng, "m2").keys_lru() == [*of_b, old[2], old[3], *new]
        for name in ("m1", "m2"):
            assert eng.tenants.held("a", name) == 4 * ba
            acct_a, acct_b = eng.tenants.account("a"), eng.tenants.account("b")
            assert acct_a is not None and acct_b is not None
            assert (acct_a.tiers[name].evictions, acct_a.tiers[name].evicted_bytes) == (2, 2 * ba)
            assert acct_b.tiers[name].evictions == 0
        assert eng.l2 is not None
        assert eng.l2.store.counters.quota_evicted_bytes == 4 * ba
        assert eng.l2.store.counters.quota_refused == 0
        assert eng.tenants.held("a", L1) == 6 * PAGE  # L1 is not limited: nothing left it
        await assert_l2_ledger_true(eng)


async def test_a_blob_larger_than_the_quota_is_refused_and_counted() -> None:
    async with l2_engine(64 * PAGE, TWO_MOCKS) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        eng.tenants.set_quota("a", Quota(l2_bytes=PAGE))  # less than one blob (header + page)
        assert [s.status for s in store(eng, eid, seq(3, 0), "a")] == [R, R, R]
        await settle(eng)
        assert mock(eng, "m1").keys_lru() == [] and mock(eng, "m2").keys_lru() == []
        acct = eng.tenants.account("a")
        assert acct is not None
        assert (acct.tiers["m1"].quota_refusals, acct.tiers["m2"].quota_refusals) == (3, 3)
        assert acct.l1.quota_refusals == 0
        assert eng.l2 is not None and eng.l2.store.counters.quota_refused == 6
        assert eng.tenants.summary()["quota_refused_chunks"] == 6


async def test_quota_zero_stores_nothing_in_l2_and_a_lowered_zero_empties_it_at_the_next_write() -> None:
    async with l2_engine(64 * PAGE, TWO_MOCKS) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        assert eng.l2 is not None
        eng.tenants.set_quota("z", Quota(l2_bytes=0))
        store(eng, eid, seq(3, 0), "z")
        await settle(eng)
        assert eng.tenants.held("z", L1) == 3 * PAGE  # L1 takes it: only L2 is closed to z
        assert mock(eng, "m1").keys_lru() == [] and mock(eng, "m2").keys_lru() == []
        assert eng.l2.store.counters.submitted == 0  # refused before anything was locked or encoded
        assert (eng.l2.store.counters.skipped_quota, eng.l2.store.counters.quota_refused) == (3, 0)
        acct = eng.tenants.account("z")
        assert acct is not None and acct.tiers["m1"].quota_refusals == 3

        store(eng, eid, seq(2, 1), "y", which=1)
        await settle(eng)
        eng.tenants.set_quota("y", Quota(l2_bytes=0))
        assert len(mock(eng, "m1").keys_lru()) == 2  # nothing happens until y writes again
        store(eng, eid, seq(1, 2), "y", which=2)
        await settle(eng)
        assert mock(eng, "m1").keys_lru() == [] and mock(eng, "m2").keys_lru() == []
        assert (eng.tenants.held("y", "m1"), eng.tenants.held("y", "m2")) == (0, 0)
        await assert_l2_ledger_true(eng)


async def test_a_lowered_quota_takes_effect_at_the_tenants_next_write_to_the_tier() -> None:
    async with l2_engine(64 * PAGE, [MockAdapterConfig(name="m1")]) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        ba = blob_bytes(eng, eid, "a")
        store(eng, eid, seq(6, 0), "a")
        store(eng, eid, seq(2, 0), "b")
        await settle(eng)
        eng.tenants.set_quota("a", Quota(l2_bytes=3 * ba))
        assert eng.tenants.held("a", "m1") == 6 * ba  # until a writes to m1 again
        assert admin(eng).quota("a").tiers["m1"].limit_bytes == 3 * ba
        store(eng, eid, seq(1, 5), "a", which=5)
        await settle(eng)
        assert eng.tenants.held("a", "m1") == 3 * ba
        kept = names(eng, eid, seq(6, 0), "a")[4:] + names(eng, eid, seq(1, 5), "a")
        assert [k for k in mock(eng, "m1").keys_lru() if ObjectKey.parse(k).salt == "a"] == kept
        assert eng.tenants.held("b", "m1") == 2 * blob_bytes(eng, eid, "b")
        await assert_l2_ledger_true(eng)


async def test_a_quota_set_below_what_a_tenant_holds_is_met_at_once_in_l1_and_l2() -> None:
    async with l2_engine(64 * PAGE, [MockAdapterConfig(name="m1")]) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        ba = blob_bytes(eng, eid, "a")
        store(eng, eid, seq(6, 0), "a")
        store(eng, eid, seq(2, 0), "b")
        await settle(eng)
        assert eng.tenants.held("a", L1) == 6 * PAGE
        # The tenant writes nothing more: the PUT itself brings it down, its oldest first.
        answer = await admin(eng).set_quota("a", Quota(l1_bytes=2 * PAGE, l2_bytes=3 * ba))
        assert eng.tenants.held("a", L1) == 2 * PAGE and eng.tenants.held("a", "m1") == 3 * ba
        assert answer.tiers["m1"].bytes == 3 * ba and answer.tiers[L1].bytes == 2 * PAGE
        kept = names(eng, eid, seq(6, 0), "a")[3:]
        assert [k for k in mock(eng, "m1").keys_lru() if ObjectKey.parse(k).salt == "a"] == kept
        assert eng.tenants.held("b", "m1") == 2 * blob_bytes(eng, eid, "b")  # never another's
        assert eng.tenants.held("b", L1) == 2 * PAGE
        await assert_l2_ledger_true(eng)


async def test_allowlist_mode_keeps_salts_without_a_quota_out_of_l2() -> None:
    async with l2_engine(64 * PAGE, TWO_MOCKS) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        eng.tenants.set_quota("ok", Quota())  # listed, unlimited
        # A reservation made before allowlist mode was turned on is committed after it.
        slots = eng.store(eid, "w", seq(2, 0), "stranger")
        eng.tenants.allowlist = True
        assert all(eng.commit(eid, [s.oid for s in slots]))
        store(eng, eid, seq(2, 0), "ok")
        assert [s.status for s in store(eng, eid, seq(2, 1), "")] == [Q, Q]
        await settle(eng)
        for name in ("m1", "m2"):
            assert {ObjectKey.parse(k).salt for k in mock(eng, name).keys_lru()} == {"ok"}
        stranger = eng.tenants.account("stranger")
        assert stranger is not None and stranger.tiers["m1"].quota_refusals == 2
        await assert_l2_ledger_true(eng)


# --- adapters come and go ----------------------------------------------------------------------


async def test_a_detached_adapter_is_forgotten_and_a_new_one_of_that_name_starts_from_zero() -> None:
    async with l2_engine(64 * PAGE, TWO_MOCKS) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        assert eng.l2 is not None
        store(eng, eid, seq(3, 0), "a")
        await settle(eng)
        await admin(eng).remove_adapter("m2", "drain")
        assert eng.tenants.held("a", "m2") == 0
        assert set(admin(eng).quota("a").tiers) == {"l1", "m1"}
        await admin(eng).add_adapter(MockAdapterConfig(name="m2"))
        assert eng.tenants.held("a", "m2") == 0
        store(eng, eid, seq(1, 1), "a", which=1)
        await settle(eng)
        assert eng.tenants.held("a", "m2") == blob_bytes(eng, eid, "a")
        await admin(eng).resize_adapter("m1", 2 * blob_bytes(eng, eid, "a"))  # capacity eviction: reported
        assert eng.tenants.held("a", "m1") == 2 * blob_bytes(eng, eid, "a")
        acct = eng.tenants.account("a")
        assert acct is not None and acct.tiers["m1"].evictions == 2
        await assert_l2_ledger_true(eng)


# --- concurrency ---------------------------------------------------------------------------------


class PeakLedger(TenantLedger):
    """A real ledger that remembers the most each tenant ever held in each L2 tier."""

    def __init__(self) -> None:
        super().__init__()
        self.peak: dict[tuple[str, str], int] = {}

    def charge(self, salt: str, tier: str, nbytes: int, objects: int = 1) -> None:
        super().charge(salt, tier, nbytes, objects)
        if tier != L1:
            held = self.held(salt, tier)
            self.peak[salt, tier] = max(self.peak.get((salt, tier), 0), held)


async def test_concurrent_write_behind_batches_never_take_a_tenant_past_its_quota() -> None:
    ledger = PeakLedger()
    slow = [MockAdapterConfig(name="m1", latency_ms=2)]  # writes overlap across the workers
    async with l2_engine(64 * PAGE, slow, store_workers=3, ledger=ledger) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        ba = blob_bytes(eng, eid, "a")
        eng.tenants.set_quota("a", Quota(l2_bytes=5 * ba))
        for which in range(6):
            store(eng, eid, seq(4, which), "a", which=which)
            store(eng, eid, seq(1, which), "b", which=which)
        await settle(eng)
        assert eng.l2 is not None and eng.l2.store.counters.written >= 6
        assert ledger.peak["a", "m1"] <= 5 * ba
        assert 0 < eng.tenants.held("a", "m1") <= 5 * ba
        assert eng.tenants.held("b", "m1") == 6 * blob_bytes(eng, eid, "b")
        await assert_l2_ledger_true(eng)


# --- metrics -------------------------------------------------------------------------------------


async def test_metrics_label_each_adapter_as_a_tier_with_bounded_tenants() -> None:
    async with l2_engine(64 * PAGE, TWO_MOCKS) as (eng, _):
        eid = eng.register("m", small_layout()).engine_id
        ba = blob_bytes(eng, eid, "a")
        eng.tenants.set_quota("a", Quota(l2_bytes=10 * ba))
        store(eng, eid, seq(4, 0), "a")
        for i in range(5):
            store(eng, eid, seq(1, 10 + i), f"t{i}", which=10 + i)
        await settle(eng)
        registry = CollectorRegistry()
        registry.register(TenantCollector(eng, 1))
        samples = {
            (s.name, s.labels["tenant"], s.labels["tier"]): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples
        }
        assert {t for (_, t, _) in samples} == {"a", "other"}
        assert {tier for (_, _, tier) in samples} == {"l1", "m1", "m2"}
        assert samples[("kvdepot_tenant_bytes", "a", "m1")] == 4 * ba
        assert samples[("kvdepot_tenant_objects", "other", "m2")] == 5
        assert samples[("kvdepot_tenant_quota_bytes", "a", "m2")] == 10 * ba
        assert ("kvdepot_tenant_quota_bytes", "a", "l1") not in samples  # unlimited in L1
