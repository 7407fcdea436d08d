"""The L2 side of the tenant ledger with the slab adapter and a real slab file: after any sequence
of stores, overwrites, loads, deletes, per-tenant evictions, resizes and restarts of the adapter
(its index rebuilt from the slots and the checkpoint), the ledger's figures per tenant are the sums
over the blobs the adapter's slots hold, read back from the file (each indexed slot's headers must
name its key at its generation)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings

from engine.l2.tiers import Tier
from storage.base import L2Adapter
from storage.registry import AdapterConfig, build_adapter
from storage.slab import headers as fmt
from storage.slab.adapter import SlabAdapter
from storage.slab.config import SlabAdapterConfig
from tests.l2_ledger_machine import L2LedgerMachine

SLOT = 8192  # a blob of up to 4 KiB of payload and its headers


class SlabLedgerMachine(L2LedgerMachine):
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvdepot-ledger-", dir="/var/tmp"))
        self.configs = (
            SlabAdapterConfig(
                name="slab", paths=[self.dir / "a", self.dir / "b"], size_bytes=4096 + 6 * SLOT,
                slot_bytes=SLOT, fsync="never", io_threads=2, checkpoint_s=0.001,
            ),
        )  # fmt: skip
        super().__init__()

    def build(self, config: AdapterConfig) -> L2Adapter:
        return build_adapter(config, self.dir)

    def truth(self, tier: Tier) -> dict[str, int]:
        adapter = tier.adapter
        assert isinstance(adapter, SlabAdapter)
        found: dict[str, int] = {}
        for key in adapter.keys_lru():
            where = adapter.slot_of(key)
            assert where is not None
            path, at, _ = where
            with open(path, "rb") as f:
                f.seek(at)
                area = f.read(4096)
            superblock = fmt.parse_super(Path(path).read_bytes()[:4096])
            header = fmt.parse_slot(area, superblock.file_id, (at - 4096) // SLOT)
            assert header is not None, f"{key}: its slot has no valid header"
            blob = fmt.slot_blob(area, header)
            assert blob is not None and blob[0] == key, f"{key}: its slot holds another blob"
            found[key] = header.blob_len
        return found

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


TestSlabLedger = SlabLedgerMachine.TestCase
TestSlabLedger.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
