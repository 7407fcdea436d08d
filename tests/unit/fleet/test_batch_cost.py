"""The work one KV-event batch costs the directory is bounded by the batch, not multiplied by the
index: a batch of many AllBlocksCleared events (each a pass over the whole index, every instance's
chunks) makes one pass, and ends where the same events applied one by one would."""

from __future__ import annotations

import msgspec
import pytest

from fleet.index import ChunkIndex
from fleet.ingest import LoraBook, apply_batch, batch_decoder
from fleet.registry import InstanceRegistry
from fleet.spec import InstanceSpec


def _batch(events: list[dict[str, object]]) -> bytes:
    return msgspec.msgpack.encode([0.0, events, None, "i"])


def test_many_clears_in_one_batch_make_one_pass_over_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    passes = [0]
    clear = ChunkIndex.clear

    def counted(self: ChunkIndex, mask: int) -> None:
        passes[0] += 1
        clear(self, mask)

    monkeypatch.setattr(ChunkIndex, "clear", counted)
    r = InstanceRegistry(ChunkIndex(), timeout_s=1.0, max_instances=4)
    for name in ("honest", "evil"):
        r.register(InstanceSpec(id=name, url="http://a", events_endpoint="tcp://127.0.0.1:1"), 0.0)
    honest, evil = r.get("honest"), r.get("evil")
    assert honest is not None and evil is not None
    stores: list[dict[str, object]] = [{"type": "BlockStored", "block_hashes": [h]} for h in range(20_000)]
    apply_batch(r, honest, batch_decoder.decode(_batch(stores)), LoraBook())
    events: list[dict[str, object]] = []
    for i in range(5_000):
        events += [{"type": "BlockStored", "block_hashes": [10**6 + i]}, {"type": "AllBlocksCleared"}]
    events.append({"type": "BlockStored", "block_hashes": [7]})
    chunks, cleared = apply_batch(r, evil, batch_decoder.decode(_batch(events)), LoraBook())
    assert cleared
    assert passes[0] == 1, f"{passes[0]} passes over the index for one batch"
    # only the store after the last clear is left of the hostile instance's
    assert sum(1 for m in r.index.masks.values() if m & evil.mask()) == 1
    assert sum(1 for m in r.index.masks.values() if m & honest.mask()) == 20_000
    assert chunks >= 1
