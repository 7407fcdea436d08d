"""The L2 side of the tenant ledger with the disk adapter and real files: after any sequence of
stores, overwrites, loads, deletes, per-tenant evictions, resizes, files that vanish or are cut
short behind the adapter's back, and restarts of the adapter (its index rebuilt from the files),
the ledger's figures per tenant are the sums over the blob files on disk."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from engine.l2.tiers import Tier
from storage.base import L2Adapter
from storage.disk.adapter import DiskAdapter
from storage.disk.config import DiskAdapterConfig
from storage.registry import AdapterConfig, build_adapter
from tests.integration.l2_helpers import blob_files
from tests.l2_ledger_machine import L2LedgerMachine, key_of, keys

KIB = 1024 / (1 << 30)  # capacity_gb of one KiB


class DiskLedgerMachine(L2LedgerMachine):
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvdepot-ledger-"))
        self.configs = (
            DiskAdapterConfig(
                name="disk", paths=[self.dir], capacity_gb=16 * KIB, fsync="never", io_threads=2
            ),
        )
        super().__init__()

    def build(self, config: AdapterConfig) -> L2Adapter:
        return build_adapter(config, self.dir)

    def truth(self, tier: Tier) -> dict[str, int]:
        return {key: path.stat().st_size for key, path in blob_files(self.dir).items()}

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def disk(self) -> DiskAdapter:
        adapter = self.tiers.get("disk").adapter
        assert isinstance(adapter, DiskAdapter)
        return adapter

    @rule(picked=keys, cut=st.booleans())
    def file_changed_behind_its_back(self, picked: tuple[str, int], cut: bool) -> None:
        """A file vanishes or is cut short; the next load finds out and forgets the key."""
        key = key_of(*picked)
        path = self.disk().path_of(key)
        if path is None:
            return
        if cut:
            os.truncate(path, os.path.getsize(path) - 1)
        else:
            os.unlink(path)
        (result,) = self.run(self.disk().load([key]))
        assert not result.ok


TestDiskLedger = DiskLedgerMachine.TestCase
TestDiskLedger.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
