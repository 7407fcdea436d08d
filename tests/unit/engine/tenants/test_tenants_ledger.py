"""The tenant ledger: its figures equal the true sums after any sequence of operations (property
test through the engine facade with a fake clock), accounts come and go, labels stay bounded."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from app.errors import InvalidInput
from engine.facade import CacheEngine
from engine.l1.allocator import ExtentAllocator
from engine.l1.arena import SealedArena
from engine.l1.cache import L1Cache
from engine.l1.eviction import LRUPolicy
from engine.results import SlotStatus
from engine.tenants.ledger import OTHER, LedgerError, TenantLedger
from engine.tenants.quota import L1, LIMIT_MAX, Quota
from tests.factories import FakeClock, small_layout, tokens
from tests.machine_runs import machine_runs

CHUNK = 16
PAGE = 4096
SALTS = ["", "a", "b", "other"]


class EngineLedgerMachine(RuleBasedStateMachine):
    """Random stores (committed, aborted or left to expire), lookups (released or left to expire),
    clears, quota changes and time passing, through the facade of an engine whose arena is small
    enough for global evictions. After every step, per tenant: the ledger's bytes and objects are
    the sums over that tenant's objects in the arena; their total is the allocator's used bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.arena = SealedArena.create_sealed(12 * PAGE, f"test{uuid.uuid4().hex[:8]}", populate=False)
        cache = L1Cache(
            ExtentAllocator(self.arena.size, PAGE), LRUPolicy(), high_watermark=0.9, low_watermark=0.6,
            write_lease_s=5.0,
        )  # fmt: skip
        self.eng = CacheEngine(
            arena=self.arena, cache=cache, chunk_size=CHUNK, read_lease_s=8.0, clock=self.clock
        )
        self.eid = self.eng.register("m", small_layout()).engine_id
        # Quotas from the start, so that per-tenant evictions happen from the first steps on.
        self.eng.tenants.set_quota("a", Quota(l1_bytes=3 * PAGE))
        self.eng.tenants.set_quota("other", Quota(l1_bytes=2 * PAGE))
        self.pending: list[int] = []
        self.n = 0

    def teardown(self) -> None:
        self.arena.close()

    @rule(
        salt=st.sampled_from(SALTS),
        which=st.integers(0, 4),
        chunks=st.integers(1, 5),
        finish=st.sampled_from(["commit", "commit", "commit", "abort", "leave"]),
    )
    def store(self, salt: str, which: int, chunks: int, finish: str) -> None:
        self.n += 1
        toks = tokens(chunks * CHUNK, start=which * 1000)
        slots = self.eng.store(self.eid, f"w{self.n}", toks, salt)
        oids = [s.oid for s in slots if s.status is SlotStatus.RESERVED]
        if finish == "commit":
            self.eng.commit(self.eid, oids)
        elif finish == "abort":
            self.eng.abort(self.eid, oids)
        else:
            self.pending.extend(oids)

    @rule(salt=st.sampled_from(SALTS), which=st.integers(0, 4), chunks=st.integers(1, 5), end=st.booleans())
    def lookup(self, salt: str, which: int, chunks: int, end: bool) -> None:
        self.n += 1
        rid = f"r{self.n % 3}"  # a few request ids: repeated lookups replace earlier locks
        self.eng.lookup(self.eid, rid, tokens(chunks * CHUNK, start=which * 1000), salt)
        if end:
            self.eng.end_request(self.eid, rid)

    @rule(data=st.data())
    def commit_late(self, data: st.DataObject) -> None:
        if self.pending:
            oid = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
            self.eng.commit(self.eid, [oid])  # False when its lease expired meanwhile

    @rule(salt=st.one_of(st.none(), st.sampled_from(SALTS)))
    def clear(self, salt: str | None) -> None:
        self.eng.clear(salt)

    @rule(salt=st.sampled_from(SALTS), pages=st.one_of(st.none(), st.integers(0, 6)), drop=st.booleans())
    def change_quota(self, salt: str, pages: int | None, drop: bool) -> None:
        if drop:
            self.eng.tenants.drop_quota(salt)
        else:
            self.eng.tenants.set_quota(salt, Quota(l1_bytes=None if pages is None else pages * PAGE))

    @rule(allow=st.booleans())
    def allowlist(self, allow: bool) -> None:
        self.eng.tenants.allowlist = allow

    @rule(seconds=st.floats(0, 10))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.eng.reap()

    @invariant()
    def ledger_is_true(self) -> None:
        cache, ledger = self.eng.cache, self.eng.tenants
        cache.allocator.check()
        truth: dict[str, tuple[int, int]] = {}
        for obj in cache.objects():
            b, n = truth.get(obj.key.salt, (0, 0))
            truth[obj.key.salt] = (b + cache.allocator.aligned(obj.size), n + 1)
        for salt in SALTS:
            acct = ledger.account(salt)
            got = (0, 0) if acct is None else (acct.l1.bytes, acct.l1.objects)
            assert got == truth.get(salt, (0, 0)), salt
            assert ledger.held(salt, L1) == got[0]
            if acct is not None:
                assert acct.held > 0 or ledger.quota(salt) is not None
        assert sum(b for b, _ in truth.values()) == cache.allocator.used
        labelled = ledger.labelled(2)
        assert sum(t[L1].bytes for t in labelled.values()) == cache.allocator.used


TestEngineLedger = EngineLedgerMachine.TestCase
TestEngineLedger.settings = machine_runs(50, 40)


# --- the ledger on its own ----------------------------------------------------------------------


def test_accounts_exist_while_a_tenant_holds_bytes_or_has_a_quota() -> None:
    ledger = TenantLedger()
    ledger.charge("a", L1, 100)
    ledger.note_lookup("a", 2, 1)
    assert ledger.tenants() == ["a"]
    ledger.credit("a", L1, 100)
    assert ledger.tenants() == []
    other = ledger.labelled(5)[OTHER][L1]
    assert (other.hits, other.misses, other.bytes) == (2, 1, 0)  # counters survive the account
    ledger.set_quota("b", Quota(l1_bytes=0))
    assert ledger.tenants() == ["b"]
    assert ledger.drop_quota("b") is True
    assert ledger.drop_quota("b") is False
    assert ledger.tenants() == []


def test_limits_default_mode_and_allowlist_mode() -> None:
    ledger = TenantLedger(quotas={"a": Quota(l1_bytes=5, l2_bytes=7)})
    assert (ledger.limit("a", L1), ledger.limit("a", "disk"), ledger.limit("a", "redis")) == (5, 7, 7)
    assert ledger.limit("b", L1) is None
    ledger.allowlist = True
    assert ledger.limit("b", L1) == 0
    assert ledger.limit("a", L1) == 5


def test_a_credit_without_a_charge_is_a_bug_that_raises() -> None:
    ledger = TenantLedger()
    with pytest.raises(LedgerError):
        ledger.credit("a", L1, 1)
    ledger.charge("a", L1, 10)
    with pytest.raises(LedgerError):
        ledger.credit("a", L1, 11)
    assert ledger.held("a", L1) == 10


def test_l2_tiers_report_into_the_same_ledger_and_can_be_forgotten() -> None:
    ledger = TenantLedger()
    ledger.charge("a", L1, 10)
    ledger.charge("a", "disk", 30)
    ledger.charge("b", "disk", 5)
    ledger.note_eviction("b", "disk", 5)
    assert (ledger.held("a", "disk"), ledger.held("a", L1)) == (30, 10)
    acct = ledger.account("a")
    assert acct is not None and acct.held == 40
    ledger.forget_tier("disk")
    assert ledger.held("a", "disk") == 0 and ledger.tenants() == ["a"]  # b held only disk bytes
    assert ledger.labelled(5)[OTHER]["disk"].evictions == 1
    with pytest.raises(ValueError, match="L1"):
        ledger.forget_tier(L1)


def test_labels_name_the_top_n_by_bytes_and_sum_the_rest_as_other() -> None:
    ledger = TenantLedger()
    for salt, nbytes in (("", 50), ("a", 40), ("b", 30), ("c", 20), ("other", 90), ("_default", 80)):
        ledger.charge(salt, L1, nbytes)
        ledger.note_lookup(salt, 1, 0)
    rows = ledger.labelled(2)
    # "other" and "_default" as real salts would collide with the reserved labels: never named.
    assert set(rows) == {"_default", "a", OTHER}
    assert rows["_default"][L1].bytes == 50  # the empty salt
    assert rows[OTHER][L1].bytes == 30 + 20 + 90 + 80
    assert sum(r[L1].hits for r in rows.values()) == 6
    assert set(ledger.labelled(0)) == {OTHER}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "0.."),
        (LIMIT_MAX + 1, "0.."),
        (1.0, "integer"),
        ("5", "integer"),
        (True, "integer"),
    ],
)
def test_quota_limits_must_be_integers_in_range(value: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        Quota(l1_bytes=value)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=message):
        Quota.from_json({"l2_bytes": value})


def test_quota_from_json() -> None:
    assert Quota.from_json({}) == Quota()
    assert Quota.from_json({"l1_bytes": 0, "l2_bytes": None}) == Quota(l1_bytes=0)
    assert Quota.from_json({"l1_bytes": LIMIT_MAX}).to_json() == {"l1_bytes": LIMIT_MAX, "l2_bytes": None}
    with pytest.raises(InvalidInput, match="unknown quota field"):
        Quota.from_json({"l3_bytes": 1})
    with pytest.raises(InvalidInput, match="object"):
        Quota.from_json([1, 2])
