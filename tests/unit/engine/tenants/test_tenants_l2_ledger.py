"""The L2 side of the tenant ledger with in-memory adapters (one of them failing at random): after
any sequence of stores, overwrites, loads, deletes, per-tenant evictions, resizes and re-attaches,
the ledger's figures per adapter and tenant are the sums over the blobs the adapter holds."""

from __future__ import annotations

from app.settings import AdapterConfig
from engine.l2.tiers import Tier
from storage.base import L2Adapter
from storage.mock.adapter import MockAdapter
from storage.mock.config import MockAdapterConfig
from tests.l2_ledger_machine import L2LedgerMachine
from tests.machine_runs import machine_runs

KIB = 1024 / (1 << 30)  # capacity_gb of one KiB


class MockLedgerMachine(L2LedgerMachine):
    configs = (
        MockAdapterConfig(name="m1", capacity_gb=16 * KIB),
        MockAdapterConfig(name="m2", capacity_gb=12 * KIB, error_rate=0.3, seed=5),
    )

    def __init__(self) -> None:
        self.sizes: dict[str, dict[str, int]] = {c.name: {} for c in self.configs}
        super().__init__()

    def build(self, config: AdapterConfig) -> L2Adapter:
        assert isinstance(config, MockAdapterConfig)
        return MockAdapter(config)

    def truth(self, tier: Tier) -> dict[str, int]:
        # The mock holds exactly the bytes stored: the size of the last store of each key it lists.
        adapter = tier.adapter
        assert isinstance(adapter, MockAdapter)
        return {key: self.sizes[tier.name][key] for key in adapter.keys_lru()}

    def stored(self, tier: Tier, key: str, nbytes: int) -> None:
        self.sizes[tier.name][key] = nbytes

    def reattached(self, tier: Tier) -> None:
        self.sizes[tier.name] = {}


TestMockLedger = MockLedgerMachine.TestCase
TestMockLedger.settings = machine_runs(40, 40)
