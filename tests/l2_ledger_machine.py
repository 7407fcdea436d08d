"""A hypothesis state machine for the L2 side of the tenant ledger, shared by the unit test (mock
adapters) and the integration test (disk adapter, real files).

It drives the L2 tiers as the engine wires them (L2Tiers reporting into a real TenantLedger) with
random stores of several tenants' keys (new keys, keys stored again with another size, batches
that repeat a key), loads, deletes, per-tenant evictions, resizes, and adapters detached and
attached again. After every step, per adapter and tenant, the ledger's bytes and objects must be
the sums over the blobs the adapter holds, as the subclass reads them from the backend (`truth`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from app.settings import AdapterConfig
from engine.keys import Namespace, ObjectKey
from engine.l2.tiers import L2Tiers, Tier
from engine.tenants.ledger import TenantLedger
from storage import codec
from storage.base import L2Adapter
from storage.codec import EncodedBlob

T = TypeVar("T")

SALTS = ["", "a", "b/c", "other"]
FP = b"\x00" * 8
NS = Namespace("model", FP)


def key_of(salt: str, n: int) -> str:
    return ObjectKey(NS, salt, n.to_bytes(32, "little")).serialize()


def blob(key: str, size: int) -> EncodedBlob:
    return codec.encode(key, FP, bytes([len(key) % 251]) * size, codec.CodecOptions())


def salt_in(key: str) -> str:
    return ObjectKey.parse(key).salt


keys = st.tuples(st.sampled_from(SALTS), st.integers(0, 5))
sizes = st.integers(1, 3000)


class L2LedgerMachine(RuleBasedStateMachine):
    configs: Sequence[AdapterConfig] = ()

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.ledger = TenantLedger()
        self.tiers = L2Tiers(self.build, ledger=self.ledger)
        for config in self.configs:
            self.run(self.tiers.add(config))

    # --- what a subclass provides --------------------------------------------------------------

    def build(self, config: AdapterConfig) -> L2Adapter:
        raise NotImplementedError

    def truth(self, tier: Tier) -> dict[str, int]:
        """key -> bytes of every blob the adapter holds, read from its backend."""
        raise NotImplementedError

    def stored(self, tier: Tier, key: str, nbytes: int) -> None:
        """A store of `key` answered OK."""

    def reattached(self, tier: Tier) -> None:
        """The adapter was detached and a new one of the same config attached."""

    # --- plumbing ------------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def tier(self, which: int) -> Tier:
        return self.tiers.get(self.configs[which % len(self.configs)].name)

    def teardown(self) -> None:
        try:
            self.run(self.tiers.close())
        finally:
            self.loop.close()

    # --- rules ---------------------------------------------------------------------------------

    @rule(which=st.integers(0, 3), batch=st.lists(st.tuples(keys, sizes), min_size=1, max_size=4))
    def store(self, which: int, batch: list[tuple[tuple[str, int], int]]) -> None:
        tier = self.tier(which)
        items = [(key_of(salt, n), size) for (salt, n), size in batch]
        blobs = [(key, blob(key, size)) for key, size in items]
        for (key, b), result in zip(blobs, self.run(tier.adapter.store(blobs)), strict=True):
            if result.ok:
                self.stored(tier, key, b.nbytes)

    @rule(which=st.integers(0, 3), picked=st.lists(keys, min_size=1, max_size=4))
    def load(self, which: int, picked: list[tuple[str, int]]) -> None:
        tier = self.tier(which)
        self.run(tier.adapter.load([key_of(salt, n) for salt, n in picked]))

    @rule(which=st.integers(0, 3), picked=st.lists(keys, min_size=1, max_size=4))
    def delete(self, which: int, picked: list[tuple[str, int]]) -> None:
        tier = self.tier(which)
        self.run(tier.adapter.delete([key_of(salt, n) for salt, n in picked]))

    @rule(which=st.integers(0, 3), salt=st.sampled_from(SALTS), nbytes=st.integers(1, 8000))
    def evict_salt(self, which: int, salt: str, nbytes: int) -> None:
        tier = self.tier(which)
        before = self.truth(tier)
        freed = self.run(tier.adapter.evict_salt(salt, nbytes))
        after = self.truth(tier)
        gone = set(before) - set(after)
        assert set(after) <= set(before)
        assert all(salt_in(key) == salt for key in gone), "evicted another tenant's blob"
        assert freed == sum(before[key] for key in gone)
        held = sum(size for key, size in before.items() if salt_in(key) == salt)
        assert freed >= min(nbytes, held)

    @rule(which=st.integers(0, 3), capacity=st.integers(2000, 20000))
    def resize(self, which: int, capacity: int) -> None:
        self.run(self.tiers.resize(self.tier(which).name, capacity))

    @rule(which=st.integers(0, 3))
    def reattach(self, which: int) -> None:
        tier = self.tier(which)
        self.run(self.tiers.remove(tier.name, "drop"))
        assert all(self.ledger.held(salt, tier.name) == 0 for salt in SALTS)
        self.reattached(self.run(self.tiers.add(tier.config)))

    # --- the invariant -------------------------------------------------------------------------

    @invariant()
    def ledger_is_the_sum_of_what_each_adapter_holds(self) -> None:
        for tier in self.tiers.all():
            truth = self.truth(tier)
            per_salt: dict[str, tuple[int, int]] = {}
            for key, size in truth.items():
                b, n = per_salt.get(salt_in(key), (0, 0))
                per_salt[salt_in(key)] = (b + size, n + 1)
            for salt in SALTS:
                acct = self.ledger.account(salt)
                usage = None if acct is None else acct.tiers.get(tier.name)
                got = (0, 0) if usage is None else (usage.bytes, usage.objects)
                assert got == per_salt.get(salt, (0, 0)), (tier.name, salt, got, per_salt)
            held = tier.adapter.usage()
            assert (held.bytes_used, held.objects) == (sum(truth.values()), len(truth))
        for salt in self.ledger.tenants():
            acct = self.ledger.account(salt)
            assert acct is not None and acct.held > 0  # no quotas here: empty accounts are retired
